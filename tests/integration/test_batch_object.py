"""The Batch object and error lines as OpenAI's client reads them (the real app, Redis and SQLite; no worker: the
jobs' ends are written as a worker would): the batch names the model its lines ran on, a job the scheduler gave up
on says so rather than blame the batch's window, and a cancel that comes after the window ended finds the batch
expired."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from openai.types import Batch as OpenAIBatch
from sqlalchemy import update

from app.batch.finalize import maybe_finalize
from app.db.models import Batch, Job
from app.db.session import session_scope, write_guard
from app.services.transitions import as_utc, utcnow
from tests.conftest import Keys, load_runtime_adapter

pytestmark = pytest.mark.integration

# what the worker writes on a job the scheduler relegated under overload and then gave up on (engine_thread._expiry)
GIVEN_UP = "relegated under overload and expired before its first token (its deadline had long passed)"


def _batch(client, keys, models: list[str], window: str = "24h") -> str:
    """A batch of a one-job line per model, validated and fanned out (TestClient runs the fan-out before it
    returns)."""
    text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": model, "prompt": "Hi", "max_tokens": 2}})
                     for i, model in enumerate(models))
    auth = Keys.header(keys.paid)
    f = client.post("/v1/files", headers=auth, data={"purpose": "batch"}, files={"file": ("in.jsonl", text)}).json()
    return client.post("/v1/batches", headers=auth, json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                          "completion_window": window}).json()["id"]


def _read(client, keys, batch_id: str) -> OpenAIBatch:
    return OpenAIBatch.model_validate(client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json())


def _error_lines(client, keys, batch: OpenAIBatch) -> list[dict]:
    text = client.get(f"/v1/files/{batch.error_file_id}/content", headers=Keys.header(keys.paid)).text
    return [json.loads(line)["error"] for line in text.splitlines()]


def test_a_batch_names_the_model_its_lines_ran_on(client, keys, settings, tmp_path):
    """One model for all its lines: that model; lines of several models: none (OpenAI's ``model`` is the one model
    that processed the batch); not fanned out yet: none."""
    load_runtime_adapter(settings, tmp_path)
    one, several = _batch(client, keys, ["tiny", "tiny"]), _batch(client, keys, ["tiny", "rt-lora"])
    assert {b: _read(client, keys, b).model for b in (one, several)} == {one: "tiny", several: None}
    page = client.get("/v1/batches", headers=Keys.header(keys.paid)).json()["data"]
    assert {b["id"]: OpenAIBatch.model_validate(b).model for b in page} == {one: "tiny", several: None}


def _given_up_and_finalized(client, keys, settings, batch_id: str, finished_ago_s: float,
                            window_ended_ago_s: float | None):
    """The batch's jobs expired by the scheduler (the worker's error) ``finished_ago_s`` ago, its window ended
    ``window_ended_ago_s`` ago (None: still open), then finalized: the batch as the client reads it."""
    with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
        now = utcnow()
        if window_ended_ago_s is not None:
            s.execute(update(Batch).where(Batch.id == batch_id).values(
                expires_at=now - timedelta(seconds=window_ended_ago_s)))
        s.execute(update(Job).where(Job.batch_id == batch_id).values(
            status="expired", error=GIVEN_UP, slo_met=False, finished_at=now - timedelta(seconds=finished_ago_s),
            settled_at=now - timedelta(seconds=finished_ago_s)))
        s.commit()
    with session_scope(settings.sqlalchemy_url) as s:
        assert maybe_finalize(s, batch_id, settings.data_dir, None)
    return _read(client, keys, batch_id)


@pytest.mark.parametrize("window_ended", [False, True], ids=["window_open", "window_ended"])
def test_a_job_the_scheduler_gave_up_on_says_so_in_the_error_file(client, keys, settings, window_ended):
    """Expired by the policy (relegated under overload, then given up), not by the batch's window: its error line
    says what happened, and its code is ``batch_expired`` only where the window had ended when it expired."""
    batch_id = _batch(client, keys, ["tiny"], window="1h")
    # the window ended 2 s ago; the scheduler gave up on the job a second after that
    batch = _given_up_and_finalized(client, keys, settings, batch_id, finished_ago_s=1,
                                    window_ended_ago_s=2 if window_ended else None)
    (error,) = _error_lines(client, keys, batch)
    assert "completion window ended" not in error["message"] or window_ended, error
    assert "relegated" in error["message"] and "overload" in error["message"], error
    assert (error["code"] == "batch_expired") == window_ended, error
    assert batch.status == ("expired" if window_ended else "completed")


def test_a_cancel_after_the_window_ended_finds_the_batch_expired(client, keys, settings):
    """Nobody polled the batch before its window ended: a cancel then is a 409 that says it expired, and the batch
    is expired with its unfinished lines ``batch_expired``, as the window made it, not cancelled."""
    batch_id = _batch(client, keys, ["tiny", "tiny"], window="1s")
    with session_scope(settings.sqlalchemy_url) as s:
        left = (as_utc(s.get(Batch, batch_id).expires_at) - utcnow()).total_seconds()
    time.sleep(max(0.0, left) + 0.2)  # the window ends with no worker and no poll
    answer = client.post(f"/v1/batches/{batch_id}/cancel", headers=Keys.header(keys.paid))
    assert answer.status_code == 409, answer.text
    assert "expired" in answer.json()["error"]["message"]
    batch = _read(client, keys, batch_id)
    assert (batch.status, batch.cancelling_at, batch.cancelled_at) == ("expired", None, None)
    assert batch.expired_at is not None and batch.finalizing_at is None  # it never went through finalizing
    assert [e["code"] for e in _error_lines(client, keys, batch)] == ["batch_expired", "batch_expired"]


def test_only_a_batch_that_completed_shows_when_it_started_finalizing(client, keys):
    """OpenAI's ``finalizing_at`` is the start of finalizing (in_progress -> finalizing -> completed): a cancelled
    batch never went through it and leaves it null, as an expired one does."""
    auth = Keys.header(keys.paid)
    cancelled = client.post(f"/v1/batches/{_batch(client, keys, ['tiny'])}/cancel", headers=auth).json()
    assert (cancelled["status"], cancelled["finalizing_at"]) == ("cancelled", None), cancelled


def _error_file_of_a_cancelled_batch(client, keys, text: str) -> list[dict]:
    """The error file's lines of a completions batch of input ``text``, cancelled at once (no worker runs it)."""
    auth = Keys.header(keys.paid)
    f = client.post("/v1/files", headers=auth, data={"purpose": "batch"}, files={"file": ("in.jsonl", text)}).json()
    batch_id = client.post("/v1/batches", headers=auth, json={"input_file_id": f["id"],
                                                              "endpoint": "/v1/completions"}).json()["id"]
    batch = OpenAIBatch.model_validate(client.post(f"/v1/batches/{batch_id}/cancel", headers=auth).json())
    return [json.loads(t) for t in
            client.get(f"/v1/files/{batch.error_file_id}/content", headers=auth).text.splitlines()]


def test_every_error_line_has_a_custom_id_string_and_an_error_of_code_and_message(client, keys):
    """Refused lines (one unreadable, one without a custom_id, one with a bad body) and a cancelled one read as
    OpenAI's and vLLM's error lines (vLLM's ``BatchRequestOutput.custom_id`` is a ``str``): each ``custom_id`` a
    string, each ``error`` its ``code`` and ``message``; the line number is in the ``id`` (a ``line`` is the
    batch's own ``errors.data[]``)."""
    good = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    text = "\n".join(["{not json", json.dumps({"method": "POST", "url": "/v1/completions", "body": good}),
                      json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {}}),
                      json.dumps({"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": good})])
    lines = _error_file_of_a_cancelled_batch(client, keys, text)
    assert [(e["id"], e["custom_id"]) for e in lines] == [
        ("batch_req_line_1", ""), ("batch_req_line_2", ""), ("batch_req_line_3", "bad"),
        (lines[3]["id"], "ok")], lines
    assert all(set(e["error"]) == {"code", "message"} for e in lines), lines


def test_a_batch_whose_jobs_all_ended_in_its_window_is_completed_though_finalized_after_it(client, keys, settings):
    """A job the scheduler gave up on while the window was open (its line: ``server_error``), the batch finalized
    only once the window had ended (no poll, no sweep before): the window stopped nothing, so the batch is
    ``completed``, as its error file says, not ``expired``."""
    batch_id = _batch(client, keys, ["tiny"], window="1h")
    # the scheduler gave up on the job 2 s ago; the window ended a second after that
    batch = _given_up_and_finalized(client, keys, settings, batch_id, finished_ago_s=2, window_ended_ago_s=1)
    (error,) = _error_lines(client, keys, batch)
    assert error["code"] == "server_error", error
    assert batch.status == "completed", batch


def test_the_error_file_lists_its_lines_in_input_order(client, keys):
    """Refused lines and lines whose request failed (here cancelled) interleaved in the input: the error file
    lists them in input order, as a user reading it beside the input expects (clients match by custom_id)."""
    good = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    text = "\n".join([json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": good}),
                      "{not json",
                      json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": good}),
                      json.dumps({"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": good})])
    lines = _error_file_of_a_cancelled_batch(client, keys, text)
    assert [e["custom_id"] for e in lines] == ["a", "", "b", "c"], lines


def test_a_fan_in_never_holds_its_output_file_whole_in_memory(client, keys, settings):
    """The fan-in read every job of the batch (their answers), built every output line in a list and joined them into
    one string, then its bytes: several copies of an output file that may be hundreds of MiB (32 MB for 5 MB). It
    reads the jobs ``FAN_IN_CHUNK`` at a time and writes the file a line at a time now: its peak is a chunk's, well
    under the file's size. Each line is still its request's answer, in input order."""
    count, answer = 3000, "word " * 400  # about 7 MiB of output lines
    batch_id = _batch(client, keys, ["tiny"] * count)
    peak = _fan_in_peak(settings, batch_id, status="succeeded", output_text=answer, finish_reason="stop",
                        prompt_tokens=1, completion_tokens=400)
    batch = _read(client, keys, batch_id)
    assert (batch.status, batch.request_counts.completed, batch.error_file_id) == ("completed", count, None), batch
    text = client.get(f"/v1/files/{batch.output_file_id}/content", headers=Keys.header(keys.paid)).text
    lines = [json.loads(line) for line in text.splitlines()]
    assert [line["custom_id"] for line in lines] == [f"c{i}" for i in range(count)]
    assert {line["response"]["body"]["choices"][0]["text"] for line in lines} == {answer}
    assert peak < len(text) / 3, f"{peak} bytes allocated at the peak of a {len(text)}-byte output file's fan-in"


def test_a_fan_in_never_holds_its_error_file_whole_in_memory(client, keys, settings):
    """A batch whose lines mostly fail: the fan-in read its refused lines whole (the file's text and a list of its
    lines), built every failed request's error line beside them, then a sorted copy of them all: several copies of
    an error file that may be as large as an output file. It reads both a line at a time now, in input order (the
    refused lines by number, the failed requests in their jobs' order): its peak is a chunk's, well under the file's
    size. The lines interleave in input order as before, and count as before."""
    # about 16 MiB of error lines: every even line refused, every odd one failed (its error the long part: a refusal
    # names a long url without repeating it)
    count, reason = 6000, "word " * 1000
    good, refused_url = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}, "/v1/" + "x" * 4000
    text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "body": good,
                                 "url": refused_url if i % 2 == 0 else "/v1/completions"}) for i in range(count))
    auth = Keys.header(keys.paid)
    f = client.post("/v1/files", headers=auth, data={"purpose": "batch"}, files={"file": ("in.jsonl", text)}).json()
    batch_id = client.post("/v1/batches", headers=auth, json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                              "completion_window": "24h"}).json()["id"]
    peak = _fan_in_peak(settings, batch_id, status="failed", error=reason)
    batch = _read(client, keys, batch_id)
    assert (batch.status, batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed,
            batch.output_file_id) == ("completed", count, 0, count, None), batch
    errors = client.get(f"/v1/files/{batch.error_file_id}/content", headers=auth).text
    lines = [json.loads(line) for line in errors.splitlines()]
    assert [line["custom_id"] for line in lines] == [f"c{i}" for i in range(count)]
    assert [line["error"]["code"] for line in lines[:2]] == ["invalid_url", "request_failed"], lines[:2]
    assert peak < len(errors) / 3, f"{peak} bytes allocated at the peak of a {len(errors)}-byte error file's fan-in"


def test_a_fan_in_never_holds_its_lines_numbers_whole_in_memory(client, keys, settings):
    """The fan-in read the valid lines' numbers by custom_id (lines.json) whole, its text and a dict of it: a batch
    of 50,000 lines of 200-character custom_ids held 28 MiB at the fan-in for them, more than its error lines, and
    more the more lines. It looks up a failed request's number where the fan-out stored them now, one request at a
    time: the fan-in's peak (its SQL's and first run's included) stays under twice the custom_ids' own size (it
    was 3 times it here, 4.7 MB), and the error file still lists its lines in input order."""
    count, width = 8000, 200
    ids = [f"{i:0{width}d}" for i in range(count)]
    good, refused_url = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}, "/v1/nowhere"
    text = "\n".join(json.dumps({"custom_id": cid, "method": "POST", "body": good,
                                 "url": refused_url if i % 1000 == 1 else "/v1/completions"})
                     for i, cid in enumerate(ids))
    auth = Keys.header(keys.paid)
    f = client.post("/v1/files", headers=auth, data={"purpose": "batch"}, files={"file": ("in.jsonl", text)}).json()
    batch_id = client.post("/v1/batches", headers=auth, json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                              "completion_window": "24h"}).json()["id"]
    peak = _fan_in_peak(settings, batch_id, status="failed", error="boom")
    batch = _read(client, keys, batch_id)
    assert (batch.status, batch.request_counts.failed) == ("completed", count), batch
    errors = client.get(f"/v1/files/{batch.error_file_id}/content", headers=auth).text
    assert [json.loads(line)["custom_id"] for line in errors.splitlines()] == ids
    assert peak < 2 * count * width, f"{peak} bytes allocated at the peak of a {count}-line batch's fan-in"


def _fan_in_peak(settings, batch_id: str, **ended) -> int:
    """The bytes allocated at the peak of the batch's fan-in, its jobs all ended first with the ``ended`` values."""
    import tracemalloc

    with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
        s.execute(update(Job).where(Job.batch_id == batch_id).values(**ended, finished_at=utcnow(),
                                                                     settled_at=utcnow()))
        s.commit()
    tracemalloc.start()
    try:
        with session_scope(settings.sqlalchemy_url) as s:
            assert maybe_finalize(s, batch_id, settings.data_dir, None)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
