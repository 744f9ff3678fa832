"""``coserve usage`` against the real app over HTTP: the Usage API's buckets as a table, and as JSON."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from app.cli import cli
from app.db.models import Job, Tenant, utcnow
from app.db.session import session_scope

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def test_usage_shows_each_tenants_tokens_and_slos(live_server, keys, settings):
    with session_scope(settings.sqlalchemy_url) as s:
        globex = s.scalars(select(Tenant.id).where(Tenant.name == "globex")).one()
        hour_ago = utcnow() - timedelta(hours=1)
        common = {"kind": "interactive", "tier": "paid", "model": "tiny", "sampling": {}, "status": "succeeded",
                  "created_at": hour_ago, "completion_tokens": 7}
        s.add_all([Job(tenant_id=keys.tenant_id, prompt_tokens=120, slo_met=True, **common),
                   Job(tenant_id=keys.tenant_id, prompt_tokens=80, slo_met=False, **common),
                   Job(tenant_id=globex, prompt_tokens=5000, slo_met=True, **common)])
        s.commit()
    run = CliRunner()
    res = run.invoke(cli, ["usage", "--url", live_server, "--key", keys.admin, "--by", "project_id", "--json"])
    assert res.exit_code == 0, res.output
    results = [r for b in json.loads(res.output) for r in b["results"]]
    assert sorted((r["project_id"], r["input_tokens"], r["num_slo_met"], r["num_slo_missed"]) for r in results) == \
        sorted([(keys.tenant_id, 200, 1, 1), (globex, 5000, 1, 0)])

    res = run.invoke(cli, ["usage", "--url", live_server, "--key", keys.paid, "--bucket", "1d", "--days", "2"],
                     env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    total = next(line for line in res.output.splitlines() if line.strip().startswith("total")).split()
    assert total == ["total", "2", "200", "0", "14", "1", "1", "0"], res.output  # acme's own: not globex's
    res = run.invoke(cli, ["usage", "--url", live_server, "--key", keys.paid, "--bucket", "1w"])
    # a usage error that names the option given and its choices, not the page size the command sends with it
    assert res.exit_code == 2 and "--bucket" in res.output and "choose 1m, 1h, 1d" in res.output, res.output
    assert "limit" not in res.output, res.output


def test_usage_admin_with_a_key_uses_that_key_and_refuses_one_that_is_not_an_admin_key(live_server, keys, settings):
    """`usage --admin --key K` ignored --admin: a tenant's key showed its own tenant's usage under --admin's promise of
    every tenant's. An admin key given with --key shows every tenant's; a tenant's key is refused, naming the fix."""
    with session_scope(settings.sqlalchemy_url) as s:
        globex = s.scalars(select(Tenant.id).where(Tenant.name == "globex")).one()
        common = {"kind": "interactive", "tier": "paid", "model": "tiny", "sampling": {}, "status": "succeeded",
                  "created_at": utcnow() - timedelta(hours=1), "completion_tokens": 7, "prompt_tokens": 10}
        s.add_all([Job(tenant_id=keys.tenant_id, **common), Job(tenant_id=globex, **common)])
        s.commit()
    run = CliRunner()
    res = run.invoke(cli, ["usage", "--admin", "--url", live_server, "--key", keys.paid, "--json"])
    assert res.exit_code == 2 and res.stdout == "", res.output
    said = " ".join(res.stderr.replace("\u2502", " ").split())
    assert "--admin" in said and "the key given is not an admin key" in said, res.stderr
    res = run.invoke(cli, ["usage", "--admin", "--url", live_server, "--key", keys.admin, "--by", "project_id",
                           "--json"])
    assert res.exit_code == 0, res.output
    assert sorted(r["project_id"] for b in json.loads(res.stdout) for r in b["results"]) == \
        sorted([keys.tenant_id, globex])
