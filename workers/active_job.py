"""The jobs a worker holds: one ``ActiveJob`` per leased job, in an ``ActiveJobs`` registry.

Who writes what: the Celery intake adds a job; the engine thread alone fills in what the
engine produced (text, offsets, ``in_engine``, ``finished``, ``relegated``); the outbox's I/O
thread removes a job once its last write is durable. The heartbeat reads the leases to renew them.
The engine knows each attempt by its own request id (``Lease.request_id``: the job's id and the attempt), and its
outputs are mapped back through it (``serving``). The engine thread sets aside (``abandon``) an attempt whose abort
the engine has not confirmed: one never confirmed for a lease, one given back after an engine error, an earlier one
that a rerun of the job replaces here. It no longer counts against the worker's room nor holds the job: a rerun is
added beside it at once, and its late outputs, naming an attempt no longer served, write nothing. Its request id
stays listed (``abandoned_ids``) until the engine lets it go, so that an engine that keeps aborted requests is
noticed (``workers.engine_thread``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime

from app.reasoning import ReasoningTokens
from gpu_runtime.request import Request
from workers.lease import Lease
from workers.resume import Resumed


@dataclass
class ActiveJob:
    lease: Lease
    request: Request | None
    created_at: datetime | None
    text: list[str] = field(default_factory=list)  # engine thread: what it produced so far
    logprobs: list[dict] = field(default_factory=list)  # engine thread: its tokens' logprobs, where it asked
    prompt_logprobs: list[dict] | None = None  # engine thread: its prompt's, where it asked (the first report)
    produced: int = 0  # engine thread: characters streamed so far, the next delta's offset
    tokens: int = 0  # engine thread: token ids streamed so far, the next delta's ``token_offset``
    first_token_recorded: bool = False
    last_token_at: float | None = None  # engine thread: when a step last gave it tokens (``time.monotonic``)
    in_engine: bool = False  # engine thread: its add was applied
    abort_sent_at: float | None = None  # engine thread: when its abort went to the engine (``time.monotonic``)
    finished: bool = False  # engine thread: its last record is in the outbox
    relegated: bool = False  # engine thread (``ActiveJobs.set_relegated``): shed under overload, not resumed yet
    reasoning: ReasoningTokens | None = None  # engine thread: counts its thinking tokens (a reasoning parser's job)
    resumed: Resumed | None = None  # a rerun that goes on from an earlier attempt's tokens (``workers.resume``)

    def __post_init__(self) -> None:
        if self.resumed is not None:  # those tokens are this attempt's first: its text, ids, logprobs begin with them
            r = self.resumed
            self.text, self.produced, self.tokens = [r.text], len(r.text), len(r.token_ids)
            self.logprobs = list(r.logprobs)
            if self.reasoning is not None:
                self.reasoning.feed(r.text, len(r.token_ids))

    @property
    def job_id(self) -> str:
        return self.lease.job_id

    @property
    def request_id(self) -> str:
        """The engine's id of this attempt's request (``Lease.request_id``, as the worker names the requests it
        makes; the lease's where there is no request)."""
        return self.request.request_id if self.request is not None else self.lease.request_id

    @property
    def output_token_ids(self) -> list[int]:
        """Every token id this attempt's output holds: those it went on from, then the engine's."""
        before = list(self.resumed.token_ids) if self.resumed is not None else []
        return before + list(self.request.output_token_ids)


class ActiveJobs:
    """A lock-guarded map job id -> the ActiveJob of the attempt this worker serves; ``lock`` also orders intake
    against aborts."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._jobs: dict[str, ActiveJob] = {}
        self._requests: dict[str, ActiveJob] = {}  # the same jobs by their engine request id (``serving``)
        self._relegated = 0  # how many of them are relegated
        # engine request id -> an attempt set aside (``abandon``): not served, but the engine may still hold it
        self._abandoned: dict[str, ActiveJob] = {}

    def add(self, job: ActiveJob) -> None:
        with self.lock:
            self._jobs[job.job_id] = job
            self._requests[job.request_id] = job

    def get(self, job_id: str) -> ActiveJob | None:
        return self._jobs.get(job_id)

    def serving(self, request_id: str) -> ActiveJob | None:
        """The attempt the engine's ``request_id`` names, while this worker serves it (None: an attempt set aside or
        gone; what the engine says of it is not this worker's to write)."""
        return self._requests.get(request_id)

    def pop(self, job_id: str, attempt: int | None = None) -> ActiveJob | None:
        """Removes the job (where ``attempt`` is given: only while it is that attempt of the job)."""
        with self.lock:
            if attempt is not None and (held := self._jobs.get(job_id)) is not None and held.lease.attempt != attempt:
                return None
            job = self._jobs.pop(job_id, None)
            if job is not None and self._requests.get(job.request_id) is job:
                del self._requests[job.request_id]
            if job is not None and job.relegated:
                self._relegated -= 1
            return job

    def abandon(self, job: ActiveJob) -> None:
        """Stops serving ``job``, an attempt whose abort the engine has not confirmed: it no longer counts nor holds
        its job (a rerun is added beside it), while its request id stays listed until the engine lets it go."""
        with self.lock:
            if self._jobs.get(job.job_id) is job:
                self.pop(job.job_id)
            self._abandoned[job.request_id] = job

    def forget(self, request_id: str) -> ActiveJob | None:
        """Lets go of an abandoned attempt: its engine finished the request at last, or no longer holds it."""
        with self.lock:
            return self._abandoned.pop(request_id, None)

    def abandoned(self) -> list[ActiveJob]:
        """The attempts set aside, whose request the engine may still hold."""
        with self.lock:
            return list(self._abandoned.values())

    def abandoned_ids(self) -> list[str]:
        """Their engine request ids."""
        with self.lock:
            return list(self._abandoned)

    @property
    def set_aside(self) -> int:
        """How many attempts are set aside (``abandon``): not served, the engine may still hold their requests."""
        return len(self._abandoned)

    def take_all(self) -> list[ActiveJob]:
        with self.lock:
            jobs, self._jobs, self._relegated = list(self._jobs.values()), {}, 0
            self._requests = {}
        return jobs

    def set_relegated(self, job: ActiveJob, relegated: bool) -> None:
        with self.lock:
            if job.relegated != relegated and self._jobs.get(job.job_id) is job:
                job.relegated = relegated
                self._relegated += 1 if relegated else -1

    @property
    def relegated(self) -> int:
        return self._relegated

    @property
    def in_line(self) -> int:
        """The jobs the engine serves in line: relegated ones (shed, waiting for spare capacity) left out."""
        return len(self._jobs) - self._relegated

    def snapshot(self) -> list[ActiveJob]:
        with self.lock:
            return list(self._jobs.values())

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def snapshot_ids(self) -> list[str]:
        with self.lock:
            return list(self._jobs)
