"""Summarization runs in SQL: the rows a step reads and writes, and what the API shows.

A run is one ``summarization_runs`` row (counters, status, version, lease) and one
``summarization_documents`` row per document (its level's text and job ids). The jobs a
step submits become runnable in the same transaction as the documents that name them, so a
process that dies mid-step leaves either both or neither: a step of many jobs first writes
them ``staged`` (a status no worker, sweeper or listing takes) in short transactions
(``stage_jobs``), SQLite's write lock let go between them, and its commit turns them queued
or dispatched; staged rows a dead or lost step left are deleted by the next commit or end.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from app.db.models import STAGED, Job, JobEvent, JobStatus, SummarizationDocument, SummarizationRun
from app.db.session import session_scope
from app.services.transitions import as_utc
from app.summarize.lease import LeaseLost, held
from app.summarize.pipeline import TERMINAL, DocState, JobResult, Progress, result_line

if TYPE_CHECKING:
    from app.services.job_writer import JobRows

log = logging.getLogger(__name__)

IN_CHUNK = 500  # ids per IN (...) list: SQLite caps the bound parameters of one statement
# jobs per transaction while a step writes many (2,400 jobs of an 8 MB run held SQLite's one write lock 1-2 s in one)
STAGE_CHUNK = 500

T = TypeVar("T")
VALIDATING = "validating"  # written, its documents not split yet: its first step writes its first level's jobs
OPEN = (VALIDATING, "running")  # a run that goes on (steps take it)


def doc_state(row: SummarizationDocument) -> DocState:
    return DocState(row.doc_id, level=row.level, text=row.text, pending=list(row.pending), final=row.final,
                    chunks=row.chunks, jobs=row.jobs, summary=row.summary, error=row.error,
                    attempts=list(row.attempts or []), retries=row.retries or 0,
                    retry_at=as_utc(row.retry_at) if row.retry_at else None, retry_errors=list(row.retry_errors or []))


def doc_values(doc: DocState) -> dict:
    """The columns of a document row that a step changes."""
    return {"level": doc.level, "text": doc.text, "pending": list(doc.pending), "final": doc.final,
            "chunks": doc.chunks, "jobs": doc.jobs, "summary": doc.summary, "error": doc.error, "done": doc.done,
            "attempts": list(doc.attempts), "retries": doc.retries, "retry_at": doc.retry_at,
            "retry_errors": list(doc.retry_errors)}


def new_document(run_id: str, position: int, doc: DocState) -> SummarizationDocument:
    return SummarizationDocument(run_id=run_id, position=position, doc_id=doc.id, **doc_values(doc))


def in_chunks(values: list[T]) -> Iterator[list[T]]:
    """``values`` in slices short enough for one IN (...) list."""
    for i in range(0, len(values), IN_CHUNK):
        yield values[i:i + IN_CHUNK]


def job_statuses(session: Session, job_ids: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in in_chunks(job_ids):
        out.update({r.id: r.status for r in session.execute(select(Job.id, Job.status).where(Job.id.in_(part)))})
    return out


def job_results(session: Session, job_ids: list[str]) -> dict[str, JobResult]:
    out: dict[str, JobResult] = {}
    for part in in_chunks(job_ids):
        rows = session.execute(select(Job.id, Job.status, Job.output_text, Job.error, Job.error_code)
                               .where(Job.id.in_(part)))
        out.update({r.id: JobResult(r.status, r.output_text, r.error, r.error_code) for r in rows})
    return out


OPEN_JOB = tuple(s.value for s in JobStatus if s.value not in TERMINAL)


def open_job_count(session: Session, run: SummarizationRun) -> int:
    """The jobs a run submitted that have not ended: while it is live, the ones its documents wait for; once it
    failed as a whole or was cancelled, the ones not stopped yet (``driver._stop_pending_jobs``). One count on
    ``ix_jobs_summarization_run_status``, whatever the run's size: each poll of a run's progress runs it."""
    return session.scalar(select(func.count()).select_from(Job).where(
        Job.summarization_run_id == run.id, Job.status.in_(OPEN_JOB))) or 0


@dataclass(frozen=True)
class Staged:
    """The jobs a step wrote staged (``mark``: their status, this step's own), and the rest it writes at its
    commit (``last``: at most ``STAGE_CHUNK``; None: no job)."""

    mark: str
    count: int
    last: JobRows | None


def stage_jobs(url: str, run: SummarizationRun, owner: str, rows: JobRows, tick: Callable[[], None]) -> Staged:
    """Writes all but the last ``STAGE_CHUNK`` of ``rows`` staged, a chunk a transaction, each only while ``owner``
    still holds the run's lease at the version read (else ``LeaseLost``), SQLite's write lock let go between
    chunks for as long as the chunk held it; ``tick`` before each (the step's ``lease.LeaseKeeper``)."""
    from app.services.job_writer import stage_mark, write_staged

    mark = stage_mark()
    parts = list(rows.chunks(STAGE_CHUNK)) or [None]

    def holds_lease(s: Session) -> bool:
        return s.scalar(select(func.count()).select_from(SummarizationRun).where(*held(run, owner))) == 1

    if not write_staged(url, parts[:-1], mark, holds_lease, tick):
        raise LeaseLost(run.id)
    return Staged(mark, sum(len(p.jobs) for p in parts[:-1]), parts[-1])


def start_staged(session: Session, run_id: str, staged: Staged, status: str) -> None:
    """In the step's commit: its staged jobs become ``status`` (queued or dispatched), the last chunk goes in, and
    the staged rows of any other step of the run (one that died or lost its lease midway: none of them can commit
    now) are deleted."""
    if staged.count:
        moved = session.execute(update(Job).where(Job.summarization_run_id == run_id, Job.status == staged.mark)
                                .values(status=status).execution_options(synchronize_session=False)).rowcount
        if moved != staged.count:  # rolled back with the step: it is taken again
            raise RuntimeError(f"{staged.count - moved} of summarization {run_id}'s staged jobs went missing")
    if staged.last is not None:
        staged.last.insert(session)
    drop_staged(session, run_id)


def drop_staged(session: Session, run_id: str) -> None:
    """Deletes the run's staged jobs and their events (one statement each over ``ix_jobs_summarization_run_status``;
    none in the common case)."""
    orphans = select(Job.id).where(Job.summarization_run_id == run_id, Job.status.startswith(STAGED))
    if session.scalar(select(func.count()).select_from(orphans.subquery())):
        session.execute(delete(JobEvent).where(JobEvent.job_id.in_(orphans)).execution_options(
            synchronize_session=False))
        session.execute(delete(Job).where(Job.summarization_run_id == run_id, Job.status.startswith(STAGED))
                        .execution_options(synchronize_session=False))


@dataclass(frozen=True)
class RunView:
    """What the API answers for a run: its progress and, once it ended, its results."""

    tenant_id: str
    progress: Progress
    results: bytes | None  # JSONL, one line per document; None while the run is going


def progress_of(run: SummarizationRun, session: Session | None = None, open_jobs: int | None = None) -> Progress:
    """``session``: ``jobs_done`` counts the jobs ended up to now (a step counts those ended when it ran), a run's
    that ended too: one that ended as a whole stops its jobs after it ends, and a user sees them end. A run whose
    count reached ``jobs_submitted`` is not counted again (an ended one's, in the common case). ``open_jobs``: the
    run's ``open_job_count`` where the caller counted it (a page's, by ``page_progress``)."""
    jobs_done = run.jobs_done
    if jobs_done < run.jobs_submitted and (open_jobs is not None or session is not None):
        open_jobs = open_job_count(session, run) if open_jobs is None else open_jobs
        jobs_done = max(jobs_done, run.jobs_submitted - open_jobs)
    return Progress(run.id, run.status, as_utc(run.deadline_at), run.documents, run.documents_done,
                    run.documents_failed, run.jobs_submitted, jobs_done, run.model, run.reason)


def page_progress(session: Session, runs: list[SummarizationRun]) -> dict[str, Progress]:
    """``progress_of`` each run of a listed page, by id: the open jobs of the runs still counting counted in one
    grouped query on ``ix_jobs_summarization_run_status`` (not one a run)."""
    counting = [run.id for run in runs if run.jobs_done < run.jobs_submitted]
    open_jobs = dict(session.execute(select(Job.summarization_run_id, func.count()).where(
        Job.summarization_run_id.in_(counting), Job.status.in_(OPEN_JOB)).group_by(Job.summarization_run_id)).all()
                     ) if counting else {}
    return {run.id: progress_of(run, open_jobs=open_jobs.get(run.id, 0)) for run in runs}


def view(url: str, run_id: str, with_results: bool = False) -> RunView | None:
    with session_scope(url) as s:
        run = s.get(SummarizationRun, run_id)
        if run is None:
            return None
        results = None
        if with_results and run.status not in OPEN:
            rows = s.scalars(select(SummarizationDocument).where(
                SummarizationDocument.run_id == run_id, SummarizationDocument.done.is_(True))
                .order_by(SummarizationDocument.position))
            results = "".join(json.dumps(result_line(doc_state(r))) + "\n" for r in rows).encode()
        return RunView(run.tenant_id, progress_of(run, s), results)


def documents(session: Session, run_id: str, positions: list[int]) -> dict[int, DocState]:
    """The run's documents at ``positions``, by position."""
    out: dict[int, DocState] = {}
    for part in in_chunks(positions):
        rows = session.scalars(select(SummarizationDocument).where(
            SummarizationDocument.run_id == run_id, SummarizationDocument.position.in_(part)))
        out.update({r.position: doc_state(r) for r in rows})
    return out
