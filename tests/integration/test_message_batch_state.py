"""A message batch (Anthropic's, ``/v1/messages/batches``) against the real app, Redis and SQL, with no worker: it is
cancelled to end. What it keeps of the OpenAI batch machinery under it stays its own: its files are not the Files
API's, and its end is no OpenAI webhook event."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from sqlalchemy import select, update

from app.batch import message_batches as mb
from app.db.models import Batch, File, WebhookDelivery, WebhookEndpoint
from app.db.session import session_scope, write_guard
from app.services.webhooks import EVENT_TYPES, new_secret
from tests.conftest import Keys
from tests.sql_statements import statements

pytestmark = pytest.mark.integration


def ended_message_batch(client, keys) -> dict:
    """A message batch of two requests, cancelled before any ran (its results: canceled)."""
    headers = {"x-api-key": keys.paid}
    made = client.post("/v1/messages/batches", headers=headers, json={"requests": [
        {"custom_id": f"r{i}", "params": {"model": "tiny", "max_tokens": 2,
                                           "messages": [{"role": "user", "content": "Hi"}]}} for i in range(2)]})
    assert made.status_code == 200, made.text
    done = client.post(f"/v1/messages/batches/{made.json()['id']}/cancel", headers=headers).json()
    assert done["processing_status"] == "ended", done
    return done


def files_of(settings, batch_id: str) -> list[str]:
    with session_scope(settings.sqlalchemy_url) as s:
        b = s.get(Batch, batch_id)
        return [f for f in (b.input_file_id, b.output_file_id, b.error_file_id) if f]


def test_a_message_batchs_files_are_not_the_files_apis(client, keys, settings):
    batch = ended_message_batch(client, keys)
    own = files_of(settings, batch["id"])
    assert len(own) == 2  # its requests, and the error file of its canceled ones
    oai = Keys.header(keys.paid)
    upload = client.post("/v1/files", headers=oai, data={"purpose": "batch"},
                         files={"file": ("in.jsonl", b'{"custom_id": "a"}\n')}).json()
    listed = [f["id"] for f in client.get("/v1/files", headers=oai, params={"limit": 100}).json()["data"]]
    assert listed == [upload["id"]]  # an OpenAI upload is listed; the message batch's files are not
    for purpose in ("batch", "batch_output", "message_batch", "message_batch_results"):
        assert upload["id"] not in own and not set(own) & {f["id"] for f in client.get(
            "/v1/files", headers=oai, params={"purpose": purpose}).json()["data"]}
    for file_id in own:
        for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
            answer = client.request(method, f"/v1/files/{file_id}{path}", headers=oai)
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "file_not_found", answer.text
    reuse = client.post("/v1/batches", headers=oai, json={"input_file_id": own[0], "endpoint": "/v1/completions"})
    assert reuse.status_code == 404  # nor an OpenAI batch's input
    results = client.get(f"/v1/messages/batches/{batch['id']}/results", headers={"x-api-key": keys.paid})
    assert results.status_code == 200, results.text  # the DELETEs above took nothing from the batch
    assert [json.loads(line)["result"]["type"] for line in results.text.splitlines()] == ["canceled", "canceled"]


def test_a_message_batchs_end_is_no_openai_webhook_event(client, keys, settings):
    with session_scope(settings.sqlalchemy_url) as s:
        s.add(WebhookEndpoint(id="we_batches", tenant_id=keys.tenant_id, name="n", url="https://example.com/hook",
                              event_types=list(EVENT_TYPES), secret=new_secret()))
        s.commit()
    ended_message_batch(client, keys)
    oai = Keys.header(keys.paid)
    upload = client.post("/v1/files", headers=oai, data={"purpose": "batch"}, files={"file": ("in.jsonl", json.dumps(
        {"custom_id": "a", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}}).encode())}).json()
    batch = client.post("/v1/batches", headers=oai, json={"input_file_id": upload["id"],
                                                          "endpoint": "/v1/completions", "completion_window": "24h"})
    assert client.post(f"/v1/batches/{batch.json()['id']}/cancel", headers=oai).json()["status"] == "cancelled"
    with session_scope(settings.sqlalchemy_url) as s:  # the OpenAI batch's end is its event; the message batch's none
        events = [json.loads(d.body) for d in s.scalars(select(WebhookDelivery))]
    assert [(e["type"], e["data"]["id"]) for e in events] == [("batch.cancelled", batch.json()["id"])]


def test_a_deleted_message_batch_keeps_how_it_ended(client, keys, settings):
    batch = ended_message_batch(client, keys)
    headers = {"x-api-key": keys.paid}
    assert client.delete(f"/v1/messages/batches/{batch['id']}", headers=headers).json()["type"] == \
        "message_batch_deleted"
    assert client.get(f"/v1/messages/batches/{batch['id']}", headers=headers).status_code == 404
    assert batch["id"] not in [b["id"] for b in client.get("/v1/messages/batches", headers=headers).json()["data"]]
    assert client.delete(f"/v1/messages/batches/{batch['id']}", headers=headers).status_code == 404
    with session_scope(settings.sqlalchemy_url) as s:  # operators (and usage) still see how and when it ended
        row = s.get(Batch, batch["id"])
        assert row.status == "cancelled" and row.cancelled_at is not None
        assert row.deleted_at is not None and row.cancelled_at <= row.deleted_at


def test_a_message_batchs_requests_are_parsed_once_and_what_the_fan_out_refuses_is_errored_in_anthropics_words(
        client, keys, monkeypatch):
    """Create checks every request (``parse_line``) and hands the lines to the fan-out, which does not parse the
    file again; a request only the fan-out refuses (its prompt's tokens are counted there) is errored with the
    custom_id (the fan-out took the request from its line in the batch's input file)."""
    from app.api import message_batches as api
    from app.batch import lines

    parsed = []

    def counted(line_no, *args, **kwargs):
        parsed.append(line_no)
        return real(line_no, *args, **kwargs)

    real = lines.parse_line
    monkeypatch.setattr(lines, "parse_line", counted)
    monkeypatch.setattr(api, "parse_line", counted)
    headers = {"x-api-key": keys.paid}
    made = client.post("/v1/messages/batches", headers=headers, json={"requests": [
        {"custom_id": "short", "params": {"model": "tiny", "max_tokens": 2,
                                          "messages": [{"role": "user", "content": "Hi"}]}},
        {"custom_id": "long", "params": {"model": "tiny", "max_tokens": 2,
                                         # over the 512-token context in tokens, not in characters (create
                                         # refuses more characters than its tokens can hold: 8 at least each)
                                         "messages": [{"role": "user", "content": "Hi " * 1_000}]}}]})
    assert made.status_code == 200, made.text
    assert parsed == [1, 2]  # at create only: the fan-out (done before the answer here) took those lines
    done = client.post(f"/v1/messages/batches/{made.json()['id']}/cancel", headers=headers).json()
    assert done["processing_status"] == "ended", done
    results = [json.loads(line) for line in client.get(f"/v1/messages/batches/{made.json()['id']}/results",
                                                       headers=headers).text.splitlines()]
    assert [r["result"]["type"] for r in results] == ["canceled", "errored"]
    error = results[1]["result"]["error"]
    assert error["error"]["type"] == "invalid_request_error"
    # in Anthropic's words, as POST /v1/messages refuses an over-long prompt: the result's custom_id names the
    # request, so the message has no "line 2: " (the OpenAI batch error file's way to name it)
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 512 maximum", error["error"]["message"]), error


def _job_counts(client, path: str, headers: dict) -> tuple[dict, int]:
    """``GET path``'s answer, and how many counts of jobs the process ran meanwhile (only those: a batch just made
    may still be writing its jobs in a thread of its own)."""
    with statements() as seen:
        answer = client.get(path, headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.json(), sum("count(" in q.lower() and "FROM jobs" in q for q in seen)


def test_a_page_of_ended_message_batches_counts_their_requests_in_one_query(client, keys):
    """The list counts the ended batches' canceled and expired requests for the whole page at once: one count of
    jobs for a page of one batch or of four (it ran one a batch)."""
    headers = {"x-api-key": keys.paid}
    ended_message_batch(client, keys)
    one, one_count = _job_counts(client, "/v1/messages/batches", headers)
    for _ in range(3):
        ended_message_batch(client, keys)
    four, four_counts = _job_counts(client, "/v1/messages/batches", headers)
    assert [b["request_counts"]["canceled"] for b in one["data"]] == [2]
    assert [b["request_counts"] for b in four["data"]] == [
        {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 2, "expired": 0}] * 4
    assert one_count == four_counts == 1, (one_count, four_counts)


def _errored_beside_a_good_one(client, keys, bad_params: dict) -> dict:
    """A message batch of a good request and a bad one (``bad_params``), cancelled once made: the bad one's result,
    the good one's canceled."""
    headers = {"x-api-key": keys.paid}
    ok = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    made = client.post("/v1/messages/batches", headers=headers, json={"requests": [
        {"custom_id": "fits", "params": ok}, {"custom_id": "bad", "params": {**ok, **bad_params}}]})
    assert made.status_code == 200, made.text  # Anthropic validates each request's params apart, not the batch
    assert made.json()["request_counts"]["processing"] == 2, made.json()
    done = client.post(f"/v1/messages/batches/{made.json()['id']}/cancel", headers=headers).json()
    assert done["request_counts"] | {"canceled": 0} == {
        "processing": 0, "succeeded": 0, "errored": 1, "canceled": 0, "expired": 0}, done
    results = [json.loads(line) for line in client.get(f"/v1/messages/batches/{made.json()['id']}/results",
                                                       headers=headers).text.splitlines()]
    assert [(r["custom_id"], r["result"]["type"]) for r in results] == [("fits", "canceled"), ("bad", "errored")]
    error = results[1]["result"]["error"]
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    return error["error"]


def test_a_request_whose_prompt_cannot_fit_the_context_is_errored_alone(client, keys, settings):
    """The bound the API knows without tokenizing (more characters than the context's tokens can hold) is checked
    when the batch is made, as POST /v1/messages checks it, and the request is errored, in Anthropic's words: one
    bad request refused the whole batch with a 400, where Anthropic validates each request's params on its own and
    reports an ``errored`` result (only a malformed body is a 400)."""
    from app.services.jobs import max_chars_per_token
    from app.services.workers import held_context_length

    too_long = "x" * (held_context_length(settings) * max_chars_per_token(settings.model) + 1)
    error = _errored_beside_a_good_one(client, keys, {"messages": [{"role": "user", "content": too_long}]})
    assert error["message"].startswith(f"prompt is too long: at least {held_context_length(settings) + 1} tokens > "
                                       ), error


@pytest.mark.parametrize("max_tokens", [512, 600])  # the tiny model's context is 512 tokens
def test_a_request_whose_max_tokens_leaves_its_prompt_no_room_is_errored_alone(client, keys, max_tokens):
    """A prompt takes a token at least: a max_tokens of the whole context cannot fit beside it, which needs no
    tokenizer to tell; the request is errored, the batch's other requests run."""
    error = _errored_beside_a_good_one(client, keys, {"max_tokens": max_tokens})
    assert error["message"].startswith(f"input length and `max_tokens` exceed context limit: at least 1 + {max_tokens} "
                                       "> 512"), error


def test_a_request_whose_fields_are_invalid_is_errored_alone_naming_the_field(client, keys):
    """A request without max_tokens (a field /v1/messages needs): errored, its message naming the field."""
    error = _errored_beside_a_good_one(client, keys, {"max_tokens": None})
    assert "max_tokens" in error["message"] and not error["message"].startswith("line "), error


def test_a_message_batch_cancelled_before_its_fan_out_ran_has_its_requests_canceled(client, keys, settings,
                                                                                     monkeypatch):
    """A cancel that comes while the batch is still validating (its fan-out, a background task, has not written its
    jobs: seconds for a large batch) ends it with no request run: each is ``canceled``, in its counts and results,
    as Anthropic answers a cancel, not ``errored`` as if the batch had failed; the fan-out that runs after the
    cancel runs nothing and changes none of it."""
    from app.api import message_batches as api
    from app.batch.fanout import start_batch

    held = []
    monkeypatch.setattr(api, "start_batch", lambda *args: held.append(args))  # the fan-out, held until after
    headers = {"x-api-key": keys.paid}
    made = client.post("/v1/messages/batches", headers=headers, json={"requests": [
        {"custom_id": f"r{i}", "params": {"model": "tiny", "max_tokens": 2,
                                           "messages": [{"role": "user", "content": "Hi"}]}} for i in range(2)]})
    assert made.status_code == 200 and made.json()["processing_status"] == "in_progress", made.text
    batch_id = made.json()["id"]
    cancelled = client.post(f"/v1/messages/batches/{batch_id}/cancel", headers=headers).json()
    start_batch(*held.pop())  # the fan-out, after the cancel
    seen = client.get(f"/v1/messages/batches/{batch_id}", headers=headers).json()
    canceled = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 2, "expired": 0}
    for batch in (cancelled, seen):
        assert batch["processing_status"] == "ended" and batch["request_counts"] == canceled, batch
    results = client.get(f"/v1/messages/batches/{batch_id}/results", headers=headers).text.splitlines()
    assert [json.loads(line)["result"] for line in results] == [{"type": "canceled"}] * 2


def test_a_message_batchs_counts_are_the_tally_of_its_results(client, keys, settings):
    """Its jobs ended as the worker and the window write them (succeeded; given up on by the scheduler while the
    window was open: errored; given up on after it ended, and stopped by the window: expired): each request is
    counted as its result says."""
    from datetime import timedelta

    from app.batch.finalize import maybe_finalize
    from app.db.models import Job
    from app.services.transitions import utcnow

    headers = {"x-api-key": keys.paid}
    made = client.post("/v1/messages/batches", headers=headers, json={"requests": [
        {"custom_id": f"r{i}", "params": {"model": "tiny", "max_tokens": 2,
                                           "messages": [{"role": "user", "content": "Hi"}]}} for i in range(4)]})
    assert made.status_code == 200, made.text
    batch_id = made.json()["id"]
    given_up = "relegated under overload and expired before its first token (its deadline had long passed)"
    with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
        now, second = utcnow(), timedelta(seconds=1)
        s.execute(update(Batch).where(Batch.id == batch_id).values(expires_at=now - 2 * second))
        ends = {"r0": {"status": "succeeded", "output_text": "Hello", "finish_reason": "stop", "prompt_tokens": 3,
                       "completion_tokens": 1, "finished_at": now - 3 * second},
                "r1": {"status": "expired", "error": given_up, "finished_at": now - 3 * second},  # window open
                "r2": {"status": "expired", "error": given_up, "finished_at": now - second},  # window ended
                "r3": {"status": "expired", "error": None, "finished_at": now - second}}  # the window's stop
        for custom_id, end in ends.items():
            s.execute(update(Job).where(Job.batch_id == batch_id, Job.custom_id == custom_id).values(
                slo_met=end["status"] == "succeeded", settled_at=end["finished_at"], **end))
        s.commit()
    with session_scope(settings.sqlalchemy_url) as s:
        assert maybe_finalize(s, batch_id, settings.data_dir, None)
    batch = client.get(f"/v1/messages/batches/{batch_id}", headers=headers).json()
    results = client.get(f"/v1/messages/batches/{batch_id}/results", headers=headers).text.splitlines()
    kinds = [json.loads(line)["result"]["type"] for line in results]
    assert kinds == ["succeeded", "errored", "expired", "expired"], results
    tally = {kind: kinds.count(kind) for kind in ("succeeded", "errored", "canceled", "expired")}
    assert batch["request_counts"] == {"processing": 0, **tally}, (batch["request_counts"], kinds)
    listed = client.get("/v1/messages/batches", headers=headers).json()["data"]
    assert [b["request_counts"] for b in listed] == [batch["request_counts"]]


def test_a_message_batchs_results_are_never_held_whole_in_memory(settings, keys):
    """GET /v1/messages/batches/{id}/results read its input, output and error files whole and built the reply in
    memory (each a copy of files that may be hundreds of MiB): it is streamed now, a request's result at a time, in
    the order of its requests (its output file's own order differs), as its lines were. Real uvicorn; the client
    reads the reply in pieces too, so the process's peak is the server's own."""
    import tracemalloc

    import requests

    from app.batch import storage
    from app.main import create_app
    from tests.conftest import served_by_uvicorn

    headers, count, text = {"x-api-key": keys.paid}, 1000, "word " * 3000  # about 15 MiB of Messages
    with served_by_uvicorn(create_app(settings), "uvicorn-message-results") as base:
        made = requests.post(f"{base}/v1/messages/batches", headers=headers, timeout=60, json={"requests": [
            {"custom_id": f"r{i}", "params": {"model": "tiny", "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "Hi"}]}} for i in range(2)]})
        batch_id = made.json()["id"]
        done = requests.post(f"{base}/v1/messages/batches/{batch_id}/cancel", headers=headers, timeout=60).json()
        assert done["processing_status"] == "ended", done  # its results: the files written below
        ids = [f"r{i}" for i in range(count)]
        with session_scope(settings.sqlalchemy_url) as s:
            batch = s.get(Batch, batch_id)
            Path(s.get(File, batch.input_file_id).path).write_bytes(b"".join(mb.input_lines(
                (cid, {"model": "tiny", "max_tokens": 2, "messages": []}) for cid in ids)))
            output = "".join(json.dumps({"custom_id": cid, "response": {"body": {"content": [
                {"type": "text", "text": text}]}}}) + "\n" for cid in reversed(ids)).encode()
            errors = "".join(json.dumps({"id": f"batch_req_{cid}", "custom_id": cid, "response": None, "error": {
                "code": "batch_cancelled", "message": "cancelled"}}) + "\n" for cid in ids[:10]).encode()
            out, err = (storage.save_file(s, settings.data_dir, keys.tenant_id, name, storage.MESSAGE_BATCH_RESULTS,
                                          content) for name, content in (("out.jsonl", output), ("err.jsonl", errors)))
            with write_guard(s):  # its first 10 requests in both files: their error lines are their results
                s.execute(update(Batch).where(Batch.id == batch_id).values(output_file_id=out.id,
                                                                          error_file_id=err.id))
                s.commit()
        size = len(output)
        del output
        url = f"{base}/v1/messages/batches/{batch_id}/results"
        tracemalloc.start()
        try:
            got = []
            with requests.get(url, headers=headers, stream=True, timeout=300) as r:
                for line in r.iter_lines(64 * 1024):
                    result = json.loads(line)
                    message = result["result"].get("message")
                    got.append((result["custom_id"], result["result"]["type"],
                                message["content"][0]["text"] == text if message else None))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-jsonl", r.text
    assert got == [(cid, "canceled", None) for cid in ids[:10]] + [(cid, "succeeded", True) for cid in ids[10:]]
    assert peak < size // 4, f"{peak} bytes allocated at the peak of results from a {size}-byte output file"
