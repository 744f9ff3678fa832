"""A batch whose API process died while validating it is validated by a worker's sweeper, and one whose writer died
while finalizing it is finalized by one."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from app.batch import finalize
from app.batch.fanout import expires_at_for, start_batch
from app.db.models import Batch, File, Job, new_id
from app.db.session import session_scope
from app.services.transitions import utcnow
from tests.conftest import Keys
from workers.batch_tasks import finalize_open_batches, restart_stalled_validation

pytestmark = pytest.mark.integration


def test_stalled_validation_is_restarted_once(client, keys, settings):
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}}) for i in range(3)]
    lines.append("not json")
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", "\n".join(lines).encode())}).json()
    created = utcnow() - timedelta(minutes=10)
    batch_id = new_id("batch")
    with session_scope(settings.sqlalchemy_url) as s:  # what the API had committed before it died
        s.add(Batch(id=batch_id, tenant_id=keys.tenant_id, endpoint="/v1/completions", input_file_id=f["id"],
                    completion_window="1h", status="validating", tier="paid", created_at=created,
                    expires_at=expires_at_for(created, "1h")))
    assert restart_stalled_validation(settings, stale_after_s=3600) == []  # not stale yet
    assert restart_stalled_validation(settings, stale_after_s=60) == [batch_id]
    assert restart_stalled_validation(settings, stale_after_s=60) == []  # in progress now: not again
    with session_scope(settings.sqlalchemy_url) as s:
        batch = s.get(Batch, batch_id)
        assert (batch.status, batch.total, batch.failed) == ("in_progress", 4, 1)
        assert s.scalar(select(func.count()).select_from(Job).where(Job.batch_id == batch_id)) == 3


def _bad_lines_batch(client, keys) -> str:
    """A batch whose one line is invalid: it finalizes as soon as it is validated (no job to wait for)."""
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", b"{not json\n")}).json()
    return client.post("/v1/batches", headers=Keys.header(keys.paid), json={
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "1h"}).json()["id"]


def _output_files(settings, batch_id: str) -> list[str]:
    with session_scope(settings.sqlalchemy_url) as s:
        return list(s.scalars(select(File.id).where(File.filename.startswith(batch_id))))


def test_a_batch_left_finalizing_by_a_dead_writer_is_finalized_by_the_sweeper(client, keys, settings, monkeypatch):
    real_new_file = finalize.new_file
    calls = []

    def dies_once(*args, **kwargs):  # the first writer dies between taking the batch and writing its files
        calls.append(args)
        if len(calls) == 1:
            raise OSError("disk full")
        return real_new_file(*args, **kwargs)

    monkeypatch.setattr(finalize, "new_file", dies_once)
    batch_id = _bad_lines_batch(client, keys)
    batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert batch["status"] == "finalizing" and batch["error_file_id"] is None
    assert _output_files(settings, batch_id) == []
    assert finalize_open_batches(settings.sqlalchemy_url, settings.data_dir, None) == []  # not stalled yet
    monkeypatch.setattr(finalize, "STALLED_AFTER", timedelta(0))
    assert finalize_open_batches(settings.sqlalchemy_url, settings.data_dir, None) == [batch_id]
    batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 1, "completed": 0, "failed": 1}
    errors = client.get(f"/v1/files/{batch['error_file_id']}/content", headers=Keys.header(keys.paid)).text
    assert json.loads(errors)["error"]["code"] == "invalid_json"
    assert _output_files(settings, batch_id) == [batch["error_file_id"]]


def test_a_batch_cancel_that_died_partway_is_finished_by_the_sweeper(client, keys, settings, monkeypatch):
    """A batch's cancel stops its jobs a chunk a transaction; one whose process died after the first chunk leaves the
    batch cancelling with runnable jobs, which the sweeper's fan-in cancels before it finalizes the batch."""
    from app.services import cancel as cancelling

    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}}) for i in range(3)]
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", "\n".join(lines).encode())}).json()
    batch_id = client.post("/v1/batches", headers=Keys.header(keys.paid), json={
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "1h"}).json()["id"]

    def dies(*_args):  # the process dies once its first chunk committed
        raise SystemExit("killed")

    monkeypatch.setattr(cancelling, "STOP_CHUNK", 1)
    monkeypatch.setattr(cancelling, "announce_cancels", dies)
    with session_scope(settings.sqlalchemy_url) as s, pytest.raises(SystemExit):
        finalize.cancel_batch(s, s.get(Batch, batch_id), settings.data_dir, None)
    monkeypatch.undo()

    def statuses() -> list[str]:
        with session_scope(settings.sqlalchemy_url) as s:
            return sorted(s.scalars(select(Job.status).where(Job.batch_id == batch_id)))

    assert statuses() == ["cancelled", "dispatched", "dispatched"]  # two still runnable
    assert finalize_open_batches(settings.sqlalchemy_url, settings.data_dir, None) == [batch_id]
    assert statuses() == ["cancelled"] * 3
    batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert batch["status"] == "cancelled" and batch["request_counts"] == {"total": 3, "completed": 0, "failed": 3}


def test_a_writer_whose_finalizing_was_taken_over_writes_nothing(client, keys, settings, monkeypatch):
    real_new_file = finalize.new_file
    taken_over: list[list[str]] = []

    def slow_writer(*args, **kwargs):  # while the first writer writes, the sweeper judges it dead and takes over
        if not taken_over:
            taken_over.append([])
            taken_over[0] = finalize_open_batches(settings.sqlalchemy_url, settings.data_dir, None)
        return real_new_file(*args, **kwargs)

    monkeypatch.setattr(finalize, "STALLED_AFTER", timedelta(0))
    monkeypatch.setattr(finalize, "new_file", slow_writer)
    batch_id = _bad_lines_batch(client, keys)
    assert taken_over == [[batch_id]]
    batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert batch["status"] == "completed"
    assert _output_files(settings, batch_id) == [batch["error_file_id"]]  # the first writer's file is not kept
    assert sorted(p.name for p in (settings.data_dir / "files").iterdir()) == sorted(
        [batch["error_file_id"], batch["input_file_id"]])


def test_a_batch_whose_input_file_went_before_validation_fails_saying_so(client, keys, settings):
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", b"{}\n")}).json()
    batch_id = new_id("batch")
    with session_scope(settings.sqlalchemy_url) as s:
        s.add(Batch(id=batch_id, tenant_id=keys.tenant_id, endpoint="/v1/completions", input_file_id=f["id"],
                    completion_window="1h", status="validating", tier="paid"))
    assert client.delete(f"/v1/files/{f['id']}", headers=Keys.header(keys.paid)).status_code == 200
    start_batch(settings, batch_id)
    batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert batch["status"] == "failed"
    assert batch["errors"]["data"] == [{"code": "invalid_file", "line": None, "param": "input_file_id",
                                        "message": f"the input file {f['id']} was deleted before its lines were read"}]


def test_a_batch_cancelled_while_validating_ends_with_its_event_when_validation_ends_it(client, keys, settings):
    from app.db.models import WebhookDelivery, WebhookEndpoint
    from app.services.webhooks import new_secret

    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", b"{}\n")}).json()
    batch_id = new_id("batch")
    with session_scope(settings.sqlalchemy_url) as s:  # the cancel committed; its fan-in has not run yet
        s.add(WebhookEndpoint(id="we_1", tenant_id=keys.tenant_id, name="n", url="http://127.0.0.1:9/x",
                              event_types=["batch.cancelled"], secret=new_secret()))
        s.add(Batch(id=batch_id, tenant_id=keys.tenant_id, endpoint="/v1/completions", input_file_id=f["id"],
                    completion_window="1h", status="cancelling", tier="paid", cancelling_at=utcnow()))
    start_batch(settings, batch_id)  # validation ends it first
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Batch, batch_id).status == "cancelled"
        assert not finalize.maybe_finalize(s, batch_id, settings.data_dir, None)  # the cancel's fan-in, late
        assert [d.type for d in s.scalars(select(WebhookDelivery))] == ["batch.cancelled"]  # once


def _good_and_refused_lines(client, keys) -> str:
    """An input file of a good line and a refused one: its id."""
    good = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    text = "\n".join([json.dumps({"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": good}),
                      "{not json"]) + "\n"
    return client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                       files={"file": ("in.jsonl", text.encode())}).json()["id"]


def _cancelled_unrun(client, keys, batch_id: str) -> None:
    """The batch ended cancelled with both lines failed (total = completed + failed): the good one stopped unrun
    (``batch_cancelled``, as a cancelled job's line), the refused one as refused, one error file of both."""
    batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert (batch["status"], batch["request_counts"]) == ("cancelled", {"total": 2, "completed": 0, "failed": 2})
    errors = client.get(f"/v1/files/{batch['error_file_id']}/content", headers=Keys.header(keys.paid)).text
    lines = [json.loads(t) for t in errors.splitlines()]
    assert [(t["id"], t["error"]["code"]) for t in lines] == [
        ("batch_req_line_1", "batch_cancelled"), ("batch_req_line_2", "invalid_json")], errors
    assert batch["output_file_id"] is None
    listed = client.get("/v1/files", headers=Keys.header(keys.paid)).json()["data"]
    assert [f["id"] for f in listed if f["filename"].startswith(batch_id)] == [batch["error_file_id"]]


@pytest.mark.parametrize("ended_by", ["validation", "the_cancel"])
def test_a_batch_cancelled_while_validating_counts_its_lines_and_keeps_its_refused_ones(client, keys, settings,
                                                                                        ended_by):
    """Cancelled before its fan-out started its jobs (the validation ends it, or the cancel's fan-in did first, before
    its lines were read): no request ran, and the batch says how many lines its file had (``total``, not 0), each
    failed: its valid line was counted in total but neither completed nor failed (the counts did not add up), and
    the error file now gives it as cancelled unrun beside the refused one."""
    file_id, batch_id, now = _good_and_refused_lines(client, keys), new_id("batch"), utcnow()
    ended = {"status": "cancelled", "cancelled_at": now} if ended_by == "the_cancel" else {"status": "cancelling"}
    with session_scope(settings.sqlalchemy_url) as s:  # the cancel committed (and, the_cancel: its fan-in ended it)
        s.add(Batch(id=batch_id, tenant_id=keys.tenant_id, endpoint="/v1/completions", input_file_id=file_id,
                    completion_window="1h", tier="paid", cancelling_at=now, **ended))
    start_batch(settings, batch_id)
    _cancelled_unrun(client, keys, batch_id)


def test_a_batch_whose_validation_ends_while_the_cancels_fan_in_finalizes_it_keeps_its_counts(client, keys, settings,
                                                                                               monkeypatch):
    """The race: the cancel's fan-in had taken the batch (finalizing) when its validation found it cancelled, whose
    counts and error file, written only to a batch cancelling or cancelled, were lost: it ended with total 0. Run
    in that order here: the validation runs inside the fan-in, between its taking the batch and its end."""
    file_id, batch_id, now = _good_and_refused_lines(client, keys), new_id("batch"), utcnow()
    with session_scope(settings.sqlalchemy_url) as s:  # the cancel committed; the validation has not read the file
        s.add(Batch(id=batch_id, tenant_id=keys.tenant_id, endpoint="/v1/completions", input_file_id=file_id,
                    completion_window="1h", tier="paid", status="cancelling", cancelling_at=now))
    files_of, seen = finalize.result_files, []

    def validation_meanwhile(*args):
        with session_scope(settings.sqlalchemy_url) as s:
            seen.append(s.get(Batch, batch_id).status)
        start_batch(settings, batch_id)
        return files_of(*args)

    monkeypatch.setattr(finalize, "result_files", validation_meanwhile)
    with session_scope(settings.sqlalchemy_url) as s:
        assert finalize.maybe_finalize(s, batch_id, settings.data_dir, None)  # the cancel's fan-in
    assert seen == ["finalizing"]
    _cancelled_unrun(client, keys, batch_id)


def test_a_responses_lines_refused_job_names_the_responses_fields_as_the_route_does(client, keys, settings):
    """A Responses line whose job is refused (tools with tool_choice left 'auto', no tool parser) is refused in
    POST /v1/responses's words, not chat's (``tool_choice {"type": "function", "function": ...}``)."""
    auth = Keys.header(keys.paid)
    body = {"model": "tiny", "input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}
    online = client.post("/v1/responses", headers=auth, json={**body, "background": True})
    assert online.status_code == 400
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/responses", "body": body})
    f = client.post("/v1/files", headers=auth, data={"purpose": "batch"}, files={"file": ("in.jsonl", line)}).json()
    batch = client.post("/v1/batches", headers=auth, json={"input_file_id": f["id"], "endpoint": "/v1/responses",
                                                           "completion_window": "1h"}).json()
    got = client.get(f"/v1/batches/{batch['id']}", headers=auth).json()
    (error,) = [json.loads(t) for t in client.get(f"/v1/files/{got['error_file_id']}/content", headers=auth)
                .text.splitlines()]
    assert error["error"]["message"] == f"line 1: {online.json()['error']['message']}"
