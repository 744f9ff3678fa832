"""Sending jobs to the workers' queue, after the job row is committed.

A send that fails (broker down) leaves the job ``queued``; the sweeper dispatches it
later, so an accepted job is never lost.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from app.db.models import JobStatus
from app.db.session import write_guard
from app.services.transitions import transition, utcnow
from workers.celery_app import RUN_JOB, get_celery, queue_name

log = logging.getLogger(__name__)

# A short retry: the API answers quickly during a broker outage and the sweeper retries.
SEND_RETRY = {"max_retries": 2, "interval_start": 0.0, "interval_step": 0.2, "interval_max": 0.5}


def send_job(redis_url: str, job_id: str, model_name: str) -> bool:
    try:
        get_celery(redis_url).send_task(RUN_JOB, args=[job_id], queue=queue_name(model_name),
                                        retry=True, retry_policy=SEND_RETRY)
        return True
    except Exception as exc:  # kombu raises OperationalError and socket errors alike
        log.warning("could not send job %s to the broker (%s); it stays queued for the sweeper", job_id, exc)
        return False


def dispatch(session: Session, redis_url: str, job_id: str, model_name: str, *, detail: str | None = None) -> bool:
    """Send a committed ``queued`` job and mark it ``dispatched`` (commits)."""
    if not send_job(redis_url, job_id, model_name):
        return False
    session.commit()  # end any read snapshot: the update starts a write transaction
    with write_guard(session):
        transition(session, job_id, JobStatus.QUEUED, JobStatus.DISPATCHED, detail=detail,
                   values={"dispatched_at": utcnow()})
        session.commit()
    return True
