"""The list commands at 80 columns without a terminal: IDs, statuses and dates whole, ``--json``
for scripts, 422s as messages, and ``keys create|list`` against a real migrated SQLite DB.

The API side is a small FastAPI app with the real ``JobCreate`` model (so its 422 bodies are
FastAPI's own) behind a TestClient that the CLI's HTTP calls are routed to."""

from __future__ import annotations

import io
import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from rich.console import Console
from typer.testing import CliRunner

from app.cli import batch_cmds, cli, service_cmds
from app.cli.output import error_message, print_table
from app.schemas import JobCreate
from app.services.rate_limits import Limits

JOB_ID = "job_4d2605ab90c14e0f8a7d3b21"
BATCH_ID = "batch_7e5c1d0a4b3f42e6a9d8c0b1"
AUTH = ["--url", "http://coserve.test", "--key", "k"]
NARROW = {"COLUMNS": "80"}


def _job(i: int) -> dict[str, Any]:
    return {"id": JOB_ID[:-1] + str(i), "object": "job", "status": "succeeded", "kind": "interactive", "tier": "paid",
            "created_at": "2025-11-24T04:04:01.123456+00:00", "completion_tokens": 64,
            "metrics": {"ttft_s": 0.205, "slo_met": True}}


def _batch() -> dict[str, Any]:
    return {"id": BATCH_ID, "object": "batch", "status": "in_progress", "endpoint": "/v1/chat/completions",
            "completion_window": "24h", "request_counts": {"total": 4, "completed": 3, "failed": 1},
            "created_at": 1763956800, "expires_at": 1764043200}


def _api() -> FastAPI:
    api = FastAPI()

    @api.get("/v1/jobs")
    def jobs(status: str | None = None) -> dict[str, Any]:
        return {"object": "list", "data": [] if status == "running" else [_job(1), _job(2)], "next_cursor": None}

    @api.post("/v1/jobs")
    def submit(body: JobCreate) -> dict[str, Any]:
        return _job(1)

    @api.get("/v1/jobs/{job_id}")
    def job(job_id: str) -> dict[str, Any]:
        return _job(1) | {"id": job_id, "output_text": "[bold]rivers[/bold]"}

    @api.get("/v1/batches")
    def batches(request: Request, limit: int = 20) -> dict[str, Any]:
        none = request.headers.get("authorization") == "Bearer no-batches"  # a tenant that made none
        return {"object": "list", "data": [] if none else [_batch()], "has_more": False}

    @api.post("/v1/files")
    def upload() -> dict[str, Any]:
        return {"id": "file-in", "object": "file", "bytes": 52, "purpose": "batch"}

    @api.post("/v1/batches")
    def create() -> dict[str, Any]:
        return _batch()

    @api.get("/v1/batches/{batch_id}")
    def batch(batch_id: str) -> dict[str, Any]:
        return _batch() | {"id": batch_id, "status": "failed", "errors": {"object": "list", "data": [
            {"code": "duplicate_custom_id", "message": "custom_id 'a' is given twice", "line": 2}]}}

    return api


@pytest.fixture
def api(monkeypatch) -> TestClient:
    client = TestClient(_api())

    def request(method: str, url: str, **kw: Any) -> httpx.Response:
        kw.pop("timeout", None)
        kw.pop("trust_env", None)  # the CLI passes httpx's; a TestClient takes neither
        return client.request(method, url, **kw)

    def init(self: batch_cmds.Api, url: str | None, key: str | None) -> None:
        self.url, self.http = url, client
        client.headers["Authorization"] = f"Bearer {key}"  # as Api sends it

    monkeypatch.setattr(service_cmds.httpx, "request", request)
    monkeypatch.setattr(batch_cmds.Api, "__init__", init)
    return client


def test_jobs_table_at_80_columns_keeps_ids_statuses_and_dates(api):
    res = CliRunner().invoke(cli, ["jobs", *AUTH], env=NARROW)
    assert res.exit_code == 0, res.output
    for i in (1, 2):
        assert JOB_ID[:-1] + str(i) in res.output
    assert "…" not in res.output and "succeeded" in res.output and "2025-11-24 04:04:01" in res.output


def _on_terminal(width: int, table) -> str:
    out = io.StringIO()
    print_table(Console(file=out, width=width, force_terminal=True, color_system=None), table)
    return out.getvalue()


def test_a_table_on_an_80_column_terminal_wraps_but_never_cuts_an_id():
    text = _on_terminal(80, service_cmds._jobs_table([_job(1)]))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert JOB_ID in text and "succeeded" in text and "2025-11-24" in text and "04:04:01" in text
    assert "…" not in text and "yes" in text  # the last column too: rich's own fitting cropped it


def test_a_terminal_too_narrow_for_the_ids_gets_the_whole_table_wider():
    text = _on_terminal(50, batch_cmds._batch_table([_batch()]))
    assert BATCH_ID in text and "in_progress" in text and "2025-11-25 04:00:00" in text and "…" not in text


def test_batch_list_at_80_columns_and_as_json(api):
    res = CliRunner().invoke(cli, ["batch", "list", *AUTH], env=NARROW)
    assert res.exit_code == 0, res.output
    assert BATCH_ID in res.output and "in_progress" in res.output and "…" not in res.output
    assert "2025-11-24 04:00:00" in res.output  # created_at, UTC
    res = CliRunner().invoke(cli, ["batch", "list", "--json", *AUTH], env=NARROW)
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["data"][0]["id"] == BATCH_ID


def test_an_empty_list_says_so_instead_of_printing_bare_headers(api):
    res = CliRunner().invoke(cli, ["jobs", "--status", "running", "--kind", "batch", *AUTH], env=NARROW)
    assert res.exit_code == 0 and res.output.strip() == "no running batch jobs", res.output
    res = CliRunner().invoke(cli, ["batch", "list", "--url", "http://coserve.test", "--key", "no-batches"],
                             env=NARROW)
    assert res.exit_code == 0 and res.output.strip() == "no batches", res.output


def test_jobs_json_is_the_api_page(api):
    res = CliRunner().invoke(cli, ["jobs", "--json", *AUTH], env=NARROW)
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == api.get("/v1/jobs").json()


def test_a_failed_batch_shows_why_on_stderr_and_its_table_alone_on_stdout(api):
    """`coserve batch status` printed a failed batch's errors on stdout, after its table: errors go to stderr."""
    res = CliRunner().invoke(cli, ["batch", "status", BATCH_ID, *AUTH], env=NARROW)
    assert res.exit_code == 0 and BATCH_ID in res.stdout and "failed" in res.stdout, res.output
    assert "duplicate_custom_id" not in res.stdout and "given twice" not in res.stdout, res.stdout
    assert "duplicate_custom_id: custom_id 'a' is given twice" in res.stderr, res.stderr


def test_batch_create_wait_shows_the_ended_batch_as_batch_status_does(api, tmp_path):
    """`batch create --wait` printed the ended batch's table alone: not its files, nor why it failed."""
    requests = tmp_path / "in.jsonl"
    requests.write_text('{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}\n')
    res = CliRunner().invoke(cli, ["batch", "create", str(requests), "--wait", *AUTH], env=NARROW)
    assert res.exit_code == batch_cmds.NOT_COMPLETED and BATCH_ID in res.stdout, res.output
    assert "duplicate_custom_id: custom_id 'a' is given twice" in res.stderr, res.stderr


@pytest.mark.parametrize("args", [["status", JOB_ID], ["batch", "status", BATCH_ID], ["jobs"], ["batch", "list"]],
                         ids=["status", "batch-status", "jobs", "batch-list"])
def test_json_on_a_terminal_is_plain_json_as_off_one(api, monkeypatch, args):
    """`status --json` (and `cancel --json`) coloured their JSON on a terminal with rich's print_json, which `jq`
    cannot read, while the other commands printed it plain: every --json prints it alike, on a terminal or not."""
    off_terminal = CliRunner().invoke(cli, [*args, "--json", *AUTH], env=NARROW)
    assert off_terminal.exit_code == 0, (args, off_terminal.output)
    on_terminal = Console(force_terminal=True, color_system="truecolor", width=40)  # its file: stdout at each print
    for module in (service_cmds, batch_cmds):
        monkeypatch.setattr(module, "console", on_terminal)
    res = CliRunner().invoke(cli, [*args, "--json", *AUTH], env=NARROW)
    assert res.exit_code == 0 and "\x1b[" not in res.stdout, (args, res.stdout)
    assert res.stdout == off_terminal.stdout and json.loads(res.stdout)["object"] in ("job", "batch", "list")


def test_a_422_prints_its_messages_not_pydantic_dicts(api):
    res = CliRunner().invoke(cli, ["submit", "hi", "--max-tokens", "0", *AUTH], env=NARROW)
    assert res.exit_code == 1
    assert "422" in res.output and "max_tokens: Input should be greater than or equal to 1" in res.output
    assert "'type'" not in res.output and "{" not in res.output


def test_error_message_shapes():
    def resp(status: int, body: Any) -> httpx.Response:
        return httpx.Response(status, json=body) if not isinstance(body, str) else httpx.Response(status, text=body)

    model_level = [{"type": "value_error", "loc": ["body"], "msg": "Value error, give exactly one of 'prompt' or "
                    "'messages'", "input": {}}]
    assert error_message(resp(422, {"detail": model_level})) == "give exactly one of 'prompt' or 'messages'"
    assert error_message(resp(404, {"detail": "no job 'job_x'"})) == "no job 'job_x'"
    assert error_message(resp(400, {"error": {"message": "bad [line] 4", "type": "invalid"}})) == "bad \\[line] 4"
    assert error_message(resp(502, "upstream down")) == "upstream down"


@pytest.fixture
def db_env(db_url) -> dict[str, str]:
    return {"COSERVE_DATABASE_URL": db_url, **NARROW}


def test_keys_create_admin_keeps_its_label_and_keys_list_shows_it(db_env):
    run = CliRunner()
    res = run.invoke(cli, ["keys", "create", "--tenant", "ops[team]", "--admin"], env=db_env)
    assert res.exit_code == 0, res.output
    assert "[admin]" in res.output and "ops[team]" in res.output
    key_id = res.output.split("key ")[1].split()[0]
    plaintext = res.output.strip().splitlines()[-1]
    res = run.invoke(cli, ["keys", "create", "--tenant", "acme", "--tier", "free"], env=db_env)
    assert res.exit_code == 0, res.output

    res = run.invoke(cli, ["keys", "list"], env=db_env)
    assert res.exit_code == 0, res.output
    assert key_id in res.output and "ops[team]" in res.output and "…" not in res.output
    assert plaintext not in res.output  # only ids and prefixes

    res = run.invoke(cli, ["keys", "create", "--tenant", "admin", "--admin"], env=db_env)
    assert res.exit_code == 0, res.output  # another admin key first: the last one is not revoked
    res = run.invoke(cli, ["keys", "revoke", key_id], env=db_env)
    assert res.exit_code == 0, res.output
    rows = json.loads(run.invoke(cli, ["keys", "list", "--json"], env=db_env).output)
    by_tenant = {r["tenant"]: r for r in rows}
    assert by_tenant["ops[team]"] | {"revoked": True, "is_admin": True} == by_tenant["ops[team]"]
    assert by_tenant["acme"]["effective_tier"] == "free" and not by_tenant["acme"]["revoked"]

    res = run.invoke(cli, ["keys", "list", "--tenant", "acme", "--json"], env=db_env)
    assert [r["tenant"] for r in json.loads(res.output)] == ["acme"]
    res = run.invoke(cli, ["keys", "list", "--tenant", "nobody"], env=db_env)
    assert res.exit_code == 1 and "no keys" in res.output


def test_keys_limits_sets_and_clears_a_tenants_rate_limits(db_env, db_url):
    from app.auth import lookup
    from app.db.session import session_scope

    run = CliRunner()
    plaintext = run.invoke(cli, ["keys", "create", "--tenant", "acme"], env=db_env).output.strip().splitlines()[-1]
    res = run.invoke(cli, ["keys", "limits", "--tenant", "acme", "--requests-per-minute", "30",
                           "--tokens-per-minute", "9000"], env=db_env)
    assert res.exit_code == 0 and "30 requests per minute, 9000 tokens per minute" in res.output, res.output
    with session_scope(db_url) as s:  # what the API reads with the key
        assert lookup(s, plaintext).limits == Limits(30, 9000)
    res = run.invoke(cli, ["keys", "limits", "--tenant", "acme", "--requests-per-minute", "0"], env=db_env)
    assert "no limit of requests per minute, 9000 tokens" in res.output, res.output
    res = run.invoke(cli, ["keys", "limits", "--tenant", "acme", "--batch-queue-tokens", "50000"], env=db_env)
    assert "9000 tokens per minute, 50000 tokens queued in batches" in res.output, res.output
    from sqlalchemy import select

    from app.db.models import Tenant

    with session_scope(db_url) as s:
        assert s.scalar(select(Tenant.batch_queue_tokens).where(Tenant.name == "acme")) == 50000
    assert run.invoke(cli, ["keys", "limits", "--tenant", "nobody"], env=db_env).exit_code == 1
