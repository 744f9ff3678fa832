"""A batch's working folder (``data_dir/batches/<id>``: its refused lines, its valid lines' numbers, its fan-out
runs' part files) is deleted once the batch has ended, its output and error files kept: a server's disk does not grow
with every batch it has run."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from app.batch import fanout
from app.batch.finalize import working_dir
from app.db.models import Batch
from app.db.session import session_scope
from app.services.transitions import utcnow
from tests.conftest import Keys, wait_for
from workers.batch_tasks import drop_left_working_dirs

pytestmark = pytest.mark.integration


def _line(custom_id: str) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}})


def _create(client, keys, lines: list[str]) -> dict:
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", "\n".join(lines).encode())}).json()
    return client.post("/v1/batches", headers=Keys.header(keys.paid), json={  # fans out before it answers
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}).json()


def _working_files(settings, batch_id: str) -> list[str]:
    """What the batch's working folder holds; [] where it is gone."""
    folder = Path(settings.data_dir) / "batches" / batch_id
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _error_codes(client, keys, batch: dict) -> list[tuple[str, str]]:
    text = client.get(f"/v1/files/{batch['error_file_id']}/content", headers=Keys.header(keys.paid)).text
    return [(line["id"], line["error"]["code"]) for line in map(json.loads, text.splitlines())]


def test_a_completed_batchs_working_files_are_deleted_and_its_result_files_kept(client, keys, settings,
                                                                              start_worker):
    batch = _create(client, keys, [_line("a"), "{not json", _line("b")])
    assert "invalid.jsonl" in _working_files(settings, batch["id"])  # the fan-in's, until the batch ends
    start_worker("w1")

    def ended() -> dict | None:
        got = client.get(f"/v1/batches/{batch['id']}", headers=Keys.header(keys.paid)).json()
        return got if got["status"] not in ("in_progress", "finalizing") else None
    batch = wait_for(ended, 120, "the batch to end")
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert _working_files(settings, batch["id"]) == []
    assert not (Path(settings.data_dir) / "batches" / batch["id"]).exists()
    output = client.get(f"/v1/files/{batch['output_file_id']}/content", headers=Keys.header(keys.paid)).text
    assert [json.loads(line)["custom_id"] for line in output.splitlines()] == ["a", "b"]
    assert _error_codes(client, keys, batch) == [("batch_req_line_2", "invalid_json")]


def test_a_batch_cancelled_while_it_runs_has_its_working_files_deleted(client, keys, settings):
    batch = _create(client, keys, [_line("a"), "{not json", _line("b")])  # no worker: its jobs wait dispatched
    assert client.get(f"/v1/batches/{batch['id']}", headers=Keys.header(keys.paid)).json()["status"] == "in_progress"
    assert "lines.sqlite" in _working_files(settings, batch["id"])
    got = client.post(f"/v1/batches/{batch['id']}/cancel", headers=Keys.header(keys.paid)).json()
    assert got["status"] == "cancelled"
    assert _working_files(settings, batch["id"]) == []
    # the error file, written from them before they went, has the refused line in its place
    assert _error_codes(client, keys, got)[1] == ("batch_req_line_2", "invalid_json")


def test_a_batch_cancelled_while_it_fans_out_has_its_working_files_deleted_once_the_fan_out_ends(
        client, keys, settings, monkeypatch):
    """The cancel's fan-in ends the batch while its fan-out still runs, which then gives the error file its refused
    lines (read from the folder): the fan-out's end, not the fan-in's, deletes the folder."""
    monkeypatch.setattr(fanout, "STAGE_CHUNK", 2)
    real_rows = fanout.FanOut.job_rows
    seen: dict = {}

    def job_rows(self, lines, dispatched_at):
        for i, chunk in enumerate(real_rows(self, lines, dispatched_at)):
            if i == 1:  # another request's cancel, between the fan-out's chunks
                t = threading.Thread(target=lambda: seen.setdefault("cancel", client.post(
                    f"/v1/batches/{self.batch_id}/cancel", headers=Keys.header(keys.paid)).json()))
                t.start()
                t.join(60)
            yield chunk

    monkeypatch.setattr(fanout.FanOut, "job_rows", job_rows)
    batch = _create(client, keys, [_line("a"), _line("b"), "{not json", _line("c"), _line("d")])
    assert seen["cancel"]["status"] == "cancelled"
    got = client.get(f"/v1/batches/{batch['id']}", headers=Keys.header(keys.paid)).json()
    assert got["request_counts"] == {"total": 5, "completed": 0, "failed": 5}
    assert _error_codes(client, keys, got) == [(f"batch_req_line_{n}", "invalid_json" if n == 3 else "batch_cancelled")
                                               for n in range(1, 6)]
    assert _working_files(settings, batch["id"]) == []
    assert not (Path(settings.data_dir) / "batches" / batch["id"]).exists()


def test_a_batch_that_fails_validation_leaves_no_working_folder(client, keys, settings):
    batch = _create(client, keys, [_line("a"), "{not json", _line("a")])  # a custom_id twice fails the file
    got = client.get(f"/v1/batches/{batch['id']}", headers=Keys.header(keys.paid)).json()
    assert got["status"] == "failed" and got["errors"]["data"][0]["code"] == "duplicate_custom_id"
    assert not (Path(settings.data_dir) / "batches" / batch["id"]).exists()


def test_the_sweeper_deletes_a_working_folder_left_once_its_batch_ended_long_ago(client, keys, settings):
    """A folder no batch's end deleted (an older coserve's, or one whose cancel's count of a dead fan-out died with its
    API process): the sweeper deletes it an hour after the batch ended; a running batch's stays."""
    running = _create(client, keys, [_line("a"), "{not json"])
    batch = _create(client, keys, [_line("a"), "{not json"])
    got = client.post(f"/v1/batches/{batch['id']}/cancel", headers=Keys.header(keys.paid)).json()
    assert got["status"] == "cancelled"
    left = working_dir(settings.data_dir, batch["id"])  # as such a server left it
    left.mkdir(parents=True, exist_ok=True)
    (left / "invalid.jsonl").write_text("")
    assert drop_left_working_dirs(settings.sqlalchemy_url, settings.data_dir) == []  # ended under an hour ago
    with session_scope(settings.sqlalchemy_url) as s:
        s.execute(update(Batch).where(Batch.id == batch["id"]).values(cancelled_at=utcnow() - timedelta(hours=2)))
    assert drop_left_working_dirs(settings.sqlalchemy_url, settings.data_dir) == [batch["id"]]
    assert _working_files(settings, batch["id"]) == []
    assert "lines.sqlite" in _working_files(settings, running["id"])


def test_a_message_batchs_working_files_are_deleted_once_it_ends_and_its_results_stay_whole(client, keys, settings):
    """A message batch's results are read from its files, not its working folder: a request the fan-out refused (its
    prompt over the context) is still errored in them after the folder went."""
    headers = {"x-api-key": keys.paid}
    made = client.post("/v1/messages/batches", headers=headers, json={"requests": [
        {"custom_id": "short", "params": {"model": "tiny", "max_tokens": 2,
                                          "messages": [{"role": "user", "content": "Hi"}]}},
        {"custom_id": "long", "params": {"model": "tiny", "max_tokens": 2,
                                         "messages": [{"role": "user", "content": "Hi " * 1_000}]}}]}).json()
    assert "invalid.jsonl" in _working_files(settings, made["id"])
    done = client.post(f"/v1/messages/batches/{made['id']}/cancel", headers=headers).json()
    assert done["processing_status"] == "ended", done
    assert _working_files(settings, made["id"]) == []
    results = client.get(f"/v1/messages/batches/{made['id']}/results", headers=headers).text.splitlines()
    assert [(r["custom_id"], r["result"]["type"]) for r in map(json.loads, results)] == [
        ("short", "canceled"), ("long", "errored")]
