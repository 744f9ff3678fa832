"""`coserve files list|delete` against the real app and DB: the upload a `batch create` stopped between its upload and
its start left behind had no command to find or delete it."""

from __future__ import annotations

import json

import httpx
import pytest
import typer
from typer.testing import CliRunner

from app.cli import cli
from tests.conftest import Keys

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

REQUEST = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}\n'


def _upload(live_server: str, key: str, name: str) -> str:
    r = httpx.post(f"{live_server}/v1/files", headers=Keys.header(key), files={"file": (name, REQUEST)},
                   data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_an_upload_left_without_a_batch_is_listed_and_deleted(live_server, keys):
    auth = ["--url", live_server, "--key", keys.paid]
    first, orphan = _upload(live_server, keys.paid, "first.jsonl"), _upload(live_server, keys.paid, "orphan.jsonl")
    theirs = _upload(live_server, keys.other, "theirs.jsonl")  # another tenant's: not listed, not deleted
    run = CliRunner()
    r = run.invoke(cli, ["files", "list", *auth])
    assert r.exit_code == 0 and r.stdout.index(orphan) < r.stdout.index(first), r.output  # newest first
    assert "orphan.jsonl" in r.stdout and "batch" in r.stdout and theirs not in r.stdout, r.output
    r = run.invoke(cli, ["files", "list", "--limit", "1", "--purpose", "batch", *auth])
    assert r.exit_code == 0 and first not in r.stdout, r.output
    assert f"more: `coserve files list --purpose batch --limit 1 --after {orphan}`" in r.stdout, r.output
    page = json.loads(run.invoke(cli, ["files", "list", "--json", *auth]).stdout)
    assert [f["id"] for f in page["data"]] == [orphan, first] and page["has_more"] is False, page

    r = run.invoke(cli, ["files", "delete", orphan, *auth])
    assert r.exit_code == 0 and r.stdout == f"file {orphan} deleted\n", r.output
    assert [f["id"] for f in json.loads(run.invoke(cli, ["files", "list", "--json", *auth]).stdout)["data"]] == [first]
    r = run.invoke(cli, ["files", "delete", orphan, "--json", *auth])  # deleted already: the API's 404
    assert r.exit_code == 1 and r.stdout == "" and r.stderr == f"404 No such File object: {orphan}\n", r.output
    r = run.invoke(cli, ["files", "delete", theirs, *auth])
    assert r.exit_code == 1 and r.stderr.startswith("404 "), r.output
    r = run.invoke(cli, ["files", "delete", first, "--json", *auth])
    assert r.exit_code == 0 and json.loads(r.stdout) == {"id": first, "object": "file", "deleted": True}, r.output
    r = run.invoke(cli, ["files", "list", "--purpose", "batch", *auth])
    assert r.exit_code == 0 and r.stdout == "no batch files\n", r.output


def _batch_files(live_server: str, key: str) -> list[str]:
    r = httpx.get(f"{live_server}/v1/files", headers=Keys.header(key), params={"purpose": "batch"})
    return [f["id"] for f in r.json()["data"]]


def test_a_batch_create_the_api_refuses_deletes_the_file_it_uploaded(live_server, keys, tmp_path):
    """`batch create` whose start the API refused (400: a tier above the key's) left its upload behind, unnamed;
    it deletes it now (the upload was its own)."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(REQUEST)
    r = CliRunner().invoke(cli, ["batch", "create", str(src), "--tier", "paid", "--url", live_server,
                                 "--key", keys.free])
    assert r.exit_code == 1 and "tier" in r.stderr, r.output
    assert _batch_files(live_server, keys.free) == [], r.output
    assert "deleted" in r.stderr and "file_" in r.stderr, r.output


def test_a_refused_batch_creates_upload_it_could_not_delete_is_named(live_server, keys, tmp_path, monkeypatch):
    """Where the delete fails too, the file's id and the command that deletes it are printed."""
    from app.cli.batch_cmds import Api

    call = Api.call

    def delete_unreachable(self, method, path, *args, **kw):
        if method == "DELETE":  # the API gone between the refused start and the delete
            raise typer.Exit(2)
        return call(self, method, path, *args, **kw)

    monkeypatch.setattr(Api, "call", delete_unreachable)
    src = tmp_path / "in.jsonl"
    src.write_bytes(REQUEST)
    r = CliRunner().invoke(cli, ["batch", "create", str(src), "--tier", "paid", "--url", live_server,
                                 "--key", keys.free])
    (left,) = _batch_files(live_server, keys.free)
    assert r.exit_code == 1 and f"`coserve files delete {left}`" in r.stderr, r.output
