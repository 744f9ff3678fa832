"""The durable driver: one step of a summarization run, taken by whichever process can.

``advance`` is safe to call from any number of processes at any time (the API that started
the run, for latency; every worker's sweeper, so a run finishes whatever process dies):

1. a read-only look: the run's version and which documents have all their jobs ended
   (nothing ready: return, no write);
2. a claim: a guarded UPDATE takes the run's lease if it is free or expired *and* the
   version is still the one read (so the look is current);
3. the step in memory (``pipeline.advance_doc``): collect the ready levels, build the next
   levels' jobs;
4. one transaction: the run row moves to version + 1 and drops the lease, guarded by
   (lease owner, version); the new jobs and the changed documents are written with it.
   A step whose lease was taken over meanwhile matches nothing and commits nothing. A step of
   many jobs (a large run's first) writes them ``staged`` first, ``store.STAGE_CHUNK`` a
   transaction while it holds the lease, so other writers get SQLite's lock between chunks;
   the commit makes them runnable, and deletes staged rows a dead or lost step left;
5. the new jobs are sent to the workers.

A run's first step (it is ``validating``: written by the request, its documents not split) splits every document
and checks what needs the split (``limits``: the levels end, the first level is at most
``COSERVE_SUMMARIZE_MAX_JOBS`` jobs); a run they refuse ends ``failed`` with no job written.

A step renews its lease while it goes on (``lease.LeaseKeeper``: every third of the lease, between documents, the
sentences a split measures and the jobs it builds), so a first step that splits for a minute holds a lease of
``lease_seconds``, and a run whose splitter died is taken over once that lapses. A renewal that finds the lease
taken over stops the step, which writes nothing.

A process killed anywhere leaves either the old version (its lease expires, another
process redoes the step) or the new one with its jobs in SQL (sent now, or by the
workers' sweeper). Jobs are never submitted twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import func, or_, select, update

from app.auth import Principal
from app.batch import queue_limit
from app.db.models import Job, JobStatus, SummarizationDocument, SummarizationRun, Tenant
from app.db.session import read_then_write, session_scope, write_guard
from app.schemas import JobCreate
from app.services import lora_adapters
from app.services.cancel import stop_job_ids
from app.services.dispatch import Sendable, send_dispatched
from app.services.job_writer import JobRows
from app.services.jobs import JobValidationError, job_values
from app.services.model_info import count_inputs, get_tokenizer
from app.services.transitions import as_utc, utcnow
from app.settings import Settings
from app.summarize import lease, store
from app.summarize.limits import check_depth, check_jobs
from app.summarize.pipeline import (TERMINAL, Advance, DocState, Planner, advance_doc, final_status,
                                    open_jobs)
from app.summarize.split import COUNT_BATCH, TokenSplitter

log = logging.getLogger(__name__)

ENDPOINT = "/v1/summarize"


class Outcome(StrEnum):
    IDLE = "idle"  # nothing ready (no job of a whole level ended), or the run is over
    BUSY = "busy"  # another process holds the run's lease, or stepped it since our look
    STEPPED = "stepped"  # collected, submitted, committed
    LOST = "lost"  # the lease was taken over mid-step: nothing committed (the new holder redoes it)


@dataclass(frozen=True)
class Step:
    outcome: Outcome
    status: str | None  # the run's status after the step; None for an unknown run
    submitted: tuple[str, ...] = ()  # ids of the jobs this step created


class JobCollector:
    """A ``JobBackend`` that builds jobs without writing them (the step's transaction does)
    and answers polls from results read before the step. A job is its column values (``jobs.job_values``), inserted
    as they are: no ORM ``Job`` per job, as the batch fan-out's."""

    def __init__(self, settings: Settings, principal: Principal, tier: str, results: dict[str, store.JobResult],
                 model: str | None = None, run_id: str | None = None):
        self.settings, self.principal, self.tier, self.results = settings, principal, tier, results
        self.model = model  # the run's: the server's model or a LoRA adapter
        self.run_id = run_id  # each job names it (a poll counts the run's jobs not ended by it)
        self.tick: Callable[[], None] = lambda: None  # called before each job is built (the step's lease.LeaseKeeper)
        self.jobs: list[dict[str, Any]] = []  # each job's column values

    def submit(self, messages: list[dict[str, str]], max_tokens: int, deadline_at: datetime, app_id: str,
               prompt_tokens: int | None = None) -> str:
        self.tick()
        spec = JobCreate(kind="batch", messages=messages, max_tokens=max_tokens, deadline_at=deadline_at,
                         temperature=0.0, app_id=app_id, tier=self.tier, model=self.model)
        # overdue_ok: a retried step may build a level whose deadline passed meanwhile
        job = job_values(self.settings, self.principal, spec, endpoint=ENDPOINT, overdue_ok=True,
                         prompt_tokens=prompt_tokens)
        job["summarization_run_id"] = self.run_id
        self.jobs.append(job)
        return job["id"]

    def poll(self, job_ids: list[str]) -> dict[str, store.JobResult]:
        return {j: self.results[j] for j in job_ids if j in self.results}


LATE_LEVEL_S = 60.0  # a level's jobs with less of the run's deadline left than this get a fresh window


def planner_for(settings: Settings, run: SummarizationRun, backend: JobCollector,
                deadline_at: datetime | None = None, tick: Callable[[], None] | None = None) -> Planner:
    """``deadline_at``: its jobs' (the run's where None); ``tick``: called as the split goes on (``TokenSplitter``)."""
    split = TokenSplitter(get_tokenizer(settings.model), run.chunk_tokens, run.overlap_tokens, tick)
    return Planner(backend, split, run.max_summary_tokens, deadline_at or as_utc(run.deadline_at), now=utcnow(),
                   job_retries=settings.summarize_job_retries, retry_backoff_s=settings.summarize_retry_backoff_s,
                   count=prompt_counter(settings, tick or (lambda: None)))


def prompt_counter(settings: Settings, tick: Callable[[], None]) -> Callable[[list[list[dict]]], list[int]]:
    """A level's prompts' token counts, ``COUNT_BATCH`` a tokenizer call (``tick`` before each): what ``build_job``
    would count for each (the worker's chat template), without tokenizing each job's prompt alone."""
    def count(conversations: list[list[dict]]) -> list[int]:
        counts: list[int] = []
        for i in range(0, len(conversations), COUNT_BATCH):
            tick()
            counts += count_inputs(settings.model, conversations[i:i + COUNT_BATCH])
        return counts

    return count


def later_level_deadline(settings: Settings, run_deadline: datetime) -> datetime:
    """A later level's jobs' deadline: the run's, or a fresh batch window (``default_batch_window_s``) where the run's
    has passed or is under ``LATE_LEVEL_S`` away. The run is late either way; jobs given no time were relegated under
    load and expired at once, failing their documents and the summaries earlier levels had made."""
    now = utcnow()
    if run_deadline - now >= timedelta(seconds=LATE_LEVEL_S):
        return run_deadline
    return now + timedelta(seconds=settings.default_batch_window_s)


def step_deadline(settings: Settings, run: SummarizationRun) -> datetime:
    """The deadline of the jobs a step of ``run`` builds: the first level's (a ``validating`` run's first step) is the
    run's as the user gave it, however short; a later level's is ``later_level_deadline``."""
    if run.status == store.VALIDATING:
        return as_utc(run.deadline_at)
    return later_level_deadline(settings, as_utc(run.deadline_at))


def collector_for(settings: Settings, run: SummarizationRun, results: dict[str, store.JobResult]) -> JobCollector:
    principal = Principal(key_id=run.api_key_id or "", tenant_id=run.tenant_id, tier=run.tier, is_admin=False)
    return JobCollector(settings, principal, run.tier, results, run.model, run.id)


@dataclass
class _Look:
    run: SummarizationRun
    ready: list[int] = field(default_factory=list)  # positions of documents with work to do
    waiting: int = 0  # jobs of the documents not ready not seen ended (the others' need not be read: an upper bound)
    tenant_disabled: bool = False


@dataclass
class LookMemo:
    """What a driver keeps between its looks at one run: a run's documents change only with its version, and an
    ended job stays ended, so a look reads the documents again only after a step and never re-reads an ended job."""

    version: int | None = None  # the run's version ``docs`` were read at
    docs: list = field(default_factory=list)  # its documents not done: (position, pending, retry_at) rows
    ended: set[str] = field(default_factory=set)  # jobs of those documents seen ended


def _ended(s, job_ids: list[str]) -> set[str]:
    return {j for j, status in store.job_statuses(s, job_ids).items() if status in TERMINAL}


def _look(url: str, run_id: str, memo: LookMemo | None = None) -> _Look | None:
    """The run and its documents that have work to do. A document is ready once every job it waits for ended, so
    a look reads one job per document, the first not seen ended, and the others of a document only once that one
    ended (a level's jobs end about together): a run of many chunks waiting reads one status per document, not
    one per job."""
    now, memo = utcnow(), memo if memo is not None else LookMemo()
    with session_scope(url) as s:
        run = s.get(SummarizationRun, run_id)
        if run is None:
            return None
        look = _Look(run)
        if run.status not in store.OPEN:
            return look
        look.tenant_disabled = bool(s.scalar(select(Tenant.disabled).where(Tenant.id == run.tenant_id)))
        if memo.version != run.version:  # a step or a cancel since the last look: read the documents again
            memo.docs = s.execute(select(SummarizationDocument.position, SummarizationDocument.pending,
                                         SummarizationDocument.retry_at).where(
                SummarizationDocument.run_id == run_id, SummarizationDocument.done.is_(False))).all()
            memo.version = run.version
            memo.ended &= {j for d in memo.docs for j in d.pending}
        first = {d.position: next((j for j in d.pending if j not in memo.ended), None) for d in memo.docs}
        memo.ended |= _ended(s, [j for j in first.values() if j is not None])
        memo.ended |= _ended(s, [j for d in memo.docs if first[d.position] in memo.ended
                                 for j in d.pending if j not in memo.ended])
        for d in memo.docs:
            still = sum(j not in memo.ended for j in d.pending)
            if still:
                look.waiting += still
            elif d.retry_at is None or as_utc(d.retry_at) <= now:  # not waiting out a retry's backoff
                look.ready.append(d.position)
        return look


def advance(settings: Settings, run_id: str, owner: str, *, lease_s: float | None = None,
            memo: LookMemo | None = None) -> Step:
    """One step of ``run_id`` if it has one to take and nobody else is taking it; ``memo``: what this caller's
    earlier looks at the run read (a driver that looks again and again passes its own)."""
    url = settings.sqlalchemy_url
    look = _look(url, run_id, memo)
    if look is None:
        return Step(Outcome.IDLE, None)
    run = look.run
    if run.status not in store.OPEN or not (look.ready or look.tenant_disabled):
        return Step(Outcome.IDLE, run.status)
    lease_s = lease_s if lease_s is not None else settings.lease_seconds  # renewed while the step goes on
    if not lease.claim(url, run, owner, lease_s):
        return Step(Outcome.BUSY, run.status)
    if look.tenant_disabled:  # the admin's disable did not end it (it stepped then, or that process died)
        return _cancel_claimed(settings, run, owner, TENANT_DISABLED)
    committed = False
    try:
        step = _step(settings, run, look.ready, look.waiting, owner, lease_s)
        committed = step.outcome == Outcome.STEPPED
        return step
    finally:
        if not committed:
            lease.release(url, run_id, owner)


def _step(settings: Settings, run: SummarizationRun, ready: list[int], waiting: int, owner: str,
          lease_s: float | None = None) -> Step:
    """The step once ``owner`` holds the run's lease (``lease_s`` long: ``lease_seconds`` where None), renewing it as
    it goes; LOST, nothing written, where it was taken over meanwhile."""
    url = settings.sqlalchemy_url
    keep = lease.LeaseKeeper(url, run, owner, lease_s if lease_s is not None else settings.lease_seconds)
    try:
        return _keep_stepping(settings, run, ready, waiting, owner, keep)
    except lease.LeaseLost:
        log.info("summarization %s: lease lost mid-step; stopped, nothing written", run.id)
        return Step(Outcome.LOST, "running")


def _keep_stepping(settings: Settings, run: SummarizationRun, ready: list[int], waiting: int, owner: str,
                   keep: lease.LeaseKeeper) -> Step:
    url = settings.sqlalchemy_url
    # the lease is ours and the version unchanged since the look: these rows are current
    with session_scope(url) as s:
        docs = store.documents(s, run.id, ready)
        results = store.job_results(s, [j for d in docs.values() for j in d.pending])
    backend = collector_for(settings, run, results)
    backend.tick = keep  # a document of thousands of chunks builds a job each (its prompt templated, counted)
    try:
        planner = planner_for(settings, run, backend, step_deadline(settings, run), keep)
    except Exception as exc:  # the pipeline itself failed (its model, its prompts): so does the run
        log.exception("summarization run %s failed", run.id)
        return _commit_failure(settings, run, owner, f"pipeline error: {exc}")
    moves = []
    for position, doc in docs.items():
        keep()
        moves.append(_advance_or_fail(run.id, position, doc, results, planner, backend))
    if run.status == store.VALIDATING:
        try:
            check_first_level(settings, run, list(docs.values()), len(backend.jobs))
        except JobValidationError as exc:  # the request could not tell: the run fails before any job is written
            log.info("summarization %s refused at its first step: %s", run.id, exc)
            return _commit_failure(settings, run, owner, str(exc))
    newly_done = sum(d.done for d in docs.values())
    newly_failed = sum(d.error is not None for d in docs.values())
    done, failed = run.documents_done + newly_done, run.documents_failed + newly_failed
    status = final_status(done - failed) if done == run.documents else "running"
    submitted = run.jobs_submitted + sum(m.submitted for m in moves)
    # ended: all but those the documents wait for (the others' as the look saw them: a view counts again)
    values = {"documents_done": done, "documents_failed": failed, "status": status, "jobs_submitted": submitted,
              "jobs_done": max(run.jobs_done, submitted - waiting - open_jobs(list(docs.values()), results))}
    if status == "failed":
        values["reason"] = "no document was summarized: each result line's error says why"
    dispatched_at = utcnow() if settings.redis_url else None
    rows = JobRows.of([(job, f"summarization {run.id}") for job in backend.jobs], dispatched_at)
    staged = store.stage_jobs(url, run, owner, rows, keep)  # all but the last chunk, a chunk at a time
    with read_then_write(url) as s:  # reads the tenant's queue, then writes: no other start commits in between
        refused = over_queue_limit(s, run, backend.jobs)
        committed = refused is None and _advance_version(s, run, owner, values)
        if committed:
            store.start_staged(s, run.id, staged,
                               JobStatus.DISPATCHED.value if dispatched_at else JobStatus.QUEUED.value)
            for position, doc in docs.items():
                s.execute(update(SummarizationDocument).where(SummarizationDocument.run_id == run.id,
                                                              SummarizationDocument.position == position)
                          .values(**store.doc_values(doc)).execution_options(synchronize_session=False))
        else:
            s.rollback()
    if refused is not None:  # as a batch past the limit fails validation: no job of it runs
        log.info("summarization %s refused at its first step: %s", run.id, refused)
        return _commit_failure(settings, run, owner, refused)
    if not committed:
        log.info("summarization %s: lease lost mid-step; %d built jobs dropped", run.id, len(backend.jobs))
        return Step(Outcome.LOST, "running")
    send_dispatched(settings, [Sendable.of(job) for job in backend.jobs])
    if status != "running":
        log.info("summarization %s %s: %d/%d documents, %d jobs", run.id, status, done - failed, run.documents,
                 values["jobs_submitted"])
    return Step(Outcome.STEPPED, status, tuple(j["id"] for j in backend.jobs))


def check_first_level(settings: Settings, run: SummarizationRun, docs: list[DocState], jobs: int) -> None:
    """The checks a run's first level needs its documents split for (``limits``); JobValidationError says why."""
    check_jobs(jobs, settings.summarize_max_jobs, run.chunk_tokens)
    check_depth(docs, run.chunk_tokens, run.overlap_tokens, run.max_summary_tokens)


def over_queue_limit(session, run: SummarizationRun, jobs: list[dict[str, Any]]) -> str | None:
    """Why a run's first level (``jobs``, their prompt tokens) does not fit in its tenant's batch queue limit, else
    None; a later level is never refused (``queue_limit``: a run let in runs to its end). Call it in the transaction
    that makes the jobs runnable."""
    if run.status != store.VALIDATING:
        return None
    tokens = sum(job.get("prompt_tokens") or 0 for job in jobs)
    refused = queue_limit.refusal(session, run.tenant_id, run.model, tokens, queue_limit.SUMMARIZATION)
    return f"{refused['code']}: {refused['message']}" if refused else None


def _advance_or_fail(run_id: str, position: int, doc: DocState, results: dict, planner: Planner,
                     backend: JobCollector) -> Advance:
    """``advance_doc``, where a failure (a split, a job it cannot build from this document's text) fails this
    document alone, and the jobs it built for it are not sent."""
    built = len(backend.jobs)
    try:
        return advance_doc(doc, results, planner)
    except lease.LeaseLost:
        raise
    except Exception as exc:
        log.exception("summarization %s: document %d failed", run_id, position)
        del backend.jobs[built:]
        doc.pending, doc.attempts, doc.retry_at, doc.error = [], [], None, f"pipeline error: {exc}"
        return Advance()


def _advance_version(s, run: SummarizationRun, owner: str, values: dict) -> bool:
    """Version + 1 and the lease dropped (unless ``values`` keeps it), only while ``owner`` holds it (the first
    write of the step)."""
    if values.get("status", "running") != "running":
        values = {**values, "finished_at": utcnow()}
    return s.execute(update(SummarizationRun).where(*lease.held(run, owner))
        .values({"version": run.version + 1, "lease_owner": None, "lease_expires_at": None} | values)
        .execution_options(synchronize_session=False)).rowcount == 1


# the error of each document not done of a run that failed as a whole: why is said once, in the run's ``reason``
# (a refusal's message is hundreds of characters; a run may have 10,000 documents), as a cancel's documents say
RUN_FAILED = "failed with its summarization run (its reason says why)"


def _commit_failure(settings: Settings, run: SummarizationRun, owner: str, error: str) -> Step:
    """Fails the run for ``error`` (its ``reason``) and every document not done yet (``RUN_FAILED``), and stops the
    jobs those waited for (as a cancel does: a failed run's jobs would run to their end on the GPU for nobody), its
    lease held meanwhile. A process that dies before they are all stopped leaves a failed run whose ``jobs_done`` is
    short of ``jobs_submitted``: a worker's sweeper stops the rest (``finish_cancels``)."""
    url = settings.sqlalchemy_url
    step = _end_run(url, run, owner, FAILED.during, RUN_FAILED, error, keep_lease_s=settings.lease_seconds)
    if step.outcome != Outcome.STEPPED:
        return step  # ``advance`` gives the lease back
    return _stop_or_release(settings, run.id, owner, FAILED)


def _end_run(url: str, run: SummarizationRun, owner: str, status: str, error: str, reason: str,
             keep_lease_s: float = 0) -> Step:
    """Ends the run as ``status`` for ``reason`` with every document not done yet failed with ``error``.
    ``keep_lease_s`` > 0: the documents keep naming the jobs they waited for and ``owner`` keeps the lease that
    long, to stop those jobs."""
    with session_scope(url, immediate=True) as s, write_guard(s):  # reads, then writes
        undone = s.scalar(select(func.count()).select_from(SummarizationDocument).where(
            SummarizationDocument.run_id == run.id, SummarizationDocument.done.is_(False)))
        values = {"status": status, "documents_done": run.documents, "documents_failed": run.documents_failed + undone,
                  "reason": reason, "jobs_done": run.jobs_submitted - store.open_job_count(s, run)}  # ended by now
        if keep_lease_s > 0:
            values |= {"lease_owner": owner, "lease_expires_at": utcnow() + timedelta(seconds=keep_lease_s)}
        if not _advance_version(s, run, owner, values):
            s.rollback()
            return Step(Outcome.LOST, "running")
        store.drop_staged(s, run.id)  # a first step that died (or was taken over) midway wrote them
        failed = {"error": error, "done": True, "retry_at": None} | ({} if keep_lease_s > 0 else {"pending": []})
        s.execute(update(SummarizationDocument).where(SummarizationDocument.run_id == run.id,
                                                      SummarizationDocument.done.is_(False))
                  .values(**failed).execution_options(synchronize_session=False))
    return Step(Outcome.STEPPED, status)


CANCEL_TRIES = 40  # a step holds the run's lease for milliseconds: a cancel waits out one (0.05 s a try)
# cancelled, and the jobs its documents waited for not all stopped yet: its documents still name them, and whoever
# holds its lease stops them (the cancel itself, or a worker's sweeper where the cancel died partway)
CANCELLING = "cancelling"


@dataclass(frozen=True)
class Ending:
    """How a run that ends stops the jobs its documents still wait for: its status while it stops them (its lease
    held, its documents naming them), its status once they are stopped, and the ``error`` each stopped job gets."""

    during: str
    after: str
    job_detail: str  # formatted with the run's id

    def detail(self, run_id: str) -> str:
        return self.job_detail.format(run_id=run_id)


CANCELLED = Ending(CANCELLING, "cancelled", "cancelled with summarization {run_id}")
FAILED = Ending("failed", "failed", "cancelled: summarization {run_id} failed, so its result is not needed")
ENDINGS = {e.during: e for e in (CANCELLED, FAILED)}


class RunBusy(Exception):
    """Another process kept stepping the run while a cancel waited for it."""


@dataclass(frozen=True)
class CancelReason:
    run: str  # the run's ``reason``
    document: str  # the ``error`` of each document not done


BY_REQUEST = CancelReason("cancelled by request", "cancelled with its summarization run")
TENANT_DISABLED = CancelReason("cancelled: its tenant was disabled by an admin", "cancelled: its tenant was disabled")
BY_ADMIN = CancelReason("cancelled by an admin", "cancelled by an admin with its summarization run")


def cancel(settings: Settings, run_id: str, owner: str, reason: CancelReason = BY_REQUEST) -> bool:
    """Ends a running run as ``cancelled``: the documents not done fail with ``reason.document``, the jobs they waited
    for are cancelled (running ones aborted), the summaries made so far stay. A run left ``cancelling`` (its cancel
    died partway) is finished (``_finish_cancel``; its ``reason`` stays the first cancel's). False where the run had
    ended (or is unknown)."""
    url = settings.sqlalchemy_url
    for _ in range(CANCEL_TRIES):
        with session_scope(url) as s:
            run = s.get(SummarizationRun, run_id)
        if run is not None and run.status == CANCELLING:  # a cancel that died partway: this one finishes it
            return _finish_cancel(settings, run, owner)
        if run is None or run.status not in store.OPEN:
            return False
        # a first step holds a validating run's lease while it splits (a minute for large runs); it has written
        # no job yet, so the cancel takes the lease over and the step, finding it gone, commits nothing
        claimed = (lease.take_over(url, run, owner, settings.lease_seconds) if run.status == store.VALIDATING
                   else lease.claim(url, run, owner, settings.lease_seconds))
        if claimed:
            if _cancel_claimed(settings, run, owner, reason).outcome == Outcome.STEPPED:
                return True
        time.sleep(0.05)
    raise RunBusy(run_id)


def _finish_cancel(settings: Settings, run: SummarizationRun, owner: str) -> bool:
    """Stops the jobs of a run left ``cancelling`` and ends it ``cancelled``, taking its lease over whoever holds it:
    stopping them again is harmless (a stopped job stays as it is), and a holder killed mid-cancel would keep the
    run ``cancelling`` until its lease expired. False where the run moved on meanwhile (another process ended it)."""
    url = settings.sqlalchemy_url
    if not lease.take_over(url, run, owner, settings.lease_seconds):
        return False
    _stop_or_release(settings, run.id, owner, CANCELLED)
    return True


def _cancel_claimed(settings: Settings, run: SummarizationRun, owner: str, reason: CancelReason) -> Step:
    """``cancel`` once ``owner`` holds the run's lease (its version as read); LOST (and the lease given back) where a
    step committed first."""
    url = settings.sqlalchemy_url
    step = _end_run(url, run, owner, CANCELLING, reason.document, reason.run, keep_lease_s=settings.lease_seconds)
    if step.outcome != Outcome.STEPPED:
        lease.release(url, run.id, owner)
        return step
    stopped = _stop_or_release(settings, run.id, owner, CANCELLED)
    return Step(Outcome.STEPPED, stopped.status)  # cancelled, or cancelling where another holder stops the rest


def _stop_or_release(settings: Settings, run_id: str, owner: str, ending: Ending) -> Step:
    """``_stop_pending_jobs``, the run's lease given back where it fails: a worker's sweeper stops the rest now, not
    when the lease expires."""
    try:
        return _stop_pending_jobs(settings, run_id, owner, ending)
    except Exception:
        lease.release(settings.sqlalchemy_url, run_id, owner)
        raise


def _stop_pending_jobs(settings: Settings, run_id: str, owner: str, ending: Ending) -> Step:
    """Stops the jobs the documents of a run ``ending.during`` still name and any other job of the run not ended,
    then the run is ``ending.after`` and they name none; ``owner`` holds its lease (a process that dies here leaves
    it so: the next holder stops them again, the ones already stopped staying as they are)."""
    url = settings.sqlalchemy_url
    with session_scope(url) as s:
        pending = s.scalars(select(SummarizationDocument.pending).where(SummarizationDocument.run_id == run_id)).all()
        still_open = s.scalars(select(Job.id).where(Job.summarization_run_id == run_id,
                                                    Job.status.in_(store.OPEN_JOB))).all()
        stop_job_ids(s, list(dict.fromkeys([j for ids in pending for j in ids] + still_open)), JobStatus.CANCELLED,
                     ending.detail(run_id), settings.redis_url)
    with session_scope(url) as s, write_guard(s):
        ended = s.execute(update(SummarizationRun).where(
            SummarizationRun.id == run_id, SummarizationRun.status == ending.during,
            SummarizationRun.lease_owner == owner)
            .values(status=ending.after, lease_owner=None, lease_expires_at=None,
                    jobs_done=SummarizationRun.jobs_submitted)  # each ended or stopped now
            .execution_options(synchronize_session=False)).rowcount == 1
        if not ended:  # another process took the lease over meanwhile: it ends the run
            s.rollback()
            return Step(Outcome.LOST, ending.during)
        s.execute(update(SummarizationDocument).where(SummarizationDocument.run_id == run_id)
                  .values(pending=[]).execution_options(synchronize_session=False))
    return Step(Outcome.STEPPED, ending.after)


def finish_cancels(settings: Settings, owner: str, limit: int = 100) -> list[Step]:
    """Stops the jobs of runs left ``cancelling`` by a cancel that died partway, and of failed runs whose
    ``jobs_done`` is short of ``jobs_submitted`` (``_commit_failure`` died before it stopped their jobs, or they
    failed before failing stopped them) (the workers' sweeper calls this through ``advance_open_runs``; any model's
    worker can: stopping a job needs no tokenizer)."""
    url, now = settings.sqlalchemy_url, utcnow()
    with session_scope(url) as s:
        runs = s.scalars(select(SummarizationRun).where(
            or_(SummarizationRun.status == CANCELLING, (SummarizationRun.status == FAILED.during)
                & (SummarizationRun.jobs_done < SummarizationRun.jobs_submitted)),
            or_(SummarizationRun.lease_owner.is_(None), SummarizationRun.lease_expires_at < now)).limit(limit)).all()
    steps = []
    for run in runs:
        try:
            if lease.claim(url, run, owner, settings.lease_seconds):
                steps.append(_stop_pending_jobs(settings, run.id, owner, ENDINGS[run.status]))
        except Exception:
            log.exception("could not stop the jobs of cancelled summarization %s", run.id)
    return steps


def advance_open_runs(settings: Settings, owner: str, limit: int = 100) -> list[Step]:
    """Steps every running summarization of this process's model whose lease is free (the
    workers' sweeper calls this: a run goes on when the API that started it is gone), its runtime
    LoRA adapters' too, unloaded ones' included: their jobs fail, and so the run ends. First it finishes
    the cancels that died partway (``finish_cancels``)."""
    now = utcnow()
    with session_scope(settings.sqlalchemy_url) as s:
        ids = s.scalars(select(SummarizationRun.id).where(
            SummarizationRun.status.in_(store.OPEN),
            or_(SummarizationRun.model.in_(lora_adapters.served_models(settings)),
                SummarizationRun.model.in_(lora_adapters.unloaded_adapters(settings.model_name))),
            or_(SummarizationRun.lease_owner.is_(None), SummarizationRun.lease_expires_at < now))
            .order_by(func.random()).limit(limit)).all()  # any ``limit`` of them: none waits on older ones forever
    steps = finish_cancels(settings, owner, limit)
    for run_id in ids:
        try:
            steps.append(advance(settings, run_id, owner))
        except Exception:
            log.exception("could not advance summarization %s", run_id)
    return steps
