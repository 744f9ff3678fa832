"""The sweeper: requeues jobs whose lease expired and (re)sends jobs nobody took.

It runs as a thread in every GPU worker (every ``sweep_seconds``); all its changes are
guarded updates, so several workers sweeping at once is safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.db.models import Job, JobStatus
from app.services.dispatch import dispatch, send_job
from app.services.transitions import ACTIVE, transition, utcnow

log = logging.getLogger(__name__)


@dataclass
class SweepResult:
    requeued: int = 0  # leases expired -> queued
    failed: int = 0  # leases expired on the last allowed attempt -> failed (a job that kills workers)
    dispatched: int = 0  # queued jobs sent
    resent: int = 0  # dispatched long ago, never leased: sent again


def sweep(session: Session, redis_url: str, *, queued_grace_s: float = 2.0, resend_after_s: float = 300.0,
          max_attempts: int = 5, limit: int = 500) -> SweepResult:
    result = SweepResult()
    now = utcnow()
    expired = session.execute(select(Job.id, Job.status, Job.attempt, Job.worker_id).where(
        Job.status.in_([s.value for s in ACTIVE]), Job.lease_expires_at < now).limit(limit)).all()
    for job in expired:
        if job.attempt >= max_attempts:
            error = (f"gave up after {job.attempt} attempts: the lease of every worker that ran it expired "
                     f"(last {job.worker_id})")
            if transition(session, job.id, JobStatus(job.status), JobStatus.FAILED, attempt=job.attempt,
                          where=[Job.lease_expires_at < now], detail=error,
                          values={"worker_id": None, "lease_expires_at": None, "error": error,
                                  "finished_at": now}):
                result.failed += 1
            continue
        if transition(session, job.id, JobStatus(job.status), JobStatus.QUEUED, attempt=job.attempt,
                      where=[Job.lease_expires_at < now], values={"worker_id": None, "lease_expires_at": None},
                      detail=f"lease of {job.worker_id} expired"):
            result.requeued += 1
    session.commit()
    if result.requeued or result.failed:
        log.warning("requeued %d jobs whose lease expired; failed %d on their last attempt",
                    result.requeued, result.failed)
    # queued: never sent (broker was down) or given back; a short grace lets the API send first
    queued = session.execute(select(Job.id, Job.model).where(
        Job.status == JobStatus.QUEUED.value, Job.created_at < now - timedelta(seconds=queued_grace_s))
        .order_by(Job.created_at).limit(limit)).all()
    for job in queued:
        if not dispatch(session, redis_url, job.id, job.model, detail="sent by the sweeper"):
            break  # the broker is down: try again next sweep
        result.dispatched += 1
    # dispatched but never leased for a long time: the message may be lost (a worker died holding it)
    stale = session.execute(select(Job.id, Job.model).where(
        Job.status == JobStatus.DISPATCHED.value, Job.dispatched_at < now - timedelta(seconds=resend_after_s))
        .limit(limit)).all()
    for job in stale:
        if not send_job(redis_url, job.id, job.model):
            break
        session.execute(update(Job).where(Job.id == job.id, Job.status == JobStatus.DISPATCHED.value)
                        .values(dispatched_at=utcnow()).execution_options(synchronize_session=False))
        result.resent += 1
    session.commit()
    return result
