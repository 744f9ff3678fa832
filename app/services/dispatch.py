"""Sending jobs to the workers' queues, after the job row is committed.

A job goes on its model's queue, or on one worker's where prefix routing chose it (``app.services.routing``). A
send that fails (broker down) leaves the job ``queued``; the sweeper dispatches it later, so an accepted job is
never lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple
from uuid import uuid4

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import Job, JobStatus
from app.db.session import session_scope, write_after_read, write_guard
from app.services import routing
from app.services.notify import redis_client
from app.services.routing import WORKER_QUEUE_PREFIX, WORKER_QUEUES
from app.services.transitions import transition, utcnow
from workers.celery_app import (
    BATCH_PRIORITY,
    INTERACTIVE_PRIORITY,
    RUN_JOB,
    get_celery,
    message_priority,
    queue_lists,
    queue_name,
)

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger(__name__)

# A short retry: the API answers quickly during a broker outage and the sweeper retries.
SEND_RETRY = {"max_retries": 2, "interval_start": 0.0, "interval_step": 0.2, "interval_max": 0.5}


def send_to(redis_url: str, job_id: str, queue: str, priority: int = INTERACTIVE_PRIORITY,
            task_id: str | None = None) -> bool:
    """Sends ``job_id`` on the queue named ``queue`` at ``priority`` (``message_priority`` of its kind); False where
    the broker could not take it."""
    try:
        get_celery(redis_url).send_task(RUN_JOB, args=[job_id], queue=queue, retry=True, retry_policy=SEND_RETRY,
                                        priority=priority, task_id=task_id)
    except Exception as exc:  # kombu raises OperationalError and socket errors alike
        log.warning("could not send job %s to the broker (%s); it stays queued for the sweeper", job_id, exc)
        return False
    _look_after(redis_url, [queue])
    return True


def send_routed(settings: Settings, model: str) -> Callable[[str, str, str, int], bool]:
    """``send_to`` for a job of ``model`` that ``routing.job_queue`` routed: the queue checked as it sends
    (``routing.at_send``: the worker it names may have stopped since the view it was picked by)."""
    def send(redis_url: str, job_id: str, queue: str, priority: int) -> bool:
        return send_to(redis_url, job_id, routing.at_send(settings, model, queue), priority)
    return send


def _look_after(redis_url: str, queues: list[str]) -> None:
    """Names the workers' own queues among ``queues`` to the sweepers, after a send to them. A process routes by a
    view of the workers up to ``REFRESH_S`` old, so its send may land on the queue of a worker that a sweeper has
    just dropped (or that has just stopped); named again, the next sweep gives that job to its model's queue."""
    own = {q for q in queues if q.startswith(WORKER_QUEUE_PREFIX)}
    if not own:
        return
    try:
        redis_client(redis_url).sadd(WORKER_QUEUES, *own)
    except redis.RedisError as exc:  # the message is sent; if it is lost, the sweeper resends it later
        log.warning("could not name the workers' queues %s to the sweepers (%s)", sorted(own), exc)


def send_job(redis_url: str, job_id: str, model_name: str, priority: int = INTERACTIVE_PRIORITY) -> bool:
    """Sends ``job_id`` on its model's queue, which every worker of the model consumes."""
    return send_to(redis_url, job_id, queue_name(model_name), priority)


# Moves the message whose text holds ARGV[1] (its task id) from near the newest end of list KEYS[1], where kombu pushed
# it, to just before message ARGV[3] in the order consumers take them (LINSERT AFTER: consumers pop the right end), or
# to the end they pop next where ARGV[3] is empty or was taken meanwhile. Reads from the newest end, ARGV[2] messages at
# a time, until it finds it: a read as long as the messages pushed after it, however many (its end: it is not there,
# a consumer took it)
_MOVE = """
local step = tonumber(ARGV[2])
local first = 0
while true do
  local chunk = redis.call('LRANGE', KEYS[1], first, first + step - 1)
  if #chunk == 0 then return 0 end
  for _, m in ipairs(chunk) do
    if string.find(m, ARGV[1], 1, true) then
      redis.call('LREM', KEYS[1], 1, m)
      if ARGV[3] == '' or redis.call('LINSERT', KEYS[1], 'AFTER', ARGV[3], m) < 0 then
        redis.call('RPUSH', KEYS[1], m)
      end
      return 1
    end
  end
  first = first + step
end
"""
MOVE_SCAN_STEP = 64  # messages the move reads at a time


def send_back(redis_url: str, job_id: str, queue: str, priority: int = INTERACTIVE_PRIORITY,
              before: bytes | None = None, task_id: str | None = None) -> bool:
    """Hands a taken job's message back to ``queue`` where it was: at the head of its priority's list (the next
    message a consumer takes), not behind the messages that came after it; or, given ``before`` (a message waiting
    there), just ahead of that one. kombu's Redis transport pushes a message at the tail (LPUSH, consumers BRPOP)
    and so does Celery's requeue (``Reject(requeue=True)``: LPUSH too), so the message is sent as usual and then
    moved (``move``). False where the broker could not take it; True (at the tail) where only the move failed.
    ``task_id``: the message's (None: a new one), known to a caller that may have to finish an interrupted
    hand-back (``move`` it, if it was pushed) instead of sending a second message."""
    task_id = task_id or uuid4().hex
    if not send_to(redis_url, job_id, queue, priority, task_id=task_id):
        return False
    try:
        move(redis_url, queue, priority, task_id, before)
    except redis.RedisError as exc:  # sent: it only waits behind the newer messages
        log.warning("job %s went back to the tail of %s (%s)", job_id, queue, exc)
    return True


def move(redis_url: str, queue: str, priority: int, task_id: str, before: bytes | None = None) -> bool:
    """Moves the message of ``task_id`` on ``queue``'s list of ``priority`` to its head, or just ahead of message
    ``before`` where that still waits, in one Lua script (however many messages were pushed after it meanwhile);
    False where it is not there (a consumer took it)."""
    interactive, batch = queue_lists(queue)
    return bool(redis_client(redis_url).eval(_MOVE, 1, batch if priority == BATCH_PRIORITY else interactive,
                                             task_id, MOVE_SCAN_STEP, before or b""))


def send_back_all(redis_url: str, jobs: list[tuple[str, str, int]]) -> list[str]:
    """Hands the messages of ``jobs`` (job id, queue name, priority), given oldest first, back to the heads of their
    lists (``send_back``) in that order: the newest goes first, so the oldest ends up the next taken, and all of them
    before the messages that came after them. Returns the ids sent; stops at the first the broker refuses (the older
    ones left go to the head later, still before the newer)."""
    sent: list[str] = []
    for job_id, queue, priority in reversed(jobs):
        if not send_back(redis_url, job_id, queue, priority):
            break
        sent.append(job_id)
    return sent


def _queue(app, name: str):
    """The kombu Queue ``name`` from Celery's queue map (added on first use, as send_task does)."""
    queues = app.amqp.queues
    return queues[name] if name in queues else queues.select_add(name)


def send_jobs(redis_url: str, jobs: list[tuple[str, str, int]]) -> list[str]:
    """Sends (job_id, queue name, priority) on one producer; returns the ids sent, in order.

    The fast path buffers the messages in kombu's publish batch (one Redis pipeline, one
    round trip instead of one per job) without kombu's retry wrapper. If it fails, every
    job is sent again one by one with retries (a message the pipeline had already pushed
    is then sent twice, which is harmless: only one delivery can lease the job in SQL);
    a second failure stops (the broker is down; the rest stay for the sweeper).
    """
    app = get_celery(redis_url)
    amqp = app.amqp
    try:
        with app.producer_or_acquire() as producer, producer.batch(max_size=len(jobs) + 1):
            for job_id, queue, priority in jobs:
                # Celery's message layer directly (what send_task calls once it has routed the
                # task): the queue is known and results are ignored, and it costs ~40% less
                # CPU per message than send_task; argsrepr given instead of a saferepr each time
                message = amqp.create_task_message(uuid4().hex, RUN_JOB, [job_id], {},
                                                   argsrepr=f"['{job_id}']", kwargsrepr="{}")
                amqp.send_task_message(producer, RUN_JOB, message, queue=_queue(app, queue), retry=False,
                                       priority=priority)
        _look_after(redis_url, [queue for _job_id, queue, _priority in jobs])
        return [job_id for job_id, _queue, _priority in jobs]
    except Exception as exc:
        log.info("batched send of %d jobs failed (%s); sending one by one", len(jobs), exc)
    sent: list[str] = []
    for job_id, queue, priority in jobs:
        if not send_to(redis_url, job_id, queue, priority):
            break
        sent.append(job_id)
    return sent



class Sendable(NamedTuple):
    """What a send reads of a job (``sending``), for a caller holding its column values rather than a ``Job`` (the
    batch fan-out's rows)."""

    id: str
    model: str
    route_key: str | None
    kind: str

    @classmethod
    def of(cls, values: dict[str, Any]) -> Sendable:
        return cls(values["id"], values["model"], values["route_key"], values["kind"])


def sending(settings: Settings, job: Job | Sendable) -> tuple[str, str, int]:
    """What ``send_jobs`` sends of ``job``: its id, the queue routing picks, its kind's priority."""
    return job.id, routing.job_queue(settings, job.model, job.route_key, job.kind), message_priority(job.kind)


def send_dispatched(settings: Settings, jobs: list[Job] | list[Sendable]) -> None:
    """Sends committed ``dispatched`` jobs in one batched send; the ones not sent (the broker refused them, or
    routing could not read SQL) go back to ``queued``, where the workers' sweeper picks them up. Raises nothing."""
    if not jobs or not settings.redis_url:
        return
    try:
        sent = set(send_jobs(settings.redis_url, [sending(settings, job) for job in jobs]))
    except Exception:  # routing reads SQL (live workers, runtime adapters)
        log.exception("could not send %d jobs; they go back to the queue for the sweeper", len(jobs))
        sent = set()
    unsent = [job.id for job in jobs if job.id not in sent]
    if not unsent:
        return
    try:
        with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
            for job_id in unsent:
                transition(s, job_id, JobStatus.DISPATCHED, JobStatus.QUEUED,
                           detail="broker unavailable; the sweeper will send it")
    except Exception:  # left dispatched: the sweeper's lost-message rule sends them
        log.exception("could not mark %d unsent jobs queued", len(unsent))


def mark_dispatched(session: Session, job_id: str, detail: str | None = None) -> bool:
    """Marks a committed ``queued`` job ``dispatched`` (commits), before its message is sent: a worker may lease it
    as soon as the message lands, and the sweeper sends only ``queued`` jobs (and lost messages). False where someone
    else moved it on: nothing to send."""
    with write_after_read(session):
        marked = transition(session, job_id, JobStatus.QUEUED, JobStatus.DISPATCHED, detail=detail,
                            values={"dispatched_at": utcnow()})
        session.commit()
    return marked


def kind_priority(session: Session, job_id: str) -> int:
    """The message priority of ``job_id``'s kind (``message_priority``), read from its row."""
    return message_priority(session.scalar(select(Job.kind).where(Job.id == job_id)))


def dispatch(session: Session, redis_url: str, job_id: str, model_name: str, *, detail: str | None = None,
             queue: str | None = None, priority: int | None = None,
             send: Callable[[str, str, str, int], bool] = send_to) -> bool:
    """Mark a committed ``queued`` job ``dispatched``, then send it (commits) on ``queue`` (a queue name; None: the
    model's) at ``priority`` (None: its kind's, read from its row), with ``send``: ``send_to`` (behind the messages
    waiting) or ``send_back`` (a job given back: ahead of them, its place kept).

    Marking first keeps the events in order (a worker may lease the job as soon as the
    message lands); a failed send moves it back to ``queued`` for the sweeper.
    """
    if not mark_dispatched(session, job_id, detail):
        return True  # someone else moved it on; nothing to send
    if priority is None:
        priority = kind_priority(session, job_id)
    if send(redis_url, job_id, queue or queue_name(model_name), priority):
        return True
    with write_guard(session):
        transition(session, job_id, JobStatus.DISPATCHED, JobStatus.QUEUED,
                   detail="broker unavailable; the sweeper will send it")
        session.commit()
    return False
