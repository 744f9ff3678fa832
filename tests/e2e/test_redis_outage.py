"""Streams across a Redis outage, and requests whose client left (issue 19 items 1 and 7).

The real app over HTTP, a real worker on slowed steps and a Redis of this test's own, stopped
mid-generation and started again, empty, on the same port: the native stream, an OpenAI stream
and an OpenAI plain request each deliver the job's whole text once and in order (SQL's
``output_text`` is the reference) or end with an error event; no job is cancelled. A client
that hangs up on a plain request cancels its job.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import select

from app.db.models import Job, JobEvent
from app.db.session import session_scope
from tests.conftest import make_settings, wait_for
from tests.redis_process import own_redis  # noqa: F401 - fixture

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

SLOW = {"COSERVE_ENGINE_FACTORY": "tests.e2e.slow_engine:build", "COSERVE_STEP_DELAY_S": "0.1"}
OUTAGE_S = 3.0
MAX_TOKENS = 100  # about 10 s of slowed steps: the outage falls in the middle


@pytest.fixture
def settings(tmp_path, db_url, own_redis, tiny_model_dir):  # noqa: F811 - this module's Redis
    return make_settings(tmp_path, db_url, own_redis.url, tiny_model_dir)


@dataclass
class Reader:
    """One request in a thread: the events it read (name, data), its end, what went wrong."""

    name: str
    events: list[tuple[str, object]] = field(default_factory=list)
    job_id: str | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def run(self, fn) -> Reader:
        def target():
            try:
                fn(self)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.error = exc
        self.thread = threading.Thread(target=target, name=self.name, daemon=True)
        self.thread.start()
        return self

    def text(self) -> str:
        return "".join(d.get("text", "") for n, d in self.events if n == "delta")


def _native(base: str, auth: dict, body: dict):
    def go(r: Reader):
        job = httpx.post(f"{base}/v1/jobs", headers=auth, json=body, timeout=30).json()
        r.job_id = job["id"]
        name = None
        with httpx.stream("GET", f"{base}/v1/jobs/{r.job_id}/stream", headers=auth, timeout=90) as resp:
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    r.events.append((name, json.loads(line[6:])))
    return go


def _openai_stream(base: str, auth: dict, body: dict):
    def go(r: Reader):
        with httpx.stream("POST", f"{base}/v1/chat/completions", headers=auth, json={**body, "stream": True},
                          timeout=90) as resp:
            r.job_id = resp.headers["x-coserve-job-id"]
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    r.events.append(("done", {}))
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    r.events.append(("error", data["error"]))
                elif data.get("choices"):
                    choice = data["choices"][0]
                    r.events.append(("delta", {"text": choice["delta"].get("content") or ""}))
                    if choice["finish_reason"]:
                        r.events.append(("finish", {"reason": choice["finish_reason"]}))
    return go


def _openai_plain(base: str, auth: dict, body: dict):
    def go(r: Reader):
        resp = httpx.post(f"{base}/v1/chat/completions", headers=auth, json=body, timeout=90)
        r.job_id = resp.headers.get("x-coserve-job-id")
        r.events.append((str(resp.status_code), resp.json()))
    return go


def _jobs(url: str) -> dict[str, Job]:
    with session_scope(url) as s:
        s.expire_all()
        return {j.id: j for j in s.scalars(select(Job))}


def _diverged_after_a_rerun(job: Job, events: list) -> bool:
    """The stream ended with its error for a job that ran again (a worker failed it during the outage) and whose new
    run's text parted from what the stream had sent: the one case where SQL's text need not go on from the stream's."""
    return job.attempt > 1 and "run again" in str(events[-1][1])


def _dropped(tmp_path) -> str:
    """The worker log's lines about events it could not publish (the worker's side of the fix)."""
    log = tmp_path / "w1.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(line for line in lines if "could not stream" in line)


def test_streams_survive_a_redis_restart(live_server, keys, settings, own_redis, start_worker, tmp_path, caplog):
    url = settings.sqlalchemy_url
    settings.stream_outage_s = 30.0  # well beyond this outage: every stream should ride it out
    start_worker("w1", **SLOW)
    auth = {"Authorization": f"Bearer {keys.paid}"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": MAX_TOKENS, "ignore_eos": True}
    native = Reader("native").run(_native(live_server, auth, {"prompt": "Once upon a time",
                                                               "max_tokens": MAX_TOKENS, "ignore_eos": True}))
    stream = Reader("openai-stream").run(_openai_stream(live_server, auth, chat))
    plain = Reader("openai-plain").run(_openai_plain(live_server, auth, chat))
    readers = [native, stream, plain]

    def mid_generation():
        jobs = _jobs(url)
        running = len(jobs) == 3 and all(j.status == "running" for j in jobs.values())
        return running and all(len(r.text()) > 0 for r in (native, stream))
    wait_for(mid_generation, 60, "three jobs running with text streamed", interval=0.1)

    caplog.set_level(logging.INFO, logger="app.services.streaming")
    own_redis.stop()
    time.sleep(OUTAGE_S)
    own_redis.start()  # the same port, empty: the streams and Celery's queues are gone
    for r in readers:
        r.thread.join(90)
        assert not r.thread.is_alive(), f"{r.name} did not finish"
        assert r.error is None, f"{r.name}: {r.error!r}"

    jobs = _jobs(url)
    with session_scope(url) as s:
        cancels = s.scalars(select(JobEvent).where(JobEvent.to_status == "cancelled")).all()
    assert not cancels and {j.status for j in jobs.values()} == {"succeeded"}
    assert "cannot read the stream" in caplog.text  # the outage hit the API's readers mid-stream
    dropped = _dropped(tmp_path)
    note = f"\nworker dropped events (its publishing is not fixed yet?):\n{dropped}" if dropped else ""

    # the native stream: all the text once and in order, then the end; or an error event last
    full = jobs[native.job_id].output_text
    last, data = native.events[-1]
    assert last in ("end", "error"), native.events[-3:]
    if last == "end":
        assert native.text() == full, f"native stream text differs from SQL's{note}"
        assert data["status"] == "succeeded" and data["completion_tokens"] == MAX_TOKENS
    else:
        assert full.startswith(native.text()) or _diverged_after_a_rerun(jobs[native.job_id], native.events), \
            f"native stream sent text SQL does not have{note}"

    # the OpenAI stream: the same, with its finish chunk and [DONE]; or an error chunk last
    full = jobs[stream.job_id].output_text
    names = [n for n, _ in stream.events]
    if "error" in names:
        assert names[-1] == "error", f"{stream.events[-3:]}{note}"
        assert full.startswith(stream.text()) or _diverged_after_a_rerun(jobs[stream.job_id], stream.events), \
            f"{stream.events[-3:]}{note}"
    else:
        assert stream.text() == full, f"OpenAI stream text differs from SQL's{note}"
        assert names[-2:] == ["finish", "done"]

    # the plain request: answered (no 500 while Redis was away), with SQL's text
    (code, body), = plain.events
    assert code == "200", body
    assert body["choices"][0]["message"]["content"] == jobs[plain.job_id].output_text
    assert body["usage"]["completion_tokens"] == MAX_TOKENS


def test_a_client_that_leaves_a_plain_request_cancels_its_job(live_server, keys, settings, start_worker):
    url = settings.sqlalchemy_url
    start_worker("w1", **SLOW)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story"}],
                       "max_tokens": 400, "ignore_eos": True}).encode()
    where = urlsplit(live_server)
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {where.netloc}\r\n"
               f"Authorization: Bearer {keys.paid}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        sock.sendall(request)
        job_id = wait_for(lambda: next((j.id for j in _jobs(url).values() if j.status == "running"), None), 60,
                          "the job to be running")
        time.sleep(1.0)  # generating, the client waiting for the whole answer
    # the client hung up: the API notices within its poll and cancels the job
    left = time.monotonic()
    wait_for(lambda: _jobs(url)[job_id].status == "cancelled", 15, "the abandoned job to be cancelled",
             interval=0.2)
    assert time.monotonic() - left < 5
    with session_scope(url) as s:
        detail = s.scalars(select(JobEvent.detail).where(JobEvent.job_id == job_id,
                                                         JobEvent.to_status == "cancelled")).one()
    assert "client disconnected" in detail
    job = _jobs(url)[job_id]
    assert job.completion_tokens is None or job.completion_tokens < 400
