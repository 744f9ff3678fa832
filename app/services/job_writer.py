"""Group commit for the submit path: many concurrent ``POST /v1/jobs`` share one transaction.

A writer thread takes the validated jobs waiting in its inbox, inserts them all in one
transaction (Core executemany) and then answers each caller: the job is durable. A
dispatcher thread then sends their tasks to the broker and marks the sent ones
``dispatched`` in one UPDATE. The order of the contract is kept: a task is sent only
after its row is committed, and a job whose send fails stays ``queued`` for the sweeper.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from sqlalchemy import insert, update

from app.db.models import Job, JobEvent, JobStatus
from app.db.session import get_sessionmaker, write_guard
from app.services.dispatch import send_jobs
from app.services.transitions import transition, utcnow
from app.settings import Settings

log = logging.getLogger(__name__)

MAX_BATCH = 256
JOB_COLUMNS = [c.key for c in Job.__table__.columns]


@dataclass
class _Pending:
    job: Job
    detail: str
    done: Future = field(default_factory=Future)


class JobWriter:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._inbox: queue.Queue[_Pending | None] = queue.Queue()
        self._sends: queue.Queue[list[Job] | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._write_loop, name="coserve-job-writer", daemon=True),
                         threading.Thread(target=self._send_loop, name="coserve-job-sender", daemon=True)]
        for t in self._threads:
            t.start()

    def submit(self, job: Job, detail: str) -> Future:
        """A future that resolves to ``job`` once it is committed (or to the insert's error)."""
        pending = _Pending(job, detail)
        self._inbox.put(pending)
        return pending.done

    def write(self, job: Job, detail: str, timeout: float = 30.0) -> Job:
        """Blocks until ``job`` is committed; raises what the insert raised."""
        return self.submit(job, detail).result(timeout)

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
            self._insert(sessions, batch)

    def _insert(self, sessions, batch: list[_Pending]) -> None:
        rows = [{k: getattr(p.job, k) for k in JOB_COLUMNS} for p in batch]
        events = [{"job_id": p.job.id, "from_status": None, "to_status": JobStatus.QUEUED.value,
                   "at": p.job.created_at, "attempt": 0, "detail": p.detail, "worker_id": None} for p in batch]
        session = sessions()
        try:
            with write_guard(session):
                session.execute(insert(Job), rows)
                session.execute(insert(JobEvent), events)
                session.commit()
        except Exception as exc:
            session.rollback()
            if len(batch) > 1:  # find the bad row: retry one by one
                for p in batch:
                    self._insert(sessions, [p])
                return
            batch[0].done.set_exception(exc)
            return
        finally:
            session.close()
        for p in batch:
            p.done.set_result(p.job)
        self._sends.put([p.job for p in batch])

    # ---- dispatcher thread
    def _send_loop(self) -> None:
        sessions = get_sessionmaker(self.settings.sqlalchemy_url)
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
            redis_url = self.settings.redis_url
            # marked before the send so that events read queued -> dispatched -> running even
            # when a worker leases the job the moment it arrives; unsent ones go back to queued
            marked = self._mark_dispatched(sessions, [j.id for j in jobs]) if redis_url else []
            todo = [(j.id, j.model) for j in jobs if j.id in marked]
            sent = set(send_jobs(redis_url, todo)) if todo else set()
            unsent = [job_id for job_id, _m in todo if job_id not in sent]
            if unsent:
                self._unmark(sessions, unsent)

    def _mark_dispatched(self, sessions, ids: list[str]) -> set[str]:
        session = sessions()
        try:
            with write_guard(session):
                now = utcnow()
                moved = session.execute(
                    update(Job).where(Job.id.in_(ids), Job.status == JobStatus.QUEUED.value)
                    .values(status=JobStatus.DISPATCHED.value, dispatched_at=now)
                    .returning(Job.id).execution_options(synchronize_session=False)).scalars().all()
                if moved:
                    session.execute(insert(JobEvent), [
                        {"job_id": i, "from_status": JobStatus.QUEUED.value, "to_status": JobStatus.DISPATCHED.value,
                         "at": now, "attempt": 0, "detail": None, "worker_id": None} for i in moved])
                session.commit()
                return set(moved)
        except Exception:
            session.rollback()
            log.exception("could not mark %d jobs dispatched; the sweeper will send them", len(ids))
            return set()
        finally:
            session.close()

    def _unmark(self, sessions, ids: list[str]) -> None:
        session = sessions()
        try:
            with write_guard(session):
                for job_id in ids:
                    transition(session, job_id, JobStatus.DISPATCHED, JobStatus.QUEUED,
                               detail="broker unavailable; the sweeper will send it")
                session.commit()
        finally:
            session.close()
