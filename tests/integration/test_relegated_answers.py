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
from app.services.streaming import StreamEvent, publish
from tests.conftest import Keys, wait_for

pytestmark = pytest.mark.integration

# what the worker writes on a job the scheduler relegated and then gave up on (engine_thread._expiry)
GIVEN_UP = "relegated under overload and expired before its first token (its deadline had long passed)"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _as_the_worker(settings, events: list[StreamEvent], expired: bool = False) -> threading.Thread:
    """A thread that waits for the request's job, then publishes ``events`` on its stream (``expired``: the job is
    written expired, as the worker writes one given up on, first)."""
    def submitted() -> str | None:
        with session_scope(settings.sqlalchemy_url) as s:
            return s.scalar(select(Job.id))

    def run() -> None:
        job_id = wait_for(submitted, 30, "the request's job")
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


RELEGATED, RESUMED = (StreamEvent("status", attempt=1, status=s) for s in ("relegated", "resumed"))
EXPIRED = StreamEvent("end", attempt=1, status="expired", data={"error": GIVEN_UP})


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
