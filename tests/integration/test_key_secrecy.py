"""An API key's secret is shown once, where it is made, and nowhere after: not in any log line (every logger at DEBUG,
through a key's creation by the admin API and the CLI, a full request with it, an auth failure and its revocation),
nor in a listing of keys (the admin API's and ``coserve keys list``'s, which show the prefix only)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tests.conftest import Keys

pytestmark = pytest.mark.integration

H = Keys.header


def secret_part(key: str, prefix: str) -> str:
    """What a key has beyond the prefix listings show of it."""
    assert key.startswith(prefix) and len(key) - len(prefix) >= 32, (key, prefix)
    return key[len(prefix):]


@pytest.fixture
def debug_logs(caplog) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)  # the root and so every logger that propagates (the app's, SQLAlchemy's, httpx's)
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.NOTSET)  # none held above DEBUG on its own
    yield caplog
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


def test_no_key_is_logged_or_listed(client, keys, settings, debug_logs):
    admin = H(keys.admin)
    made = client.post("/v1/admin/tenants", json={"name": "initech"}, headers=admin)
    assert made.status_code == 201, made.text
    tenant_id, first = made.json()["tenant_id"], made.json()["api_key"]
    second = client.post(f"/v1/admin/tenants/{tenant_id}/keys", json={"tier": "free"}, headers=admin).json()
    env = {"COSERVE_DATA_DIR": str(settings.data_dir), "COSERVE_DATABASE_URL": settings.sqlalchemy_url}
    res = CliRunner().invoke(cli, ["keys", "create", "--tenant", "initech", "--json"], env=env)
    assert res.exit_code == 0, res.output
    third = json.loads(res.output)["api_key"]

    job = client.post("/v1/jobs", json={"prompt": "hi"}, headers=H(first))  # a full request, from auth to SQL
    assert job.status_code in (200, 201), job.text
    assert client.get(f"/v1/jobs/{job.json()['id']}", headers=H(first)).status_code == 200
    assert client.get("/v1/jobs", headers=H(first[:-4] + "AAAA")).status_code == 401  # a key mistyped
    assert client.get("/v1/jobs", headers={"Authorization": first}).status_code == 401  # sent without "Bearer"
    assert client.post(f"/v1/admin/keys/{second['key_id']}/revoke", headers=admin).status_code == 200
    assert client.get("/v1/jobs", headers=H(second["api_key"])).status_code == 401  # revoked

    listed = client.get(f"/v1/admin/tenants/{tenant_id}/keys", headers=admin)
    cli_listed = CliRunner().invoke(cli, ["keys", "list", "--tenant", "initech", "--json"], env=env)
    assert listed.status_code == 200 and cli_listed.exit_code == 0, (listed.text, cli_listed.output)
    prefixes = {k["prefix"] for k in listed.json()}
    assert len(prefixes) == 3 and {k["prefix"] for k in json.loads(cli_listed.output)} == prefixes
    assert any(r.levelno == logging.DEBUG for r in debug_logs.records)  # the capture did see DEBUG lines
    for key in (first, second["api_key"], third):
        secret = secret_part(key, next(p for p in prefixes if key.startswith(p)))
        assert secret not in debug_logs.text, "an API key's secret was logged"
        assert secret not in listed.text and secret not in cli_listed.output, "a listing shows a key's secret"
