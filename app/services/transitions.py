"""Job state transitions: one guarded UPDATE (expected previous state) + a job_events row.

A transition that finds the job in another state changes nothing and returns False; this
is what makes concurrent API/worker/sweeper actions safe and completion idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import case, insert, type_coerce, update
from sqlalchemy.orm import Session

from app import wire
from app.db.models import Job, JobEvent, JobStatus

log = logging.getLogger(__name__)

ACTIVE = (JobStatus.RUNNING, JobStatus.RELEGATED)
PENDING = (JobStatus.QUEUED, JobStatus.DISPATCHED)
NOT_TERMINAL = PENDING + ACTIVE


def utcnow() -> datetime:
    return datetime.now(UTC)


STOPPED = (JobStatus.CANCELLED, JobStatus.EXPIRED)  # the ends an API stop writes (cancel_stamps)


def cancel_stamps(now: datetime) -> dict[str, Any]:
    """An API stop's end timestamps (a cancel, an expiry): ``finished_at``, and ``settled_at`` but for a job an
    engine holds, whose worker writes what it produced later and settles it then (workers/lease.py keep_cancelled).
    Such a job keeps its lease until then (its worker renews it): where the worker dies first, the lease expires and
    the sweeper settles the end as it stands. SQL that reads the status the update finds (a SET clause sees the row
    as it was)."""
    held = Job.status.in_([s.value for s in ACTIVE])
    return {"finished_at": now, "settled_at": case((held, None), else_=type_coerce(now, Job.settled_at.type)),
            "lease_expires_at": case((held, Job.lease_expires_at), else_=None)}


def as_utc(dt: datetime | None) -> datetime | None:
    """A stored time in UTC: SQLite hands datetimes back naive (stored in UTC), PostgreSQL in the session's TimeZone,
    which need not be UTC."""
    return None if dt is None else wire.as_utc(dt)


def transition(
    session: Session,
    job_id: str,
    expected: JobStatus | Iterable[JobStatus],
    to: JobStatus,
    *,
    worker_id: str | None = None,
    attempt: int | None = None,
    detail: str | None = None,
    values: dict[str, Any] | None = None,
    where: Iterable[Any] = (),
) -> bool:
    """Moves ``job_id`` from one of ``expected`` to ``to``; False if the guard did not match.

    ``attempt``/``worker_id`` (when given) are guards as well: a stale attempt's update
    touches nothing. The caller commits.
    """
    expected = (expected,) if isinstance(expected, JobStatus) else tuple(expected)
    values = dict(values or {})
    # the row as it ends, where a background response's webhook may report the end (the job's id otherwise)
    returned = RESPONSE_ROW if to in RESPONSE_EVENTS else (Job.id,)
    for prev in expected:  # one statement per expected state, so the event knows where it came from
        stmt = update(Job).where(Job.id == job_id, Job.status == prev.value, *where)
        if attempt is not None:
            stmt = stmt.where(Job.attempt == attempt)
        if worker_id is not None and prev in ACTIVE:  # only the lease holder moves a running job
            stmt = stmt.where(Job.worker_id == worker_id)
        row = session.execute(stmt.values(status=to.value, **values).returning(*returned)
                              .execution_options(synchronize_session=False)).first()
        if row is not None:
            event_attempt = values.get("attempt", attempt)
            session.execute(insert(JobEvent).values(
                job_id=job_id, from_status=prev.value, to_status=to.value, at=utcnow(), worker_id=worker_id,
                attempt=event_attempt if isinstance(event_attempt, int) else 0, detail=detail))
            if to in RESPONSE_EVENTS:
                _announce_response(session, job_id, to, *row)
            return True
    return False


@dataclass(frozen=True)
class Moved:
    """A job that ``transition_many`` moved."""

    job_id: str
    left: JobStatus  # the state it was in
    attempt: int  # its attempt, as the update found it


def transition_many(session: Session, which: Any, expected: Iterable[JobStatus], to: JobStatus, *,
                    detail: str | None = None, values: dict[str, Any] | None = None) -> list[Moved]:
    """``transition`` for every job that ``which`` (a SQL condition) selects: one guarded UPDATE per expected state,
    their job_events rows in one insert, and a background response's webhook event for each. The caller commits."""
    values = dict(values or {})
    returned = RESPONSE_ROW if to in RESPONSE_EVENTS else ()
    event_attempt = values.get("attempt")
    moved: list[Moved] = []
    for prev in expected:  # a statement per expected state, as transition's, so each event knows where it came from
        rows = session.execute(update(Job).where(which, Job.status == prev.value).values(status=to.value, **values)
                               .returning(Job.id, Job.attempt, *returned)
                               .execution_options(synchronize_session=False)).all()
        moved += [Moved(row[0], prev, row[1]) for row in rows]
        for row in rows if returned else ():
            _announce_response(session, row[0], to, *row[2:])
    if moved:
        now = utcnow()
        session.execute(insert(JobEvent), [
            {"job_id": m.job_id, "from_status": m.left.value, "to_status": to.value, "at": now, "worker_id": None,
             "attempt": event_attempt if isinstance(event_attempt, int) else 0, "detail": detail} for m in moved])
    return moved


# a background response's end, as OpenAI's webhooks name it (a deadline that passed fails it)
RESPONSE_EVENTS = {JobStatus.SUCCEEDED: "response.completed", JobStatus.FAILED: "response.failed",
                   JobStatus.EXPIRED: "response.failed", JobStatus.CANCELLED: "response.cancelled"}


# what a response's event is written from: the row as the write that ends (or settles) its job returns it
RESPONSE_ROW = (Job.tenant_id, Job.endpoint, Job.response, Job.finish_reason, Job.settled_at)


def _announce_response(session: Session, job_id: str, to: JobStatus, tenant_id: str, endpoint: str,
                       response: dict[str, Any] | None, finish_reason: str | None, settled_at: Any) -> None:
    """The ``response.*`` webhook event of a background Responses API job that just ended (in this transaction).
    A cancel of a job an engine holds leaves it unsettled: its worker writes the output so far and the usage that
    the response shows after the cancel, and the event waits for that write (``announce_settled``), lest the
    receiver that fetches the response at the event see neither."""
    if endpoint != "/v1/responses" or not (response or {}).get("background"):
        return
    if to is JobStatus.CANCELLED and settled_at is None:
        return
    from app.responses_schemas import response_id
    from app.services.webhooks import emit

    kind = "response.incomplete" if to is JobStatus.SUCCEEDED and finish_reason == "length" else RESPONSE_EVENTS[to]
    emit(session, tenant_id, kind, response_id(job_id))


def announce_settled(session: Session, job_id: str, status: str, *row: Any) -> None:
    """The event a cancelled job's end held back until it settled (its worker wrote what it produced, or its lease
    lapsed; ``row``: ``RESPONSE_ROW`` as the settling write returns it), in that write's transaction. An expired
    job's was sent as it expired: its worker writes nothing to it."""
    if JobStatus(status) is JobStatus.CANCELLED:
        _announce_response(session, job_id, JobStatus.CANCELLED, *row)
