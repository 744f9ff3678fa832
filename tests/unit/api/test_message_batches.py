"""Anthropic's Message Batches in batch terms and back (pure logic): the requests as batch lines, the
``message_batch`` object, and the output and error files' lines as results."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from io import BytesIO

from app.anthropic_schemas import message_of, stop_of
from app.batch import message_batches as mb
from app.batch.lines import InvalidLine, ValidLine, parse_file
from app.batch.objects import invalid_line, job_error_line, output_line
from app.db.models import Batch, Job
from app.tool_calls import read_answer

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def input_file(requests) -> bytes:
    """The input file of ``requests`` (custom_id, params), whole, as the route writes it a line at a time."""
    return b"".join(mb.input_lines(requests))


def params(**extra) -> dict:
    return {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_requests_are_batch_lines_checked_as_post_v1_messages_checks_them():
    content = input_file([("a", params(system="Be brief", stop_sequences=["END"])),
                          ("b", params(max_tokens=0)),
                          ("c", params(thinking={"type": "enabled", "budget_tokens": 10})),
                          ("d", params(stream=True)), ("e", params(ttft_ms=50)), ("f", params(container="x"))])
    parsed = parse_file(content, "/v1/messages", 86400)
    (a,) = parsed.valid
    assert isinstance(a, ValidLine) and a.custom_id == "a"
    (spec,) = a.specs
    assert spec.kind == "batch" and spec.deadline_window_s == 86400 and spec.max_tokens == 5
    assert spec.stop == ["END"] and [m.role for m in spec.messages] == ["system", "user"]
    why = {line.custom_id: line.message for line in parsed.invalid}
    assert all(isinstance(line, InvalidLine) for line in parsed.invalid) and sorted(why) == list("bcdef")
    assert "max_tokens" in why["b"] and "budget_tokens" in why["c"] and "stream" in why["d"]
    assert "ttft_ms" in why["e"] and "container" in why["f"]
    renamed = parse_file(input_file([("g", params(stop_sequences=["1", "2", "3", "4", "5"]))]),
                         "/v1/messages", 86400)
    assert "stop_sequences" in renamed.invalid[0].message  # named as the Messages field, as /v1/messages does


def batch(status: str, **fields) -> Batch:
    return Batch(id="msgbatch_1", endpoint="/v1/messages", status=status, total=3, completed=0, created_at=T0,
                 expires_at=T0 + timedelta(hours=24), **fields)


def test_the_message_batch_object_by_status():
    running = mb.message_batch(batch("validating"), {"processing": 3}, "http://h/r")
    assert running["type"] == "message_batch" and running["processing_status"] == "in_progress"
    assert running["results_url"] is None and running["ended_at"] is None and running["archived_at"] is None
    assert running["created_at"] == "2026-01-02T03:04:05Z" and running["expires_at"] == "2026-01-03T03:04:05Z"
    assert mb.processing_status(batch("finalizing")) == "in_progress"
    canceling = batch("finalizing", cancelling_at=T0)  # a cancel's finalize: still canceling
    assert mb.message_batch(canceling, {}, "u")["processing_status"] == "canceling"
    assert mb.message_batch(canceling, {}, "u")["cancel_initiated_at"] == "2026-01-02T03:04:05Z"
    for status, at in (("completed", "completed_at"), ("cancelled", "cancelled_at"), ("expired", "expired_at"),
                       ("failed", "failed_at")):
        done = mb.message_batch(batch(status, **{at: T0 + timedelta(minutes=1)}), {}, "http://h/r")
        assert (done["processing_status"], done["ended_at"], done["results_url"]) == (
            "ended", "2026-01-02T03:05:05Z", "http://h/r")


def job(**fields) -> Job:
    return Job(**{"id": "job_abc", "endpoint": "/v1/messages", "model": "m", "custom_id": "a", "output_text": "Hi",
                  "finish_reason": "length", "prompt_tokens": 9, "completion_tokens": 5, "cached_tokens": 4,
                  "sampling": {}} | fields)


def test_a_succeeded_line_is_the_message_post_v1_messages_answers():
    done = job(stop_reason=None)
    line = json.loads(json.dumps(output_line([done])))  # as the output file holds it
    result = mb.result_of_output(line)
    assert result["result"]["type"] == "succeeded" and result["custom_id"] == "a"
    online = message_of("job_abc", "m", read_answer("job_abc", {}, "Hi", "length"), None, 9, 5, 4, None)
    assert result["result"]["message"] == online
    message = result["result"]["message"]
    assert message["id"] == "msg_abc" and message["type"] == "message" and message["stop_reason"] == "max_tokens"
    assert message["content"] == [{"type": "text", "text": "Hi"}]
    assert message["usage"] == {"input_tokens": 5, "output_tokens": 5, "cache_read_input_tokens": 4}
    assert stop_of("stop", "END", None) == ("stop_sequence", "END")


def test_error_lines_are_canceled_expired_or_errored_results_in_request_order():
    inputs = input_file([(c, params()) for c in ("ok", "gone", "late", "broke", "bad", "lost")])
    outputs = (json.dumps(output_line([job(custom_id="ok")])) + "\n").encode()
    errors = "\n".join(json.dumps(line) for line in (
        job_error_line(job(custom_id="gone", status="cancelled")),
        job_error_line(job(custom_id="late", status="expired")),
        job_error_line(job(custom_id="broke", status="failed", error="engine died")),
        invalid_line(5, "bad", "invalid_body", "line 5: prompt too long"),
    )).encode()
    results = list(mb.results(BytesIO(inputs), BytesIO(outputs), BytesIO(errors), None))
    assert [r["custom_id"] for r in results] == ["ok", "gone", "late", "broke", "bad", "lost"]
    assert [r["result"]["type"] for r in results] == ["succeeded", "canceled", "expired", "errored", "errored",
                                                      "errored"]
    broke, bad = results[3]["result"]["error"], results[4]["result"]["error"]
    assert broke["type"] == "error" and broke["error"]["type"] == "api_error" and "engine died" in \
        broke["error"]["message"]
    assert bad["error"] == {"type": "invalid_request_error", "message": "prompt too long"}  # custom_id names it


def test_a_batch_that_failed_before_running_errs_every_request_with_why():
    inputs = input_file([("a", params()), ("b", params())])
    refused = [{"code": "token_limit_exceeded", "message": "over the queue limit"}]
    results = list(mb.results(BytesIO(inputs), None, None, refused))
    assert [(r["custom_id"], r["result"]["type"]) for r in results] == [("a", "errored"), ("b", "errored")]
    assert results[0]["result"]["error"]["error"] == {"type": "invalid_request_error",
                                                      "message": "over the queue limit"}
    crashed = list(mb.results(BytesIO(inputs), None, None, [{"code": "internal_error", "message": "see the log"}]))
    assert crashed[0]["result"]["error"]["error"]["type"] == "api_error"


def test_a_request_with_interactive_qos_fields_is_told_what_a_message_batch_request_takes():
    # a message batch runs its requests as batch jobs due when its 24 hours end: no ttft_ms, tbt_ms, tbt_anchor,
    # deadline, nor the job's own deadline_at, deadline_window_s or kind (not "give either deadline or ttft_ms/...",
    # which reads as if a deadline were taken, nor a field silently ignored)
    lines = [(f, params(**{f: v})) for f, v in (("ttft_ms", 50), ("tbt_ms", 20), ("tbt_anchor", "arrival"),
                                                ("deadline", 3600), ("deadline_at", "2030-01-01T00:00:00Z"),
                                                ("deadline_window_s", 60), ("kind", "interactive"))]
    why = {line.custom_id: line.message for line in parse_file(input_file(lines), "/v1/messages", 86400).invalid}
    for field, _ in lines:
        assert why.get(field) == (f"line {[f for f, _ in lines].index(field) + 1}: invalid body: {field}: a message "
                                  "batch's requests run as batch jobs due when the batch's 24 hours end, and take no "
                                  "ttft_ms, tbt_ms, tbt_anchor, deadline, deadline_at, deadline_window_s or kind; "
                                  "leave it out"), why.get(field)


def test_a_request_without_a_model_is_refused_naming_it():
    # as POST /v1/messages (vLLM's AnthropicMessagesRequest: model is required), not run with the default model
    (bad,) = parse_file(input_file([("a", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})]),
                        "/v1/messages", 86400).invalid
    assert bad.message == "line 1: invalid body: model: Field required"
