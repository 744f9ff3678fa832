"""Cancelling one job from the API: SQL first (the cancel is durable), then its stream's end and its worker's
abort; where a worker was running the job, the reply waits for it to write what the attempt produced, so that the
cancel answers with the job's output so far and its usage (a client need not poll for them)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.db.models import Job
from app.services import jobs as job_service
from app.services.notify import announce_cancel, await_kept
from app.services.transitions import ACTIVE
from app.settings import Settings


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
            session.refresh(job)
    return True
