"""Job leases in SQL: a worker owns a job while ``lease_expires_at`` is in the future.

``acquire`` moves queued/dispatched -> running and bumps ``attempt``; the heartbeat
renews every lease the worker holds; ``finish`` is guarded by (worker_id, attempt), so
the completion of a stale attempt (its lease expired and the job was rerun) is ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from app.db.models import Job, JobStatus
from app.services.transitions import ACTIVE, PENDING, RESPONSE_ROW, STOPPED, announce_settled, transition, utcnow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    job_id: str
    attempt: int
    worker_id: str

    @property
    def request_id(self) -> str:
        """The engine's id of this attempt's request: two attempts of a job never share one in an engine, so a rerun
        is added beside an earlier attempt whose abort the engine has not taken yet, and that attempt's late outputs
        name it (``ActiveJobs.serving``); the users see the job's id alone (API, streams, SQL)."""
        return engine_request_id(self.job_id, self.attempt)


def engine_request_id(job_id: str, attempt: int) -> str:
    """``job_…:attempt``: a job id holds no ``:``, and vLLM and the own engine take any string as a request id."""
    return f"{job_id}:{attempt}"


def acquire(session: Session, job_id: str, worker_id: str, lease_s: float) -> Lease | None:
    """Leases a pending job for ``worker_id`` (commits); None if it is not pending any more."""
    row = session.execute(select(Job.status, Job.attempt).where(Job.id == job_id)).first()
    if row is None or row.status not in PENDING:
        return None
    now = utcnow()
    ok = transition(session, job_id, PENDING, JobStatus.RUNNING, worker_id=worker_id, attempt=row.attempt,
                    detail="leased", values={"attempt": row.attempt + 1, "worker_id": worker_id,
                                             "lease_expires_at": now + timedelta(seconds=lease_s),
                                             "started_at": now})
    session.commit()
    return Lease(job_id, row.attempt + 1, worker_id) if ok else None


def drop_held_marks(session: Session, worker_id: str) -> int:
    """Unmarks the dispatched jobs marked as waiting for engine room in a worker of this id, and returns how many:
    a worker that starts holds none, so they are a predecessor's under the same id (a stable COSERVE_WORKER_ID,
    a restarted container) that died. The sweeper's holder check cannot see it (the id beats again); unmarked,
    their lost messages are sent again once missed from the queue, not after Redis's visibility timeout."""
    return session.execute(update(Job).where(Job.status == JobStatus.DISPATCHED.value, Job.worker_id == worker_id)
                           .values(worker_id=None).execution_options(synchronize_session=False)).rowcount


def renew(session: Session, worker_id: str, leases: Iterable[Lease], lease_s: float,
          ending: Iterable[str] = ()) -> set[str]:
    """Extends the leases still held (commits); returns the ids of those held. ``ending``: the ids of the jobs among
    them whose engine ended their attempt, its last write on its way to SQL (the outbox's)."""
    leases = list(leases)
    if not leases:
        return set()
    ids = [lease.job_id for lease in leases]
    # a job the API stopped while this worker ran it stays leased until the worker writes what it produced
    # (keep_cancelled), for one lease after the stop while its engine has not ended it: its lease expires where the
    # worker is gone, or where its engine never finishes the abort (it would stay unsettled as long as the worker
    # beats), and the sweeper settles it as it stands. One the engine ended stays leased until that write, however
    # late it lands (a loaded database): settled before it, the job lost the tokens it ran. The outbox bounds it: a
    # write given up on lets the job go (``MAX_TRIES``)
    now = utcnow()
    ending = list(ending)
    unwritten = and_(Job.status.in_([s.value for s in STOPPED]), Job.settled_at.is_(None),
                     or_(Job.finished_at > now - timedelta(seconds=lease_s), Job.id.in_(ending)))
    session.execute(update(Job).where(Job.id.in_(ids), Job.worker_id == worker_id,
                                      or_(Job.status.in_([s.value for s in ACTIVE]), unwritten))
                    .values(lease_expires_at=now + timedelta(seconds=lease_s))
                    .execution_options(synchronize_session=False))
    held = session.execute(select(Job.id, Job.attempt).where(
        Job.id.in_(ids), Job.worker_id == worker_id, Job.status.in_([s.value for s in ACTIVE]))).all()
    session.commit()
    attempts = {lease.job_id: lease.attempt for lease in leases}
    return {r.id for r in held if attempts.get(r.id) == r.attempt}


def finish(session: Session, lease: Lease, to: JobStatus, values: dict[str, Any], detail: str | None = None) -> bool:
    """The one terminal transition of this attempt (commits); False for a stale attempt."""
    now = utcnow()
    values = {"finished_at": now, "settled_at": now, "lease_expires_at": None, **values}
    ok = transition(session, lease.job_id, ACTIVE, to, worker_id=lease.worker_id, attempt=lease.attempt,
                    detail=detail, values=values)
    session.commit()
    if not ok:
        log.info("ignored %s of %s attempt %d: the lease is no longer ours", to, lease.job_id, lease.attempt)
    return ok


def keep_cancelled(session: Session, lease: Lease, values: dict[str, Any] | None) -> bool:
    """Writes what this attempt produced (``values``: text, token counts; None: nothing) on its job if the API
    cancelled the job while this attempt held it (commits); the status stays ``cancelled``. False where the job is
    not this attempt's cancelled job: its lease was lost, it runs again elsewhere or is in any other state."""
    # the worker too: a lapsed lease's job goes back to the queue at the same attempt with no worker, and one
    # cancelled while it waits there was not cancelled while this attempt ran it
    ours = (Job.id == lease.job_id, Job.attempt == lease.attempt, Job.worker_id == lease.worker_id,
            Job.status == JobStatus.CANCELLED.value)
    # its end settles with this write (None: nothing to write, settled all the same), once: /metrics may keep the
    # totals of a settled end, so what a late second write would change is refused
    settled = session.execute(update(Job).where(*ours, Job.settled_at.is_(None))
                              .values(**(values or {}), settled_at=utcnow(), lease_expires_at=None)
                              .returning(*RESPONSE_ROW).execution_options(synchronize_session=False)).first()
    done = settled is not None
    if done:  # a background response's cancel is announced now that what it shows is written
        announce_settled(session, lease.job_id, JobStatus.CANCELLED.value, *settled)
    session.commit()
    if done or values:
        return bool(done)
    return session.scalar(select(func.count()).select_from(Job).where(*ours)) == 1


def settle_lapsed(session: Session, now, limit: int) -> int:
    """Settles the ends the API stopped (cancelled, expired) while a worker held them whose lease expired before that
    worker wrote what it produced (keep_cancelled): it died, and they would otherwise be read afresh at every
    ``/metrics`` scrape. Their values stay as they stand; a background response's cancel is announced now. Returns
    how many (the caller commits)."""
    lapsed = list(session.scalars(select(Job.id).where(  # ix_jobs_status_lease: a short range
        Job.status.in_([s.value for s in STOPPED]), Job.lease_expires_at < now, Job.settled_at.is_(None))
        .limit(limit)))
    if not lapsed:
        return 0
    settled = session.execute(update(Job).where(Job.id.in_(lapsed), Job.lease_expires_at < now,
                                                Job.settled_at.is_(None))
                              .values(settled_at=utcnow(), lease_expires_at=None)
                              .returning(Job.id, Job.status, *RESPONSE_ROW)
                              .execution_options(synchronize_session=False)).all()
    for job_id, status, *row in settled:
        announce_settled(session, job_id, status, *row)
    return len(settled)


def release(session: Session, lease: Lease, detail: str) -> bool:
    """Gives a running job back (worker shutdown): running/relegated -> queued (commits)."""
    ok = transition(session, lease.job_id, ACTIVE, JobStatus.QUEUED, worker_id=lease.worker_id,
                    attempt=lease.attempt, detail=detail, values={"worker_id": None, "lease_expires_at": None})
    session.commit()
    return ok
