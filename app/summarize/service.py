"""Server-side summarization runs: created here, kept in SQL, advanced by any process.

``create_run`` answers the request at once: it writes the run (``validating``) and its
documents after the checks that need no tokenizer; ``RunDrivers.drive`` then advances it
from the API process (``driver.advance``) for latency, off the request: the first step
splits the documents and writes the first level's jobs (runnable from one commit), or ends the run
``failed`` naming why (nothing half-made is left). Every worker's sweeper advances open runs
too (``driver.advance_open_runs``), under the same lease, so a run finishes when this process
dies. Runs written by older
versions as ``data_dir/summaries/<id>.json`` are still read.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from sqlalchemy import select

from app.auth import Principal
from app.db.models import SummarizationRun, new_id
from app.db.session import session_scope, write_guard
from app.schemas import JobCreate
from app.services import jobs as job_service
from app.services.idempotency import Idempotency, created_once, keyed_row
from app.services.workers import held_context_length
from app.services.transitions import utcnow
from app.settings import Settings
from app.summarize import driver, store
from app.summarize.limits import check_least_jobs, check_shrinks
from app.summarize.documents import Document
from app.summarize.pipeline import DocState, Progress
from app.summarize.store import OPEN, VALIDATING

log = logging.getLogger(__name__)

PROMPT_OVERHEAD_TOKENS = 64  # instruction + chat template around a chunk
MIN_CHUNK_TOKENS = 32  # the least text a chunk holds
POLL_S = 0.5
MAX_DRIVE_ERRORS = 20  # in a row: this process stops driving the run; the workers' sweeper goes on


class SqlBackend:
    """A ``JobBackend`` that submits each job at once with ``submit_job`` (scripts, tests); runs
    of the service build their jobs inside a step's transaction instead (``driver.JobCollector``). Its prompts are
    counted as the service's are: ``count`` (``driver.prompt_counter``) measures a level's together, and a job
    submitted without its count is measured the same way."""

    def __init__(self, settings: Settings, principal: Principal, tier: str | None) -> None:
        self.settings, self.principal, self.tier = settings, principal, tier
        self.count = driver.prompt_counter(settings, lambda: None)  # ``SummarizeRun.step(count=...)``

    def submit(self, messages, max_tokens: int, deadline_at: datetime, app_id: str,
               prompt_tokens: int | None = None) -> str:
        spec = JobCreate(kind="batch", messages=messages, max_tokens=max_tokens, deadline_at=deadline_at,
                         temperature=0.0, app_id=app_id, tier=self.tier)
        if prompt_tokens is None:
            prompt_tokens = self.count([messages])[0]
        with session_scope(self.settings.sqlalchemy_url) as s:
            return job_service.submit_job(s, self.principal, spec, self.settings, endpoint="/v1/summarize",
                                          overdue_ok=True, prompt_tokens=prompt_tokens).job.id

    def poll(self, job_ids):
        with session_scope(self.settings.sqlalchemy_url) as s:
            return store.job_results(s, list(job_ids))


def chunk_room(context: int, max_summary_tokens: int) -> int:
    """The tokens of a chunk's text that fit in the model's ``context`` beside a summary and the prompt around it."""
    return context - max_summary_tokens - PROMPT_OVERHEAD_TOKENS


def run_chunks(context: int, chunk_tokens: int, overlap_tokens: int, max_summary_tokens: int) -> tuple[int, int]:
    """A run's chunk and overlap tokens: the ones asked for, the chunk cut to ``chunk_room`` and the overlap to a
    quarter of the chunk."""
    budget = min(chunk_tokens, chunk_room(context, max_summary_tokens))
    return budget, min(overlap_tokens, budget // 4)


def summaries_fit(context: int, chunk_tokens: int, overlap_tokens: int, max_summary_tokens: int) -> bool:
    budget, overlap = run_chunks(context, chunk_tokens, overlap_tokens, max_summary_tokens)
    return budget >= MIN_CHUNK_TOKENS and max_summary_tokens <= (budget - overlap) // 2


def check_context(context: int, chunk_tokens: int, overlap_tokens: int, max_summary_tokens: int) -> None:
    """Refuses summaries too long for the model's context to leave a chunk of ``chunk_tokens`` room to shrink, naming
    the longest that fits: a larger chunk_tokens cannot help (``limits.check_shrinks`` judges the others)."""
    room = chunk_room(context, max_summary_tokens)
    if room >= chunk_tokens or summaries_fit(context, chunk_tokens, overlap_tokens, max_summary_tokens):
        return
    longest = next((m for m in range(max_summary_tokens - 1, 0, -1)
                    if summaries_fit(context, chunk_tokens, overlap_tokens, m)), 0)
    fix = f"give max_summary_tokens <= {longest}" if longest else "this model's context is too small to summarize in"
    raise job_service.JobValidationError(
        f"max_summary_tokens={max_summary_tokens} leaves {max(room, 0)} tokens of the model's {context}-token context "
        f"for a chunk's text (less {PROMPT_OVERHEAD_TOKENS} for the prompt), not chunk_tokens={chunk_tokens}, and a "
        f"summary may take at most half of a chunk's new text to shrink from level to level: {fix}",
        param="max_summary_tokens")


def create_run(settings: Settings, principal: Principal, documents: list[Document], deadline_at: datetime, *,
               max_summary_tokens: int, chunk_tokens: int, overlap_tokens: int, tier: str,
               model: str | None = None, idempotency: Idempotency | None = None,
               charge: Callable[[], object] | None = None) -> Progress:
    """Writes the run as ``validating`` with its documents, unsplit, after the checks that need no tokenizer (what
    the request answers); its first step (``driver``) splits them, checks the levels and the job count
    (``limits``) and writes the first level's jobs, or ends the run ``failed`` naming why. ``model``: the server's
    model (None) or one of its LoRA adapters, which every job of the run names; ``idempotency``: the run is kept
    under the request's Idempotency-Key (the insert fails where the tenant has a run under that key already:
    ``start_idempotent_run`` answers that one); ``charge``: takes the request from its tenant's rate limits once the
    run's row is in, in its transaction (raising ``RateLimited`` writes nothing), so neither a start the checks
    refuse nor a concurrent retry under its Idempotency-Key, which finds the row there, is charged."""
    context = held_context_length(settings)
    check_context(context, chunk_tokens, overlap_tokens, max_summary_tokens)
    budget, overlap = run_chunks(context, chunk_tokens, overlap_tokens, max_summary_tokens)
    check_shrinks(max_summary_tokens, budget, overlap, asked_overlap=overlap_tokens)
    check_least_jobs([d.text for d in documents], settings.summarize_max_jobs, budget)
    run = SummarizationRun(
        idempotency_key=idempotency.key if idempotency else None,
        request_digest=idempotency.digest if idempotency else None,
        id=new_id("sum"), tenant_id=principal.tenant_id, api_key_id=principal.key_id or None,
        model=model or settings.model_name, tier=tier, status=VALIDATING, deadline_at=deadline_at,
        max_summary_tokens=max_summary_tokens, chunk_tokens=budget, overlap_tokens=overlap,
        documents=len(documents), documents_done=0, documents_failed=0, jobs_submitted=0, jobs_done=0, version=0,
        created_at=utcnow())
    with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
        s.add(run)
        s.flush()  # the run before the rows that name it
        if charge is not None:
            charge()
        s.add_all(store.new_document(run.id, i, DocState(d.id, text=d.text)) for i, d in enumerate(documents))
    return store.progress_of(run)


def start_run(settings: Settings, principal: Principal, documents: list[Document], deadline_at: datetime,
              **options) -> Progress:
    """``create_run`` and its first step here, at once (scripts, tests): the run is ``running`` with its first
    level's jobs written, or ``failed``."""
    progress = create_run(settings, principal, documents, deadline_at, **options)
    driver.advance(settings, progress.id, f"start-{socket.gethostname()}-{os.getpid()}")
    return view(settings, progress.id).progress


def start_idempotent_run(settings: Settings, principal: Principal, idempotency: Idempotency,
                         start: Callable[[], Progress]) -> tuple[Progress, bool]:
    """The tenant's run under ``idempotency.key`` (created: False), or the one ``start`` makes with it (True);
    ``IdempotencyConflict`` where the key named a different request."""
    return created_once(lambda: _run_by_key(settings, principal.tenant_id, idempotency), start)


def _run_by_key(settings: Settings, tenant_id: str, idempotency: Idempotency) -> Progress | None:
    with session_scope(settings.sqlalchemy_url) as s:
        run = keyed_row(s, SummarizationRun, tenant_id, idempotency, "summarization")
        return store.progress_of(run, s) if run is not None else None  # its jobs ended up to now, as a poll


class RunDrivers:
    """The threads an API process advances the runs it started from, for latency (the workers' sweeper advances
    every open run too, every ``sweep_seconds``, and alone once this process is gone). ``close`` stops them with the
    app: a thread ends after the step it is in, so no step of a stopped app writes or sends afterwards."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def drive(self, settings: Settings, run_id: str) -> threading.Thread:
        owner = f"api-{socket.gethostname()}-{os.getpid()}"
        thread = threading.Thread(target=self._drive, args=(settings, run_id, owner), name=f"summarize-{run_id}",
                                  daemon=True)
        with self._lock:
            if self._stop.is_set():  # a request that raced the app's shutdown: the sweeper carries its run
                return thread
            self._threads.add(thread)
        thread.start()
        return thread

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop.set()
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _drive(self, settings: Settings, run_id: str, owner: str) -> None:
        try:
            _drive(settings, run_id, owner, self._stop)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())


def _drive(settings: Settings, run_id: str, owner: str, stop: threading.Event) -> None:
    errors, memo = 0, driver.LookMemo()
    while errors < MAX_DRIVE_ERRORS:
        if stop.wait(POLL_S):
            return
        try:
            step = driver.advance(settings, run_id, owner, memo=memo)
        except Exception:
            errors += 1
            log.warning("could not advance summarization %s (%d in a row)", run_id, errors, exc_info=True)
            continue
        errors = 0
        if step.status not in OPEN:
            return
    log.warning("stopped driving summarization %s here; the workers' sweeper carries it on", run_id)


def cancel(settings: Settings, run_id: str, reason: driver.CancelReason = driver.BY_REQUEST) -> bool:
    """``driver.cancel`` from this process (``driver.RunBusy`` where the run stayed busy)."""
    return driver.cancel(settings, run_id, f"cancel-{socket.gethostname()}-{os.getpid()}", reason)


def cancel_tenant_runs(settings: Settings, tenant_id: str) -> int:
    """Cancels a disabled tenant's running runs (each naming why); returns how many. A run being stepped meanwhile
    is left to the next step, which finds its tenant disabled and cancels it alike."""
    with session_scope(settings.sqlalchemy_url) as s:
        ids = s.scalars(select(SummarizationRun.id).where(SummarizationRun.tenant_id == tenant_id,
                                                          SummarizationRun.status.in_(OPEN))).all()
    owner, cancelled = f"disable-{socket.gethostname()}-{os.getpid()}", 0
    for run_id in ids:
        try:
            cancelled += driver.cancel(settings, run_id, owner, driver.TENANT_DISABLED)
        except driver.RunBusy:
            log.warning("summarization %s stayed busy; its next step cancels it", run_id)
    return cancelled


def view(settings: Settings, run_id: str, with_results: bool = False) -> store.RunView | None:
    """The run from SQL, or from the files of a run an older version wrote."""
    return store.view(settings.sqlalchemy_url, run_id, with_results) or _legacy_view(settings.data_dir, run_id)


def _legacy_view(data_dir: Path, run_id: str) -> store.RunView | None:
    folder = Path(data_dir) / "summaries"
    state_file, results_file = folder / f"{run_id}.json", folder / f"{run_id}.jsonl"
    if "/" in run_id or not state_file.exists():
        return None
    state = json.loads(state_file.read_text())
    progress = Progress(state["id"], state["status"], datetime.fromisoformat(state["deadline_at"]), state["documents"],
                        state["documents_done"], state["documents_failed"], state["jobs_submitted"],
                        state["jobs_done"])
    results = results_file.read_bytes() if results_file.exists() else None
    return store.RunView(state["tenant_id"], progress, results)
