"""The engine thread's outputs on their way to SQL and Redis: an outbox drained by one I/O thread.

The engine thread never waits on I/O. After each step it puts one ``StepRecords`` here: the
step's token deltas (stream events) and its ``Record``s (a SQL write, the events it unlocks,
and whether the job leaves the worker once it is written). The I/O thread, the only one that
writes the engine's results:

* applies each record on its own, so one write that raises cannot drop the others; a failed
  write is retried with backoff, and given up after ``MAX_TRIES`` (the job then leaves the
  worker, its lease lapses and the sweeper runs it again);
* publishes stream events in the order they were produced and never drops them while Redis
  is away: they wait, in order, and go out when it is back (a client's stream pauses);
* publishes a record's events only after its write committed (a reader that sees ``end`` finds
  the job terminal in SQL);
* holds a record made to follow the stream (``Record.after_events``: a rerun's message handed
  back, a job's message sent again after an engine error) until the events queued before it are
  published: whoever takes the message reads them. A SQL write that must not wait goes first, the
  held send as its ``Record.then``; what undoes that write where the send is given up, as its
  ``Record.if_given_up`` (a job marked dispatched whose message never went goes back to queued, where
  the next sweep sends it), tried too for a record still unwritten when the outbox closes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from sqlalchemy.orm import Session

from app.db.session import session_scope
from app.services.streaming import StreamEvent, publish
from workers.active_job import ActiveJobs
from workers.lease import Lease

log = logging.getLogger(__name__)

MAX_TRIES = 8  # a write's attempts before it is given up (backoff 0.5 s doubling, capped at 8 s: ~40 s)
MAX_WAITING_EVENTS = 500_000  # past this, the oldest waiting events are dropped (readers see the gap)
PUBLISH_CHUNK = 2048


@dataclass
class Record:
    """One SQL write for the worker's jobs and the stream events it unlocks."""

    what: str  # for the log: "finish job_x", "first tokens", ...
    # False: the lease is not ours, skip the events; a list: the events to publish instead of ``events``
    write: Callable[[Session], bool | list[tuple[str, StreamEvent]] | None] | None = None
    events: list[tuple[str, StreamEvent]] = field(default_factory=list)
    leaving: Lease | None = None  # an attempt that leaves the worker once this record is done (or given up)
    for_job: str | None = None  # the one job it writes for, where no attempt leaves with it
    # written only once the stream events queued before it are published (held meanwhile, however long Redis is
    # away): a rerun's message goes back after its earlier attempt's last deltas, which its take goes on from
    after_events: bool = False
    # tried once this one is written (not where it is given up or its lease is not ours): what must wait for the
    # stream (``after_events``: a message sent) after a write that must not (the job marked dispatched in SQL)
    then: Record | None = None
    # tried once where this one is given up (``MAX_TRIES``, or still retried or held when the outbox closes): a job
    # marked dispatched for a send the broker never took goes back to queued, where the next sweep sends it (left
    # dispatched, it waited for the sweeper's rule for a lost message, minutes)
    if_given_up: Record | None = None
    tries: int = 0
    not_before: float = 0.0
    events_before: int | None = None  # held: the outbox's count of events sent once those queued before it are

    @property
    def job_id(self) -> str | None:
        """The one job it writes for (None: several): its later records wait behind it while it is retried."""
        return self.leaving.job_id if self.leaving is not None else self.for_job


@dataclass
class StepRecords:
    deltas: list[tuple[str, StreamEvent]] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.deltas or self.records)


class Outbox:
    def __init__(self, url: str, redis_client: redis.Redis, active: ActiveJobs) -> None:
        self.url = url
        self.redis = redis_client
        self.active = active
        self._steps: queue.Queue[StepRecords | None] = queue.Queue()
        self._retry: list[Record] = []
        self._held: list[Record] = []  # records that wait for the events queued before them (``after_events``)
        self._events: deque[tuple[str, StreamEvent]] = deque()
        self._sent = 0  # events taken off the queue (published, or dropped past ``MAX_WAITING_EVENTS``) since start
        # stream events put and not yet published, by job: those of a step still queued too (``publishing``)
        self._unpublished: Counter[str] = Counter()
        self._counting = threading.Lock()  # the engine and intake threads count in, the I/O thread counts out
        self._publish_after = 0.0
        self._publish_backoff = 0.0
        self._thread: threading.Thread | None = None
        self._close_timeout = 15.0  # set by ``close``, before the I/O thread is told to stop

    # ---- the engine thread's side
    def put(self, step: StepRecords) -> None:
        if step:
            self._count(step.deltas)  # waiting from now: a rerun reads the stream once they are out (``publishing``)
            self._steps.put(step)

    # ---- life cycle
    def start(self) -> threading.Thread:
        self._thread = threading.Thread(target=self.run, name="coserve-outbox", daemon=True)
        self._thread.start()
        return self._thread

    def close(self, timeout: float = 15.0) -> None:
        """Writes what is queued (retrying for at most ``timeout``), then stops the thread. What is still unwritten
        then is given up (``Record.if_given_up`` tried once)."""
        self._close_timeout = timeout
        self._steps.put(None)
        if self._thread is not None:
            self._thread.join(timeout + 5)

    def publishing(self, job_id: str) -> bool:
        """Whether stream events of ``job_id`` wait to be published (any thread may ask): those of a step put and
        not yet taken by the I/O thread among them."""
        with self._counting:
            return self._unpublished.get(job_id, 0) > 0

    @property
    def pending(self) -> int:
        """Steps, retries, held records and events not written yet (tests, the heartbeat's state)."""
        return self._steps.qsize() + len(self._retry) + len(self._held) + len(self._events)

    # ---- the I/O thread
    def run(self) -> None:
        closing_at: float | None = None
        while True:
            wait = 0.5 if not (self._retry or self._events) else 0.05
            try:
                step = self._steps.get(timeout=wait) if closing_at is None else self._steps.get_nowait()
            except queue.Empty:
                step = None
            else:
                if step is None:
                    closing_at = time.monotonic()
            if step:
                self._apply(step, counted=True)
            self.retry_due()
            self.flush_events()
            if closing_at is not None and self._steps.empty():
                done = not (self._retry or self._held or self._events)
                if done or time.monotonic() - closing_at > self._close_timeout:
                    if not done:
                        self._give_up_unwritten()
                    return

    def _give_up_unwritten(self) -> None:
        """The outbox closes with writes still retried or held (Redis or SQL away): each is given up, and what it
        names for that (``Record.if_given_up``) tried once, as the thread stops next. That is a SQL write (a job
        marked dispatched whose message never went back to queued), which may land while Redis is away; the stream
        events waiting are lost with the process, so a rerun goes on from what readers saw."""
        unwritten, self._retry, self._held = self._retry + self._held, [], []
        for record in unwritten:
            if record.if_given_up is not None:
                self._try(record.if_given_up)
        log.error("outbox closed with %d writes and %d stream events unwritten",
                  len(unwritten) + len(self._retry) + len(self._held), len(self._events))

    def apply(self, step: StepRecords) -> None:
        """Writes a step not ``put`` (the I/O thread's work, done by its caller)."""
        self._apply(step, counted=False)

    def _apply(self, step: StepRecords, counted: bool) -> None:
        self._queue_events(step.deltas, counted)
        for record in step.records:
            self._try(record)

    def retry_due(self) -> None:
        now = time.monotonic()
        due = [r for r in self._retry if r.not_before <= now]
        if not due:
            return
        self._retry = [r for r in self._retry if r.not_before > now]
        for record in due:
            self._try(record)

    def _try(self, record: Record) -> None:
        if record.job_id is not None and any(r.job_id == record.job_id and r is not record for r in self._retry):
            # a write of the same job waits for a retry: its writes land in the order the engine made them
            record.not_before = max(r.not_before for r in self._retry if r.job_id == record.job_id)
            self._retry.append(record)
            return
        if self._holds(record):
            return
        ok: bool | list[tuple[str, StreamEvent]] | None = True
        if record.write is not None:
            try:
                with session_scope(self.url, immediate=True) as s:
                    ok = record.write(s)
            except Exception as exc:
                record.tries += 1
                if record.tries >= MAX_TRIES:
                    log.error("gave up writing %s after %d tries: %s%s", record.what, record.tries, exc,
                              "; the job leaves this worker and its lease will lapse" if record.leaving else "")
                    self._leave(record)
                    if record.if_given_up is not None:
                        self._try(record.if_given_up)
                    return
                record.not_before = time.monotonic() + min(8.0, 0.5 * 2 ** (record.tries - 1))
                log.warning("could not write %s (try %d, will retry): %s", record.what, record.tries, exc)
                self._retry.append(record)
                return
        if isinstance(ok, list):
            self._queue_events(ok)
        elif ok is not False:
            self._queue_events(record.events)
        self._leave(record)
        if record.then is not None and ok is not False:
            self._try(record.then)

    def _holds(self, record: Record) -> bool:
        """Whether ``record`` waits (held) for the stream events queued before it (``Record.after_events``)."""
        if not record.after_events:
            return False
        if record.events_before is None:  # its turn came: the events of the steps before it are all queued by now
            record.events_before = self._sent + len(self._events)
        if self._sent >= record.events_before:
            return False
        self._held.append(record)
        return True

    def _release_held(self) -> None:
        """Writes the held records whose events before them are published."""
        due = [r for r in self._held if self._sent >= r.events_before]
        if due:
            self._held = [r for r in self._held if self._sent < r.events_before]
            for record in due:
                self._try(record)

    def _leave(self, record: Record) -> None:
        if record.leaving is not None:  # that attempt only: the job may be here again under a newer one
            self.active.pop(record.leaving.job_id, record.leaving.attempt)

    def _count(self, events: list[tuple[str, StreamEvent]]) -> None:
        with self._counting:
            self._unpublished.update(job_id for job_id, _ in events)

    def _queue_events(self, events: list[tuple[str, StreamEvent]], counted: bool = False) -> None:
        self._events.extend(events)
        if not counted:
            self._count(events)
        overflow = len(self._events) - MAX_WAITING_EVENTS
        if overflow > 0:
            for _ in range(overflow):
                self._published(self._events.popleft()[0])
            log.error("dropped the %d oldest stream events waiting for Redis (readers fill the gap from SQL)",
                      overflow)

    def _published(self, job_id: str) -> None:
        self._sent += 1
        with self._counting:
            if (left := self._unpublished[job_id] - 1) > 0:
                self._unpublished[job_id] = left
            else:
                self._unpublished.pop(job_id, None)

    def flush_events(self) -> None:
        """Publishes the waiting events in order; on a Redis error they stay, to be sent again. The records held for
        the events published then are written (``Record.after_events``)."""
        if not self._events or time.monotonic() < self._publish_after:
            return
        try:
            self._publish_waiting()
        finally:
            self._release_held()

    def _publish_waiting(self) -> None:
        while self._events:
            chunk = [self._events[i] for i in range(min(PUBLISH_CHUNK, len(self._events)))]
            try:
                pipe = self.redis.pipeline(transaction=True)  # all of a chunk or none of it
                for job_id, ev in chunk:
                    publish(pipe, job_id, ev)
                pipe.execute()
            except redis.RedisError as exc:
                first = self._publish_backoff == 0.0
                self._publish_backoff = min(2.0, max(0.1, self._publish_backoff * 2))
                self._publish_after = time.monotonic() + self._publish_backoff
                if first:
                    log.warning("streams paused, %d events wait for Redis: %s", len(self._events), exc)
                return
            for _ in chunk:
                self._published(self._events.popleft()[0])
            if self._publish_backoff:
                log.warning("Redis is back: streams resumed")
                self._publish_backoff = 0.0
