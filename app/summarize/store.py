"""Summarization runs in SQL: the rows a step reads and writes, and what the API shows.

A run is one ``summarization_runs`` row (counters, status, version, lease) and one
``summarization_documents`` row per document (its level's text and job ids). The jobs a
step submits are inserted in the same transaction as the documents that name them, so a
process that dies mid-step leaves either both or neither.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.db.models import Job, JobEvent, JobStatus, SummarizationDocument, SummarizationRun
from app.db.session import session_scope
from app.services.transitions import as_utc, utcnow
from app.summarize.pipeline import TERMINAL, DocState, JobResult, Progress, result_line

log = logging.getLogger(__name__)

IN_CHUNK = 500  # ids per IN (...) list: SQLite caps the bound parameters of one statement

T = TypeVar("T")
VALIDATING = "validating"  # written, its documents not split yet: its first step writes its first level's jobs
OPEN = (VALIDATING, "running")  # a run that goes on (steps take it)
LIVE = (*OPEN, "cancelling")  # a run whose documents still name jobs that may be going


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
    """The jobs a live run submitted that have not ended, which are the ones its documents wait for (0 for a run that
    ended: it waits for none). One count on ``ix_jobs_summarization_run_status``, whatever the run's size: each poll
    of a run's progress runs it."""
    if run.status not in LIVE:
        return 0
    return session.scalar(select(func.count()).select_from(Job).where(
        Job.summarization_run_id == run.id, Job.status.in_(OPEN_JOB))) or 0


def add_jobs(session: Session, jobs: Iterable[Job], detail: str, dispatched: bool) -> None:
    """Adds built jobs and their events to the caller's transaction; ``dispatched`` writes them
    as sent already (the caller sends them right after the commit, as the API's job writer does:
    a message lost in between is resent by the workers' sweeper)."""
    now = utcnow()
    for job in jobs:
        session.add(JobEvent(job_id=job.id, from_status=None, to_status=JobStatus.QUEUED.value,
                             at=job.created_at, attempt=0, detail=detail))
        if dispatched:
            job.status, job.dispatched_at = JobStatus.DISPATCHED.value, now
            session.add(JobEvent(job_id=job.id, from_status=JobStatus.QUEUED.value,
                                 to_status=JobStatus.DISPATCHED.value, at=now, attempt=0))
        session.add(job)


@dataclass(frozen=True)
class RunView:
    """What the API answers for a run: its progress and, once it ended, its results."""

    tenant_id: str
    progress: Progress
    results: bytes | None  # JSONL, one line per document; None while the run is going


def progress_of(run: SummarizationRun, session: Session | None = None) -> Progress:
    """``session``: ``jobs_done`` counts the jobs ended up to now (a step counts those ended when it ran)."""
    jobs_done = run.jobs_done
    if session is not None and run.status in LIVE:
        jobs_done = max(jobs_done, run.jobs_submitted - open_job_count(session, run))
    return Progress(run.id, run.status, as_utc(run.deadline_at), run.documents, run.documents_done,
                    run.documents_failed, run.jobs_submitted, jobs_done, run.model, run.reason)


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
