"""Cancelling one job from the API: SQL first (the cancel is durable), then its stream's end and its worker's
abort; where a worker was running the job, the reply waits for it to write what the attempt produced, so that the
cancel answers with the job's output so far and its usage (a client need not poll for them). ``stop_job_ids`` ends
many at once (a batch's, a summarization run's) in bulk, without waiting for their workers."""

from __future__ import annotations

import time

from sqlalchemy.orm import Session

from app.db.models import Job, JobStatus
from app.db.session import let_others_write, write_after_read
from app.services import jobs as job_service
from app.services.notify import announce_cancel, announce_cancels, await_kept
from app.services.transitions import ACTIVE, NOT_TERMINAL, cancel_stamps, transition_many, utcnow
from app.settings import Settings

STOP_CHUNK = 500  # jobs a transaction: SQLite caps one statement's parameters, and others may write in between
def cancel(session: Session, settings: Settings, job: Job, detail: str) -> bool:
    """Cancels the job if it has not ended (False where it had); ``job`` is refreshed with what its worker kept,
    or as the cancel left it where the worker did not answer within ``settings.cancel_wait_s``."""
    cancelled_from = job_service.cancel_job(session, job, detail=detail)
    if cancelled_from is None:
        return False
    held = cancelled_from in ACTIVE  # an engine held it (as the cancel's write found it, not an earlier read)
    end_id = announce_cancel(settings.redis_url, job, held)
    if held and end_id is not None and settings.cancel_wait_s > 0:
        if await_kept(settings.redis_url, job, end_id, settings.cancel_wait_s):
            session.commit()  # a fresh read sees the worker's write
            job_service.reread(session, job)
    return True


def stop_job_ids(session: Session, ids: list[str], to: JobStatus, detail: str, redis_url: str | None) -> int:
    """Moves each of these jobs that has not ended to ``to`` (cancelled/expired), ``STOP_CHUNK`` jobs a transaction;
    the workers running any are told to abort them."""
    pause = session.get_bind().dialect.name == "sqlite"  # PostgreSQL locks rows: nobody waits on the others
    stopped, held = 0, 0.0
    for i in range(0, len(ids), STOP_CHUNK):
        if i and pause:
            let_others_write(held)
        moved, held = _stop_chunk(session, ids[i:i + STOP_CHUNK], to, detail, redis_url)
        stopped += moved
    return stopped


def _stop_chunk(session: Session, ids: list[str], to: JobStatus, detail: str,
                redis_url: str | None) -> tuple[int, float]:
    """The jobs stopped, and the seconds their transaction held the write lock."""
    values = {**cancel_stamps(utcnow()), "finish_reason": to.value}
    if to == JobStatus.EXPIRED:
        values["slo_met"] = False  # its deadline passed
    # End the read transaction the caller's last read (or the previous chunk's announce) opened: a deferred
    # transaction that read and then writes fails at once ("database is locked") if a worker committed in between.
    with write_after_read(session):
        took = time.monotonic()
        moved = transition_many(session, Job.id.in_(ids), NOT_TERMINAL, to, detail=detail, values=values)
        session.commit()
        held = time.monotonic() - took
    # a job not yet running needs no word: a worker's lease of it finds it ended, and its stream's readers ask SQL
    announce_cancels(redis_url, [(m.job_id, m.attempt) for m in moved if m.left in ACTIVE], to.value)
    return len(moved), held
