"""What an OpenAI client is told of a job the scheduler relegated under overload: the real app over a real migrated
SQL database and a real Redis, the job's worker played by writing its state and publishing its events as the
worker's outbox does (the relegation, the expiry after it; see test_worker_expiry.py for the worker's side)."""

from __future__ import annotations

import json
import threading

import pytest
import redis
from sqlalchemy import select, update

from app.db.models import Job
from app.db.session import session_scope
from app.services import answer_events
from app.services.streaming import StreamEvent, publish
from tests.conftest import Keys, wait_for

pytestmark = pytest.mark.integration

# what the worker writes on a job the scheduler relegated and then gave up on (engine_thread._expiry)
GIVEN_UP = "relegated under overload and expired before its first token (its deadline had long passed)"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _as_the_worker(settings, events: list[StreamEvent], expired: bool = False,
                   released: threading.Event | None = None) -> threading.Thread:
    """A thread that waits for the request's job (and for ``released``, 10 s at most), then publishes ``events`` on
    its stream (``expired``: the job is written expired, as the worker writes one given up on, first)."""
    def submitted() -> str | None:
        with session_scope(settings.sqlalchemy_url) as s:
            return s.scalar(select(Job.id))

    def run() -> None:
        job_id = wait_for(submitted, 30, "the request's job")
        if released is not None:
            released.wait(10)
        with session_scope(settings.sqlalchemy_url) as s:
            if expired:
                s.execute(update(Job).where(Job.id == job_id).values(status="expired", error=GIVEN_UP,
                                                                     relegation_count=1))
        rds = redis.Redis.from_url(settings.redis_url)
        for ev in events:
            publish(rds, job_id, ev)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _sse_lines(body: str) -> list[str]:
    return [line for line in body.split("\n") if line]


def _streamed(client, route: str, body: dict | None, headers: dict, last_line=None) -> list[str]:
    """The lines of ``route``'s stream, POSTed ``body`` (None: a GET); ``last_line`` is called on each as it comes."""
    with client.stream("GET" if body is None else "POST", route, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        lines = []
        for line in r.iter_lines():
            if line:
                lines.append(line)
                if last_line is not None:
                    last_line(line)
        return lines


def _releasing(keepalive: str, released: threading.Event, after: int = 3):
    """What counts the stream's keepalives as they come and sets ``released`` on the ``after``-th."""
    kept = []

    def count(line: str) -> None:
        if line == keepalive and not released.is_set():
            kept.append(line)
            if len(kept) == after:
                released.set()
    return count


RELEGATED, RESUMED = (StreamEvent("status", attempt=1, status=s) for s in ("relegated", "resumed"))
EXPIRED = StreamEvent("end", attempt=1, status="expired", data={"error": GIVEN_UP})
ANSWER = [*(StreamEvent("delta", attempt=1, text=t, token_ids=[k], offset=k, data={"token_offset": k})
            for k, t in enumerate(["a", "b"])),
          StreamEvent("end", attempt=1, status="succeeded", finish_reason="length",
                      data={"prompt_tokens": 3, "completion_tokens": 2})]
ANTHROPIC = {"x-api-key": "", "anthropic-version": "2023-06-01"}
# each stream: its route, its body, and how it says nothing but that it is alive (the Messages API's stream sends
# one ping at its start too); the first token's line
STREAMS = {
    "chat": ("/v1/chat/completions", {**CHAT, "stream": True}, ": keepalive", '"content":"a"'),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 4, "stream": True}, ": keepalive",
                  '"delta":"a"'),
    "messages": ("/v1/messages", {**CHAT, "model": "tiny", "stream": True}, 'data: {"type":"ping"}',
                 '"text":"a"'),
}


def _headers(route: str, key: str) -> dict[str, str]:
    return {**ANTHROPIC, "x-api-key": key} if route == "/v1/messages" else Keys.header(key)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_openai_request_whose_relegated_job_expired_is_told_why(client, keys, settings, stream):
    """A 504 (or the stream's error) said only that the deadline passed: not that the server, overloaded, set the
    request aside and gave up on it, which is what the client can act on (retry later, or pay for the tier)."""
    worker = _as_the_worker(settings, [RELEGATED, EXPIRED], expired=True)
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers=Keys.header(keys.free))
    worker.join(30)
    if stream:
        errors = [json.loads(line[6:]) for line in _sse_lines(r.text) if line.startswith("data: {\"error\"")]
        assert r.status_code == 200 and len(errors) == 1, r.text
        error = errors[0]["error"]
    else:
        assert r.status_code == 504, r.text
        error = r.json()["error"]
    assert error["code"] == "deadline_exceeded" and error["type"] == "timeout"
    assert "overload" in error["message"] and "relegated" in error["message"], error


def test_a_streamed_answer_says_while_its_job_is_relegated(client, keys, settings):
    """A stream whose job was relegated went silent (a minute or more, until load dropped or the job expired),
    indistinguishable from a hung server. It now says so, and when the job resumes, in SSE comments, which
    OpenAI's clients skip; the answer's chunks are unchanged."""
    deltas = [StreamEvent("delta", attempt=1, text=t, token_ids=[k], offset=k, data={"token_offset": k})
              for k, t in enumerate(["a", "b"])]
    end = StreamEvent("end", attempt=1, status="succeeded", finish_reason="length",
                      data={"prompt_tokens": 3, "completion_tokens": 2})
    worker = _as_the_worker(settings, [RELEGATED, RESUMED, *deltas, end])
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=Keys.header(keys.free))
    worker.join(30)
    lines = _sse_lines(r.text)
    comments = [line for line in lines if line.startswith(":")]
    assert len(comments) == 2 and "relegated" in comments[0] and "resumed" in comments[1], lines
    assert lines.index(comments[0]) < lines.index(comments[1]) < next(
        i for i, line in enumerate(lines) if '"content":"a"' in line), lines
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and len(data) == 5, data  # the role chunk, two tokens, the finish, DONE


@pytest.mark.parametrize("api", list(STREAMS))
def test_a_stream_whose_job_sends_nothing_is_kept_alive(client, keys, settings, monkeypatch, api):
    """A stream whose job waited (queued, or relegated for a minute or more) sent no byte meanwhile, and a proxy's
    idle timeout (nginx's, an AWS ALB's: 60 s) cut it. It now sends a keepalive each KEEPALIVE_S it has nothing
    to send: an SSE comment, or on the Messages API a ping. (The job here says nothing until three came.)"""
    monkeypatch.setattr(answer_events, "KEEPALIVE_S", 0.05, raising=False)
    route, body, keepalive, first_token = STREAMS[api]
    released = threading.Event()
    worker = _as_the_worker(settings, ANSWER, released=released)
    lines = _streamed(client, route, body, _headers(route, keys.free), _releasing(keepalive, released))
    worker.join(30)
    first = next(i for i, line in enumerate(lines) if first_token in line)
    assert lines[:first].count(keepalive) >= 3, lines


def test_the_native_job_stream_is_kept_alive(client, keys, settings, monkeypatch):
    """GET /v1/jobs/{id}/stream, the same: a comment each KEEPALIVE_S while the job sends nothing."""
    monkeypatch.setattr(answer_events, "KEEPALIVE_S", 0.05, raising=False)
    released = threading.Event()
    worker = _as_the_worker(settings, ANSWER, released=released)
    job = client.post("/v1/jobs", json={"messages": CHAT["messages"], "max_tokens": 4}, headers=Keys.header(keys.free))
    assert job.status_code in (200, 201, 202), job.text
    lines = _streamed(client, f"/v1/jobs/{job.json()['id']}/stream", None, Keys.header(keys.free),
                      _releasing(": keepalive", released))
    worker.join(30)
    first = next(i for i, line in enumerate(lines) if line.startswith("event: delta"))
    assert lines[:first].count(": keepalive") >= 3, lines


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_a_responses_or_messages_stream_says_while_its_job_is_relegated(client, keys, settings, api):
    """The Responses and Messages streams went silent while their job was relegated, as the chat stream did. They
    now say so, and when it resumes: the Responses stream in SSE comments (unnumbered), the Messages stream in
    pings (which Anthropic's SDKs skip) that carry the status."""
    route, body, _keepalive, first_token = STREAMS[api]
    worker = _as_the_worker(settings, [RELEGATED, RESUMED, *ANSWER])
    lines = _streamed(client, route, body, _headers(route, keys.free))
    worker.join(30)
    said = [line for line in lines if ("relegated" in line or "resumed" in line)]
    assert len(said) == 2 and "relegated" in said[0] and "resumed" in said[1], lines
    if api == "responses":
        assert all(line.startswith(":") for line in said), said
    else:
        assert all(json.loads(line[6:])["type"] == "ping" for line in said), said
    assert lines.index(said[1]) < next(i for i, line in enumerate(lines) if first_token in line), lines


def _native_events(client, key: str) -> list[tuple[str, str]]:
    """The native stream of the (one) job a new submission makes: each event's name and data, in order."""
    job = client.post("/v1/jobs", json={"messages": CHAT["messages"], "max_tokens": 4}, headers=Keys.header(key))
    assert job.status_code in (200, 201, 202), job.text
    lines = _streamed(client, f"/v1/jobs/{job.json()['id']}/stream", None, Keys.header(key))
    names = [line[7:] for line in lines if line.startswith("event: ")]
    return list(zip(names, [line[6:] for line in lines if line.startswith("data: ")], strict=True))


def test_the_native_stream_says_resumed_before_the_resumed_jobs_tokens(client, keys, settings):
    """The worker publishes a resumed job's tokens at once and its ``resumed`` only once SQL has the job running
    again (later still where that write is retried): a client read tokens while the last status it had said
    ``relegated``. The stream now says ``resumed`` before them, once (the worker's late one, or one published
    twice, changes nothing)."""
    first, second = (StreamEvent("delta", attempt=1, text=t, token_ids=[k], offset=k, data={"token_offset": k})
                     for k, t in enumerate(["a", "b"]))
    end = StreamEvent("end", attempt=1, status="succeeded", finish_reason="length",
                      data={"prompt_tokens": 3, "completion_tokens": 2})
    worker = _as_the_worker(settings, [first, RELEGATED, RELEGATED, second, RESUMED, RESUMED, end])
    events = _native_events(client, keys.free)
    worker.join(30)
    assert [(name, json.loads(data).get("status") or json.loads(data).get("text")) for name, data in events] == [
        ("delta", "a"), ("status", "relegated"), ("status", "resumed"), ("delta", "b"), ("end", "succeeded")], events
