"""Group commit for the submit path: many concurrent ``POST /v1/jobs`` share one transaction.

A writer thread takes the validated jobs waiting in its inbox, inserts them all in one
transaction (Core executemany) and then answers each caller: the job is durable. With a
broker configured the rows go in already ``dispatched`` (events queued -> dispatched in
the same transaction, so they read in order even when a worker leases the job the moment
its message lands); a dispatcher thread then sends their tasks in one Redis pipeline and
moves the jobs it could not send back to ``queued`` for the sweeper. A process that dies
between the commit and the send leaves dispatched jobs without a message: the sweeper
sends those again (``workers/sweeper.py``), as it does for any lost message.

Jobs submitted with a rate-limit charge are judged by their tenants' buckets before the insert,
the whole batch in one Redis call (``RateLimiter.take_many``); a refused job is not written and
its caller gets ``RateLimited``. A charged job the insert then fails (the database unavailable: its
caller's 503) gets its charge given back, so the client's retry is not charged twice.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Dialect, Table, insert, inspect
from sqlalchemy import column as sa_column
from sqlalchemy import table as sa_table
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import TableClause

from app.db.models import STAGED, Job, JobEvent, JobStatus
from app.db.session import (database_unavailable, get_engine, get_sessionmaker, let_others_write, read_then_write,
                            write_guard)
from app.services.dispatch import send_dispatched
from app.services.rate_limits import Charge, Decision, RateLimited, RateLimiter
from app.services.transitions import utcnow
from app.settings import Settings

log = logging.getLogger(__name__)

MAX_BATCH = 256
JOB_COLUMNS = [c.key for c in Job.__table__.columns]


@dataclass(frozen=True)
class Written:
    job: Job
    rate: Decision | None = None  # its tenant's buckets after it, where it was charged


@dataclass
class _Pending:
    job: Job
    detail: str
    charge: Charge | None = None
    rate: Decision | None = None
    done: Future = field(default_factory=Future)


def _processors(table: Table, dialect: Dialect) -> list[tuple[str, Callable[[Any], Any]]]:
    """(column, bind processor) of each of ``table``'s columns that ``dialect`` processes (JSON, datetimes, ...)."""
    return [(c.key, proc) for c in table.columns
            if (proc := c.type.dialect_impl(dialect).bind_processor(dialect)) is not None]


def _bound_rows(rows: list[dict[str, Any]], processors) -> list[dict[str, Any]]:
    # a column's None binds the same every time (a JSON column's: the text 'null'): bound once, not a row at a time
    nones = [(key, proc, proc(None)) for key, proc in processors]
    for row in rows:
        for key, proc, none in nones:
            value = row[key]
            row[key] = none if value is None else proc(value)
    return rows


def _untyped(table: Table) -> TableClause:
    """``table`` with columns of no type: an insert into it sends the values as they are (already processed)."""
    return sa_table(table.name, *(sa_column(c.key) for c in table.columns))


@dataclass(frozen=True)
class JobRows:
    """Built jobs as the rows of one Core executemany per table (no ORM unit of work), made before the caller takes
    the write lock. With a ``dispatched_at`` they go in ``dispatched`` (events queued -> dispatched), for the caller
    to send once committed (``dispatch.send_dispatched``)."""

    jobs: list[dict[str, Any]]
    events: list[dict[str, Any]]
    bound: bool = False  # each column's bind processing done already (``bind``)

    @classmethod
    def of(cls, jobs: list[tuple[Job | dict[str, Any], str]], dispatched_at: datetime | None) -> JobRows:
        """``jobs``: each a ``Job`` or its column values (``jobs.job_values``), with its first event's detail."""
        rows, events = [], []
        for job, detail in jobs:
            # what the job holds: its values, or those of its instance state (a column never set: None, as the
            # attribute reads); the attributes' own reads cost several times as much, 61 columns a job
            held = job if isinstance(job, dict) else inspect(job).dict
            row = {k: held.get(k) for k in JOB_COLUMNS}
            events.append({"job_id": row["id"], "from_status": None, "to_status": JobStatus.QUEUED.value,
                           "at": row["created_at"], "attempt": 0, "detail": detail, "worker_id": None})
            if dispatched_at is not None:
                row.update(status=JobStatus.DISPATCHED.value, dispatched_at=dispatched_at)
                events.append({"job_id": row["id"], "from_status": JobStatus.QUEUED.value,
                               "to_status": JobStatus.DISPATCHED.value, "at": dispatched_at, "attempt": 0,
                               "detail": None, "worker_id": None})
            rows.append(row)
        return cls(rows, events)

    def chunks(self, size: int) -> Iterator[JobRows]:
        """The rows ``size`` jobs at a time, each job with its events."""
        events: dict[str, list[dict[str, Any]]] = {}
        for event in self.events:
            events.setdefault(event["job_id"], []).append(event)
        for i in range(0, len(self.jobs), size):
            part = self.jobs[i:i + size]
            yield JobRows(part, [e for row in part for e in events[row["id"]]], self.bound)

    def bind(self, dialect: Dialect) -> JobRows:
        """The rows as SQLite's driver takes them (JSON serialized, datetimes as text: each column type's own bind
        processor), so that a caller does this CPU work before it takes the write lock, not while holding it. Other
        databases bind at the insert (PostgreSQL's JSON parameters are cast in the statement)."""
        if self.bound or dialect.name != "sqlite":
            return self
        return JobRows(_bound_rows([dict(r) for r in self.jobs], _processors(Job.__table__, dialect)),
                       _bound_rows([dict(e) for e in self.events], _processors(JobEvent.__table__, dialect)), True)

    def insert(self, session: Session, status: str | None = None) -> None:
        """Adds the rows to the session's transaction (the caller commits); with ``status``, the jobs go in with it
        instead of their own (their events stay theirs)."""
        if self.jobs:
            jobs = self.jobs if status is None else [{**row, "status": status} for row in self.jobs]
            job_table, event_table = ((_untyped(Job.__table__), _untyped(JobEvent.__table__)) if self.bound
                                      else (Job.__table__, JobEvent.__table__))
            session.execute(insert(job_table), jobs)
            session.execute(insert(event_table), self.events)


def stage_mark() -> str:
    """The status of one writer's staged rows (``write_staged``): another that died or runs beside it has its own."""
    return f"{STAGED}-{secrets.token_hex(4)}"


def write_staged(url: str, parts: Iterable[JobRows], mark: str, still_ours: Callable[[Session], bool],
                 tick: Callable[[], None] = lambda: None) -> bool:
    """Writes each part's jobs with status ``mark`` (``stage_mark``: not runnable until the caller's commit turns
    them), a short transaction each, while ``still_ours`` holds in it (False: stopped there, the rest unwritten).
    ``tick`` before each part. On SQLite each part is bound before the write lock (``JobRows.bind``), and the lock
    is let go after it as long as it held it, so other writers get their turn; PostgreSQL locks rows."""
    dialect = get_engine(url).dialect
    for part in parts:
        tick()
        part = part.bind(dialect)
        took = time.monotonic()
        with read_then_write(url) as s:
            if not still_ours(s):
                return False
            part.insert(s, status=mark)
        if dialect.name == "sqlite":
            let_others_write(time.monotonic() - took)
    return True


class JobWriter:
    def __init__(self, settings: Settings, limiter: RateLimiter | None = None) -> None:
        self.settings = settings
        self.limiter = limiter or RateLimiter(settings.redis_url)
        self._inbox: queue.Queue[_Pending | None] = queue.Queue()
        self._sends: queue.Queue[list[Job] | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._write_loop, name="coserve-job-writer", daemon=True),
                         threading.Thread(target=self._send_loop, name="coserve-job-sender", daemon=True)]
        for t in self._threads:
            t.start()

    def submit(self, job: Job, detail: str, charge: Charge | None = None) -> Future:
        """A future that resolves to ``Written`` once the job is committed (or to the insert's error, or to
        ``RateLimited`` where its ``charge`` did not fit)."""
        pending = _Pending(job, detail, charge)
        self._inbox.put(pending)
        return pending.done

    def write(self, job: Job, detail: str, charge: Charge | None = None, timeout: float = 30.0) -> Written:
        """Blocks until the job is committed; raises what the insert raised."""
        return self.submit(job, detail, charge).result(timeout)

    def close(self) -> None:
        self._inbox.put(None)
        for t in self._threads:
            t.join(10)

    # ---- writer thread
    def _write_loop(self) -> None:
        sessions = get_sessionmaker(self.settings.sqlalchemy_url)
        while True:
            first = self._inbox.get()
            if first is None:
                self._sends.put(None)
                return
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    nxt = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._inbox.put(None)
                    break
                batch.append(nxt)
            try:  # this thread must outlive any one batch: every later submission waits on it
                batch = self._charge(batch)
                if batch:
                    self._insert(sessions, batch)
            except Exception as exc:
                log.exception("could not write %d submissions", len(batch))
                self._give_back(batch)
                for p in batch:
                    if not p.done.done():
                        p.done.set_exception(exc)

    def _charge(self, batch: list[_Pending]) -> list[_Pending]:
        """The batch's jobs its tenants' rate limits let through (the others' callers get ``RateLimited``)."""
        charged = [p for p in batch if p.charge is not None]
        if not charged:
            return batch
        for p, decision in zip(charged, self.limiter.take_many([p.charge for p in charged]), strict=True):
            p.rate = decision
            if not decision.allowed:
                p.done.set_exception(RateLimited(decision))
        return [p for p in batch if p.rate is None or p.rate.allowed]

    def _give_back(self, unwritten: list[_Pending]) -> None:
        """The charges of jobs that were charged and then not written returned to their tenants' buckets."""
        if charges := [p.charge for p in unwritten
                       if p.charge is not None and p.rate is not None and p.rate.allowed and not p.done.done()]:
            self.limiter.give_back(charges)

    def _insert(self, sessions, batch: list[_Pending]) -> None:
        dispatch = bool(self.settings.redis_url)
        now = utcnow()
        rows = JobRows.of([(p.job, p.detail) for p in batch], now if dispatch else None)
        session = sessions()
        try:
            with write_guard(session):
                rows.insert(session)
                session.commit()
        except Exception as exc:
            session.rollback()
            # find the bad row: retry one by one; where the database refused the batch (locked, down) there is none,
            # and each try would wait out its busy or connect timeout again
            if len(batch) > 1 and not database_unavailable(exc):
                for p in batch:
                    self._insert(sessions, [p])
                return
            self._give_back(batch)
            for p in batch:  # its one row's, or the batch's the database refused
                p.done.set_exception(exc)
            return
        finally:
            session.close()
        for p in batch:
            if dispatch:
                p.job.status, p.job.dispatched_at = JobStatus.DISPATCHED.value, now
            p.done.set_result(Written(p.job, p.rate))
        if dispatch:
            self._sends.put([p.job for p in batch])

    # ---- dispatcher thread
    def _send_loop(self) -> None:
        while True:
            jobs = self._sends.get()
            if jobs is None:
                return
            while len(jobs) < MAX_BATCH:
                try:
                    more = self._sends.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._sends.put(None)
                    break
                jobs += more
            send_dispatched(self.settings, jobs)  # raises nothing: this thread outlives every batch
