"""Prefix-aware routing: which of a model's workers takes a job (SGLang's cache-aware router and the vLLM production
stack's prefix-aware routing, on Celery queues).

Each worker keeps the prompts it served in its engine's prefix cache, so a conversation's next turn is cheapest on
the worker that ran the turn before. A job's ``route_key`` names what its prompt opens with: the request's
``prompt_cache_key`` (OpenAI's field for this), else a chat's messages up to its first user message (a
conversation's turns share them, and requests that share only a system prompt spread), else the first characters
of a raw prompt. Rendezvous hashing maps a key to one live worker, and a worker that comes or goes moves only its
own keys. That worker gets the job on its own queue unless it holds more than ``slack`` jobs above the least loaded
worker, which then gets it. A job without a key, or with no live worker in sight, goes on the model's shared queue,
as every job did before.

A process reads the live workers that take jobs (heartbeat, jobs held; neither draining nor stopping, and reading
their own queue) from SQL at most once per ``REFRESH_S`` and adds the jobs it sent each worker since that worker's
heartbeat; a send to a worker's queue checks that worker against a view that fresh (``at_send``). A worker silent for
``live_seconds`` (three heartbeats and a second, not a lease: a job routed to a dead worker waits that long) is lost:
no job is routed to it, and the sweeper gives its queue back to the model's queue (``workers.sweeper``), which a
worker that was only slow reads too. A send to a worker's queue names it to the
sweepers again (``app.services.dispatch``), so a job routed by a view older than the sweeper's is not left on a
queue no one looks after.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from app.db.models import WorkerState
from app.db.session import session_scope
from app.services import lora_adapters
from app.services.transitions import as_utc, utcnow
from app.settings import Settings
from workers.celery_app import queue_name

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # how long a process trusts what it read of the workers
PROMPT_CHARS = 1024  # a raw prompt's key: its opening (about 256 tokens)
PROMPT_IDS = 256  # the same for a prompt given as token ids
WORKER_QUEUE_PREFIX = "coserve.worker."
WORKER_QUEUES = "coserve:worker-queues"  # a Redis set: every worker's own queue, for the sweeper to look after
LIVE_HEARTBEATS = 3  # heartbeat periods (and a second) after which a silent worker is lost


def live_seconds(settings: Settings) -> float:
    """How long after its last heartbeat a worker is live: routed to, its own queue its own (three heartbeat periods
    and a second; its leases last longer, ``lease_seconds``, and lapse by their own rules)."""
    return LIVE_HEARTBEATS * settings.heartbeat_seconds + 1


def worker_queue(worker_id: str) -> str:
    """The queue only ``worker_id`` consumes."""
    return WORKER_QUEUE_PREFIX + worker_id


def route_key(tenant_id: str, model: str, *, prompt_cache_key: str | None = None,
              messages: list[dict[str, Any]] | None = None, prompt: str | None = None,
              prompt_token_ids: list[int] | None = None) -> str | None:
    """The job's key (16 hex digits), or None where its prompt names nothing to route by. The tenant is part of it:
    a prefix cache shared only within a tenant (``COSERVE_PREFIX_CACHE``) is no reason to meet another's."""
    if prompt_cache_key:
        basis: Any = ["key", prompt_cache_key]
    elif messages:
        first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages) - 1)
        basis = ["chat", [[m.get("role"), m.get("content")] for m in messages[:first_user + 1]]]
    elif prompt_token_ids:
        basis = ["ids", prompt_token_ids[:PROMPT_IDS]]
    elif prompt:
        basis = ["text", prompt[:PROMPT_CHARS]]
    else:
        return None
    text = json.dumps([tenant_id, model, basis], separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _weight(key: str, worker_id: str) -> bytes:
    return hashlib.blake2b(f"{key}|{worker_id}".encode(), digest_size=8).digest()


@dataclass(frozen=True)
class Candidate:
    id: str
    load: int  # the jobs it serves in line (relegated ones left out)
    capacity: int  # the most it takes in line (COSERVE_MAX_INFLIGHT): a fuller one leaves a job's message waiting

    @property
    def has_room(self) -> bool:
        return self.load < self.capacity


def choose(key: str, candidates: list[Candidate], slack: int) -> str | None:
    """The worker for ``key``: its rendezvous (highest-random-weight) worker, unless that one is full or holds more
    than ``slack`` jobs above the least loaded, which then takes it; None (the shared queue) where none has room."""
    open_ = [c for c in candidates if c.has_room]
    if not open_:
        return None
    home = max(candidates, key=lambda c: _weight(key, c.id))
    least = min(open_, key=lambda c: (c.load, c.id))
    return home.id if home.has_room and home.load <= least.load + slack else least.id


@dataclass
class _Worker:
    id: str
    served: tuple[str, ...]
    held: int  # jobs it served in line at its heartbeat
    capacity: int
    batch_capacity: int  # the most in line at which it takes a batch job (its cap less its interactive reserve)
    heartbeat_at: datetime


class Router:
    """One process's routing: the live workers it last read, and the jobs it sent each since their heartbeat."""

    def __init__(self, url: str, live_s: float, slack: int) -> None:
        self.url, self.live_s, self.slack = url, live_s, slack
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        # model -> the grammar_backend of each live worker of it that takes jobs (``grammar_backends_of``)
        self._grammar_backends: dict[str, list[str | None]] = {}
        # model -> worker id -> why its engine's backend cannot run (``grammar_unavailable_of``)
        self._grammar_unavailable: dict[str, dict[str, str]] = {}
        self._contexts: dict[str, int | None] = {}  # model -> the least context its live workers serve
        self._read_at = float("-inf")
        self._sent: dict[str, deque[datetime]] = defaultdict(deque)  # worker -> when this process sent it a job

    def queue(self, model: str, key: str | None, batch: bool = False) -> str:
        """The queue a job of ``model`` (the model whose workers serve it) with ``key`` goes on; a ``batch`` job's
        worker has room while it holds fewer than its cap less its interactive reserve (``workers.room``)."""
        if key is None:
            return queue_name(model)
        with self._lock:
            workers = [w for w in self._live() if model in w.served]
            candidates = [Candidate(w.id, w.held + self._since(w), w.batch_capacity if batch else w.capacity)
                          for w in workers]
            chosen = choose(key, candidates, self.slack)
            if chosen is None:
                return queue_name(model)
            self._sent[chosen].append(utcnow())
            return worker_queue(chosen)

    def confirmed(self, model: str, queue: str) -> str:
        """``queue`` (this router's pick for a job of ``model``) at the job's send: a worker's own queue while the
        view, re-read where older than ``REFRESH_S``, still shows that worker routable; else ``model``'s queue."""
        worker_id = queue.removeprefix(WORKER_QUEUE_PREFIX)
        with self._lock:
            if any(w.id == worker_id and model in w.served for w in self._live()):
                return queue
        return queue_name(model)

    def served_context(self, model: str) -> int | None:
        """The least context a live worker of ``model`` that takes jobs serves, whether it reads its own queue or its
        model's (``served_context_of``; None: none says)."""
        with self._lock:
            self._live()
            return self._contexts.get(model)

    def grammar_backends(self, model: str) -> list[str | None]:
        """The structured-output backend each live worker of ``model`` that takes jobs says its engine compiles with
        (its heartbeat's ``grammar_backend``; None: it says none), whether it reads its own queue or its model's."""
        with self._lock:
            self._live()
            return list(self._grammar_backends.get(model, []))

    def grammar_unavailable(self, model: str) -> dict[str, str]:
        """Worker id -> why its engine cannot run a structured output, for each live worker of ``model`` that takes
        jobs and says so (``grammar_unavailable_of``)."""
        with self._lock:
            self._live()
            return dict(self._grammar_unavailable.get(model, {}))

    def _since(self, worker: _Worker) -> int:
        """The jobs this process sent ``worker`` after its last heartbeat (which did not count them yet)."""
        sent = self._sent[worker.id]
        while sent and sent[0] < worker.heartbeat_at:
            sent.popleft()
        return len(sent)

    def _live(self) -> list[_Worker]:
        if time.monotonic() - self._read_at >= REFRESH_S:
            self._read_at = time.monotonic()
            since = utcnow() - timedelta(seconds=self.live_s)
            with session_scope(self.url) as s:
                rows = s.execute(select(WorkerState).where(WorkerState.heartbeat_at >= since,
                                                           WorkerState.draining.is_(False))).scalars().all()
                self._workers = routable(rows)
                models = {m for r in rows for m in r.served}
                self._grammar_backends = {model: grammar_backends_of(rows, model) for model in models}
                self._grammar_unavailable = {model: grammar_unavailable_of(rows, model) for model in models}
                self._contexts = {model: served_context_of(rows, model) for model in models}
            for gone in set(self._sent) - {w.id for w in self._workers}:
                del self._sent[gone]
        return self._workers


def stopping(state: dict[str, Any] | None) -> bool:
    """Whether a worker's heartbeat state says it stops (a warm shutdown's grace, an engine given up on): its consumer
    takes nothing more, though it beats, and looks live, until its running jobs end."""
    return bool((state or {}).get("stopping"))


def reads_own_queue(state: dict[str, Any] | None) -> bool:
    """Whether a worker's heartbeat state says it reads its own queue (it routes by prefix too; one started with
    ``COSERVE_ROUTING=queue`` reads its model's only). An older worker does not say: it did, where routed to."""
    return bool((state or {}).get("own_queue", True))


def routable(rows: list[WorkerState]) -> list[_Worker]:
    """The workers among ``rows`` (live, not draining) a job may be routed to: those not stopping that read their own
    queue."""
    return [_Worker(r.id, r.served, *_load(r.state or {}), as_utc(r.heartbeat_at))
            for r in rows if not stopping(r.state) and reads_own_queue(r.state)]


def taking_jobs(rows: list[WorkerState], model: str) -> list[WorkerState]:
    """The workers among ``rows`` (live, not draining) of ``model`` that take jobs: not stopping, whether they read
    their own queue or only their model's (``COSERVE_ROUTING=queue``): a job may go to any of them."""
    return [r for r in rows if model in r.served and not stopping(r.state)]


def grammar_backends_of(rows: list[WorkerState], model: str) -> list[str | None]:
    """The structured-output backend each worker of ``model`` that takes jobs (``taking_jobs``) says its engine
    compiles with (``grammar_backend``); None for one that says none (an older worker, the own engine) or whose
    backend cannot run (``grammar_unavailable``: it compiles nothing, and ``grammar_unavailable_of`` says why)."""
    return [backend if isinstance(backend := (r.state or {}).get("grammar_backend"), str)
            and not grammar_unavailable(r.state) else None for r in taking_jobs(rows, model)]


def grammar_unavailable(state: dict[str, Any] | None) -> str | None:
    """Why a worker's heartbeat state says its engine's structured-output backend cannot run (the one the operator
    named, which vLLM cannot make: ``gpu_runtime.vllm.scheduler.pin_grammar_backend``); None: it runs, or an older
    worker that does not say."""
    why = (state or {}).get("grammar_unavailable")
    return why if isinstance(why, str) and why else None


def grammar_unavailable_of(rows: list[WorkerState], model: str) -> dict[str, str]:
    """Worker id -> why its backend cannot run (``grammar_unavailable``), for each worker of ``model`` that takes
    jobs (``taking_jobs``) and says so."""
    return {r.id: why for r in taking_jobs(rows, model) if (why := grammar_unavailable(r.state)) is not None}


def served_context_of(rows: list[WorkerState], model: str) -> int | None:
    """The least context a worker of ``model`` that takes jobs (``taking_jobs``) says its engine serves (None: none
    says): a job longer than one of them can run must be refused, as any may take it."""
    return min((n for r in taking_jobs(rows, model) if (n := advertised_context(r.state)) is not None), default=None)


def _load(state: dict[str, Any]) -> tuple[int, int, int]:
    """(jobs in line, capacity, capacity for batch jobs) from a worker's heartbeat state (an older worker's: its
    jobs, no cap; one without an interactive reserve: its cap for both). The jobs routed to it and not taken yet are
    in line too: it takes them before any from the shared queue, so a worker they fill is full."""
    capacity = int(state.get("max_inflight") or 2**31)
    in_line = int(state.get("in_line", state.get("active_jobs")) or 0) + int(state.get("routed_waiting") or 0)
    return in_line, capacity, int(state.get("batch_room") or capacity)


def advertised_context(state: dict[str, Any] | None) -> int | None:
    """The context a worker's heartbeat state says its engine serves (None: not said)."""
    n = (state or {}).get("context_length")
    return n if isinstance(n, int) else None


_routers: dict[tuple[str, float, int], Router] = {}
_routers_lock = threading.Lock()


def router(url: str, live_s: float, slack: int) -> Router:
    """The process's router for the database at ``url``."""
    with _routers_lock:
        return _routers.setdefault((url, live_s, slack), Router(url, live_s, slack))


def settings_router(settings: Settings) -> Router:
    """The process's router for ``settings``: live as the sweepers judge (``live_seconds``: older, a worker's own queue
    goes to its model's)."""
    return router(settings.sqlalchemy_url, live_seconds(settings), settings.routing_slack)


def at_send(settings: Settings, model: str, queue: str) -> str:
    """The queue a job of ``model`` that ``job_queue`` sent to ``queue`` goes on at its send. A stopping worker passes
    on what its own queue got until the views read before it stopped are stale (``REFRESH_S``); a send later than that
    after its view (an API slow in between: a slow commit) would land on that queue after it, to wait for another
    worker's sweep or, with none, for a start. So a worker's own queue stands only while the worker is routable by a
    view that fresh (re-read if older); else the job goes on its model's queue."""
    if not queue.startswith(WORKER_QUEUE_PREFIX):
        return queue
    try:
        base = lora_adapters.queue_model(settings, model)
        return settings_router(settings).confirmed(base, queue)
    except Exception:  # SQL unreadable: the pick stands (the send names the queue to the sweepers)
        log.warning("could not re-read the workers before a send to %s; sending it there", queue, exc_info=True)
        return queue


def job_queue(settings: Settings, model: str, key: str | None, kind: str = "interactive") -> str:
    """The queue a new job of ``kind`` for ``model`` (a model, or an adapter of one) with ``route_key`` ``key``
    goes on."""
    base = lora_adapters.queue_model(settings, model)  # a runtime adapter's jobs: any worker of its model
    if settings.routing != "prefix" or key is None:
        return queue_name(base)
    return settings_router(settings).queue(base, key, batch=kind == "batch")
