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


def send_jobs(redis_url: str, jobs: list[tuple[str, str]]) -> list[str]:
    """Sends (job_id, model_name) pairs on one producer; returns the ids sent, in order.

    The fast path publishes without kombu's retry wrapper (it halves the cost per
    message); the first failure falls back to ``send_job`` with retries, and a second one
    stops the batch (the broker is down; the rest stay for the sweeper).
    """
    app = get_celery(redis_url)
    sent: list[str] = []
    try:
        with app.producer_or_acquire() as producer:
            for job_id, model in jobs:
                app.send_task(RUN_JOB, args=[job_id], queue=queue_name(model), producer=producer, retry=False)
                sent.append(job_id)
        return sent
    except Exception as exc:
        log.info("fast send failed after %d jobs (%s); retrying one by one", len(sent), exc)
    for job_id, model in jobs[len(sent):]:
        if not send_job(redis_url, job_id, model):
            break
        sent.append(job_id)
    return sent


def dispatch(session: Session, redis_url: str, job_id: str, model_name: str, *, detail: str | None = None) -> bool:
    """Mark a committed ``queued`` job ``dispatched``, then send it (commits).

    Marking first keeps the events in order (a worker may lease the job as soon as the
    message lands); a failed send moves it back to ``queued`` for the sweeper.
    """
    session.commit()  # end any read snapshot: the update starts a write transaction
    with write_guard(session):
        marked = transition(session, job_id, JobStatus.QUEUED, JobStatus.DISPATCHED, detail=detail,
                            values={"dispatched_at": utcnow()})
        session.commit()
    if not marked:
        return True  # someone else moved it on; nothing to send
    if send_job(redis_url, job_id, model_name):
        return True
    with write_guard(session):
        transition(session, job_id, JobStatus.DISPATCHED, JobStatus.QUEUED,
                   detail="broker unavailable; the sweeper will send it")
        session.commit()
    return False
