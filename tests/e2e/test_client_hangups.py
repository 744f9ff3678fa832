"""A client that hangs up mid-answer, on every answer route, as vLLM's server treats it: the real app over HTTP, a
real Celery worker (its steps slowed, so that each answer is long), Redis and SQL. A plain or streamed request's job
stops (its slot freed for the next job; the tokens it ran stay billed); a background response and a job read through
``/v1/jobs/{id}/stream`` run on (test_openai_client.py has chat's streamed and batched hang-ups)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import Keys, wait_for
from tests.e2e.test_openai_client import _jobs_of

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

SLOW = {"COSERVE_ENGINE_FACTORY": "tests.e2e.slow_engine:build", "COSERVE_STEP_DELAY_S": "0.1",
        "COSERVE_MAX_INFLIGHT": "1"}  # one job at a time: the next runs only once the abandoned one let go its slot
LONG = 300  # tokens: 30 s of slowed steps, far longer than any hang-up takes to be acted on
SHORT = 40  # tokens: 4 s of slowed steps, still going when a reader leaves after the first
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
# route, body: each asks for LONG tokens in the route's terms
ANSWERS = {
    "completions": ("/v1/completions", {"model": "tiny", "prompt": "Once", "max_tokens": LONG, "ignore_eos": True}),
    "responses": ("/v1/responses", {"model": "tiny", "input": "Tell me a story", "max_output_tokens": LONG}),
    "messages": ("/v1/messages", {"model": "tiny", "messages": MESSAGES, "max_tokens": LONG}),
}


@contextmanager
def posted(base: str, key: str, path: str, body: dict) -> Iterator[None]:
    """``body`` POSTed to ``path`` over a connection of its own, closed (the client hangs up) on leaving."""
    url, raw = urlsplit(base), json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n").encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
        conn.sendall(head + raw)
        yield


def _status(base: str, key: str, job_id: str) -> str:
    return httpx.get(f"{base}/v1/jobs/{job_id}", headers=Keys.header(key)).json()["status"]


def _first_token(base: str, key: str, job_id: str) -> None:
    """Waits for the job's first token, read from its own stream (a reader that then leaves: the job goes on)."""
    with httpx.stream("GET", f"{base}/v1/jobs/{job_id}/stream", headers=Keys.header(key), timeout=30) as r:
        next(line for line in r.iter_lines() if line.startswith("event: delta"))


def _next_job_runs(base: str, key: str) -> None:
    """A short job submitted now succeeds: the worker's one slot is free."""
    job_id = httpx.post(f"{base}/v1/jobs", headers=Keys.header(key), json={"prompt": "x", "max_tokens": 2}).json()["id"]
    wait_for(lambda: _status(base, key, job_id) == "succeeded", 20, "the next job to run in the freed slot")


def test_a_client_that_hangs_up_mid_answer_stops_its_job_on_every_route(live_server, keys, settings, start_worker):
    start_worker("w1", **SLOW)
    for name, (path, body) in ANSWERS.items():
        for stream in (False, True):
            seen = {job_id for job_id, _, _ in _jobs_of(settings, keys.tenant_id)}

            def ours() -> list[tuple[str, str, int | None]]:
                return [job for job in _jobs_of(settings, keys.tenant_id) if job[0] not in seen]  # noqa: B023

            with posted(live_server, keys.paid, path, {**body, "stream": stream}):
                (job_id, _, _), = wait_for(ours, 30, f"{name}'s job")
                _first_token(live_server, keys.paid, job_id)  # read apart: the client itself may read nothing
            # stopped, and settled: the API's cancel ends the job at once, its worker writes the tokens it ran after
            (_, status, tokens), = wait_for(lambda: [job for job in ours() if job[1] != "running"  # noqa: B023
                                                     and _settled(settings, job[0])], 15,
                                            f"{name}'s abandoned job to stop and settle")
            assert (status, tokens is not None and tokens < LONG) == ("cancelled", True), (name, stream, tokens)
            _next_job_runs(live_server, keys.paid)


def test_a_background_response_and_a_jobs_stream_run_on_when_their_reader_hangs_up(live_server, keys, settings,
                                                                                   start_worker):
    """OpenAI's background mode: the response runs on without its client (GET resumes it); a job submitted on its
    own runs on when a reader of its stream leaves."""
    start_worker("w1", **SLOW)
    path, body = ANSWERS["responses"]
    with httpx.stream("POST", live_server + path, headers=Keys.header(keys.paid), timeout=30,
                      json={**body, "max_output_tokens": SHORT, "stream": True, "background": True}) as r:
        background = r.headers["x-coserve-job-id"]
        next(line for line in r.iter_lines() if "output_text.delta" in line)
    job_id = httpx.post(f"{live_server}/v1/jobs", headers=Keys.header(keys.paid),
                        json={"prompt": "x", "max_tokens": SHORT, "ignore_eos": True}).json()["id"]
    _first_token(live_server, keys.paid, job_id)  # it runs: the background response ended (one slot)
    assert _status(live_server, keys.paid, background) == "succeeded"
    wait_for(lambda: _status(live_server, keys.paid, job_id) == "succeeded", 60, "the read job to run to its end")


def _settled(settings, job_id: str) -> bool:
    """Whether the job's end is settled: what its worker ran is written (``Job.settled_at``)."""
    from app.db.models import Job
    from app.db.session import session_scope

    with session_scope(settings.sqlalchemy_url) as s:
        return s.get(Job, job_id).settled_at is not None
