"""Batch API round trip with the official openai client: real app, Redis, Celery worker, DB."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from sqlalchemy import update

from app.db.models import File, utcnow
from app.db.session import session_scope, write_guard
from tests.conftest import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def line(cid, content="Hi", url="/v1/chat/completions", **body):
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


@pytest.fixture
def oai(stack) -> openai.OpenAI:
    """The paid key's client of the module's shared stack (its plain worker ``w1``)."""
    return stack.openai(timeout=60)


def upload(oai, lines):
    return oai.files.create(file=("input.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")


def wait_batch(oai, batch_id, statuses, timeout=120):
    return wait_for(lambda: (b := oai.batches.retrieve(batch_id)).status in statuses and b, timeout,
                    f"batch {batch_id} to reach {statuses}", interval=0.3)


def jsonl(oai, file_id):
    return [json.loads(t) for t in oai.files.content(file_id).text.splitlines()]


def test_batch_round_trip_with_bad_lines(oai, stack):
    lines = [line("a", "Hello"), "{not json", line("b", "Tell me a joke", max_tokens=6),
             line("c", url="/v1/embeddings"), json.dumps({"method": "POST", "url": "/v1/chat/completions",
                                                          "body": {"messages": []}}),
             line("d", max_tokens=-3), line("e", "Bye", n=3, temperature=1.0, seed=3), line("f", "Last one")]
    src = upload(oai, lines)
    assert src.purpose == "batch" and src.bytes > 0
    assert src.id in [f.id for f in oai.files.list().data]
    batch = oai.batches.create(input_file_id=src.id, endpoint="/v1/chat/completions", completion_window="30m",
                               metadata={"run": "test"}, output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "test"}
    assert batch.expires_at - batch.created_at == 1800
    done = wait_batch(oai, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert done.request_counts.total == 8 and done.request_counts.completed == 4  # a line of 3 choices is 1
    assert done.request_counts.failed == 4

    out = jsonl(oai, done.output_file_id)
    assert [r["custom_id"] for r in out] == ["a", "b", "e", "f"]
    for r in out:
        body = r["response"]["body"]
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == {"b": 6, "e": 12}.get(r["custom_id"], 4)
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # the engine said: none cached
    # n=3: one answer of three choices, as online (OpenAI's Batch API and vLLM's run_batch take n), its prompt once
    e = out[2]["response"]["body"]
    assert [c["index"] for c in e["choices"]] == [0, 1, 2] and all(c["message"]["content"] for c in e["choices"])
    assert e["usage"]["prompt_tokens"] == out[3]["response"]["body"]["usage"]["prompt_tokens"]  # "Bye", "Last one"
    usage = [r["response"]["body"]["usage"] for r in out]
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in usage) > 0  # the batch's usage sums its lines'
    assert done.usage.output_tokens == 26 and done.usage.total_tokens == done.usage.input_tokens + 26
    assert done.usage.input_tokens_details.cached_tokens == 0

    errors = {int(e["id"].removeprefix("batch_req_line_")): e for e in jsonl(oai, done.error_file_id)}
    assert sorted(errors) == [2, 4, 5, 6]
    assert errors[2]["error"]["code"] == "invalid_json" and "line 2" in errors[2]["error"]["message"]
    assert errors[4]["custom_id"] == "c" and "/v1/embeddings" in errors[4]["error"]["message"]
    assert errors[5]["error"]["code"] == "missing_custom_id"
    assert "max_tokens" in errors[6]["error"]["message"] and errors[6]["custom_id"] == "d"
    assert all(e["response"] is None for e in errors.values())
    assert done.id in [b.id for b in oai.batches.list().data]

    # output_expires_after: both files expire two hours after they were made; once expired, the worker's sweeper
    # deletes them
    for file_id in (done.output_file_id, done.error_file_id):
        made = oai.files.retrieve(file_id)
        assert made.expires_at == made.created_at + 7200 and made.purpose == "batch_output"
    with session_scope(stack.settings.sqlalchemy_url) as s:
        path = Path(s.get(File, done.error_file_id).path)
    with session_scope(stack.settings.sqlalchemy_url) as s, write_guard(s):  # a write first: SQLite locks at once
        s.execute(update(File).where(File.id == done.error_file_id).values(expires_at=utcnow()))
        s.commit()
    wait_for(lambda: not path.exists(), 15, "the worker's sweeper to delete the expired error file")
    with pytest.raises(openai.NotFoundError):
        oai.files.content(done.error_file_id)
    assert len(jsonl(oai, done.output_file_id)) == 4


def test_create_answers_validating_before_the_input_file_is_validated(oai, monkeypatch):
    """The create request does not wait for the input file's validation (seconds at 50,000 lines: OpenAI answers
    ``validating`` and validates after it): the answer comes while validation has not ended, and the batch then goes
    on to ``in_progress`` with its bad line kept for the error file."""
    import threading

    from app.batch import lines as batch_lines

    file_refusal, may_end, ended = batch_lines.file_refusal, threading.Event(), threading.Event()

    def held_parse(*args, **kwargs):
        may_end.wait(30)  # released as soon as the create answered (a create that waited for it goes on at 30 s)
        try:
            return file_refusal(*args, **kwargs)
        finally:
            ended.set()

    monkeypatch.setattr(batch_lines, "file_refusal", held_parse)
    f = upload(oai, [line("ok", max_tokens=1), "{oops"])
    try:
        b = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        answered_before_validation_ended = not ended.is_set()
    finally:
        may_end.set()
    assert b.status == "validating" and answered_before_validation_ended
    b = wait_batch(oai, b.id, {"in_progress", "completed", "failed"})
    assert b.status != "failed" and ended.is_set() and b.request_counts.total == 2, b


def test_a_batch_of_responses(oai):
    def response_line(cid, **body):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/responses", "body": {
            "model": "tiny", "input": "Hi", "max_output_tokens": 3, "ignore_eos": True, **body}})
    lines = [response_line("a", instructions="Be brief", metadata={"k": "v"}),
             response_line("b", previous_response_id="resp_x"), response_line("c", max_output_tokens=0),
             response_line("d", input=[{"role": "user", "content": [{"type": "input_text", "text": "Yo"}]}])]
    words = " ".join(f"word{i}" for i in range(40))  # a conversation of ~650 tokens, over the context of 512
    long = [{"role": "user", "content": words}, {"role": "assistant", "content": words}] * 4 + [
        {"role": "user", "content": "Hi"}]
    lines += [response_line("e", input=long, truncation="auto"), response_line("f", input=long)]
    batch = oai.batches.create(input_file_id=upload(oai, lines).id, endpoint="/v1/responses", completion_window="1h")
    done = wait_batch(oai, batch.id, {"completed", "failed"})
    assert done.status == "completed" and done.request_counts.completed == 3, done
    out = {r["custom_id"]: r["response"]["body"] for r in jsonl(oai, done.output_file_id)}
    assert sorted(out) == ["a", "d", "e"]
    assert out["e"]["truncation"] == "auto" and out["e"]["usage"]["input_tokens"] < 512
    for body in out.values():
        assert body["object"] == "response" and body["status"] == "incomplete" and body["usage"]["output_tokens"] == 3
        assert body["output"][0]["content"][0]["text"]
    assert out["a"]["instructions"] == "Be brief" and out["a"]["metadata"] == {"k": "v"}
    assert oai.responses.retrieve(out["d"]["id"]).output_text == out["d"]["output"][0]["content"][0]["text"]
    errors = {e["custom_id"]: e["error"]["message"] for e in jsonl(oai, done.error_file_id)}
    assert "previous_response_id" in errors["b"] and "max_output_tokens" in errors["c"]
    assert "maximum context length is" in errors["f"]  # without truncation the long one is refused


def test_duplicate_custom_id_fails_validation(oai):
    src = upload(oai, [line("x"), line("y"), line("x"), line("y"), line("z")])
    batch = oai.batches.create(input_file_id=src.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_batch(oai, batch.id, {"failed", "in_progress", "completed"}, timeout=30)
    assert failed.status == "failed" and failed.output_file_id is None
    messages = [e.message for e in failed.errors.data]
    assert len(messages) == 2 and "'x'" in messages[0] and "lines 1, 3" in messages[0]
    assert {e.code for e in failed.errors.data} == {"duplicate_custom_id"}


def test_bad_window_and_unknown_file(oai):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.batches.create(input_file_id="file_x", endpoint="/v1/chat/completions", completion_window="soon")
    assert exc.value.body["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError):
        oai.batches.create(input_file_id="file_missing", endpoint="/v1/chat/completions", completion_window="2h")


def test_cancel_mid_batch_keeps_partial_output(oai):
    lines = [line("quick", max_tokens=2)] + [line(f"long{i}", f"Story {i}", max_tokens=420) for i in range(8)]
    batch = oai.batches.create(input_file_id=upload(oai, lines).id, endpoint="/v1/chat/completions",
                               completion_window="2h")
    wait_for(lambda: oai.batches.retrieve(batch.id).request_counts.completed >= 1, 120, "the quick line", 0.2)
    cancelling = oai.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_batch(oai, batch.id, {"cancelled"}, timeout=60)
    assert done.cancelled_at and done.cancelling_at
    assert 1 <= done.request_counts.completed < 9 and done.request_counts.failed == 9 - done.request_counts.completed
    out = jsonl(oai, done.output_file_id)
    assert "quick" in [r["custom_id"] for r in out]
    errs = jsonl(oai, done.error_file_id)
    assert errs and {e["error"]["code"] for e in errs} == {"batch_cancelled"}
    assert len(out) + len(errs) == 9
    with pytest.raises(openai.ConflictError):
        oai.batches.cancel(batch.id)


def test_window_ends_before_the_batch_finishes(live_server, keys, start_worker):
    # each engine step slowed to 0.1 s: the long lines (400 tokens each) cannot finish in 6 s
    start_worker("w1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build", COSERVE_STEP_DELAY_S="0.1")
    oai = openai.OpenAI(base_url=live_server + "/v1", api_key=keys.paid, max_retries=0, timeout=60)
    lines = [line("quick", max_tokens=2)] + [line(f"long{i}", f"Story {i}", max_tokens=400) for i in range(3)]
    batch = oai.batches.create(input_file_id=upload(oai, lines).id, endpoint="/v1/chat/completions",
                               completion_window="6s")
    assert batch.expires_at - batch.created_at == 6
    done = wait_batch(oai, batch.id, {"expired", "completed", "failed", "cancelled"}, timeout=90)
    assert done.status == "expired", done
    assert done.expired_at and done.expired_at >= done.expires_at and done.completed_at is None
    assert done.request_counts.total == 4
    assert done.request_counts.completed == 1 and done.request_counts.failed == 3

    out = jsonl(oai, done.output_file_id)  # what finished in time is kept
    assert [r["custom_id"] for r in out] == ["quick"]
    assert out[0]["response"]["body"]["usage"]["completion_tokens"] == 2
    errs = {e["custom_id"]: e for e in jsonl(oai, done.error_file_id)}
    assert sorted(errs) == ["long0", "long1", "long2"]
    assert {e["error"]["code"] for e in errs.values()} == {"batch_expired"}
    assert all(e["response"] is None for e in errs.values())


def test_the_sdk_pages_through_files_and_batches(oai):
    # iterating a list follows the pages by their last id (after=...), as the SDK's cursor pages do
    older, newer = upload(oai, [line("a")]), upload(oai, [line("b")])
    newest_first = [f.id for f in oai.files.list(limit=1)]
    assert newest_first[:2] == [newer.id, older.id] and len(set(newest_first)) == len(newest_first)
    assert [f.id for f in oai.files.list(limit=1, order="asc")] == newest_first[::-1]
    assert [f.id for f in oai.files.list(limit=1, after=newer.id)] == newest_first[1:]
    batches = [oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
               for f in (older, newer)]
    listed = [b.id for b in oai.batches.list(limit=1)]
    assert listed[:2] == [batches[1].id, batches[0].id] and len(set(listed)) == len(listed)
    assert [b.id for b in oai.batches.list(limit=1, after=batches[1].id)] == listed[1:]
    for batch in batches:
        wait_batch(oai, batch.id, {"completed"})
