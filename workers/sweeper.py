"""The sweeper: requeues jobs whose lease expired, (re)sends jobs nobody took, gives the jobs routed to a worker
that died back to their model's queue, and settles the stopped jobs whose worker died before writing them.

It runs as a thread in every GPU worker (every ``sweep_seconds``); all its changes are
guarded updates, so several workers sweeping at once is safe.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from datetime import timedelta

import redis
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from app.db.models import Job, JobStatus, WorkerState
from app.services.lora_adapters import queue_models
from app.services.dispatch import dispatch, send_back, send_back_all, send_to
from app.services.notify import redis_client
from app.services.routing import WORKER_QUEUE_PREFIX, WORKER_QUEUES
from app.services.streaming import StreamEvent, publish
from app.services.transitions import ACTIVE, as_utc, transition, utcnow
from workers import lease as leases
from workers.taken import take_back, takers
from workers.celery_app import BATCH_PRIORITY, message_priority, queue_lists, queue_name

log = logging.getLogger(__name__)

_JOB_ID = re.compile(rb"job_[0-9a-f]{24}")  # the id in a message's headers (argsrepr), as new_id("job") makes it
QUEUE_SCAN_CAP = 20_000  # a longer queue is a real backlog: its messages are not lost, do not scan it


@dataclass
class SweepResult:
    requeued: int = 0  # leases expired -> queued
    failed: int = 0  # leases expired on the last allowed attempt -> failed (a job that kills workers)
    dispatched: int = 0  # queued jobs sent
    resent: int = 0  # dispatched, never leased, message lost (its holder died or it left the queue): sent again
    rerouted: int = 0  # waiting on the own queue of a worker that is gone: sent to the model's queue
    settled: int = 0  # stopped by the API while a worker held them, whose lease expired before it wrote them


def sweep(session: Session, redis_url: str, *, queued_grace_s: float = 2.0, resend_after_s: float = 300.0,
          holder_stale_s: float = 30.0, silent_s: float = 30.0, max_attempts: int = 5, limit: int = 500,
          served: tuple[str, ...] = ()) -> SweepResult:
    """``holder_stale_s``: how long after its heartbeat a worker that marked a dispatched job held loses it (a lease);
    ``silent_s``: how long after it a worker is lost to routing, its own queue given to its model's
    (``routing.live_seconds``). ``served``: the models (a model and its LoRA adapters) whose queues the sweeping
    worker consumes; a job given back to any of them counts as queued (a worker of an older coserve gave an adapter's
    job back to its model's queue)."""
    result = SweepResult()
    now = utcnow()
    expired = session.execute(select(Job.id, Job.status, Job.attempt, Job.worker_id).where(
        Job.status.in_([s.value for s in ACTIVE]), Job.lease_expires_at < now).limit(limit)).all()
    ended: list[tuple[str, StreamEvent]] = []
    for job in expired:
        to, end = give_back_lost(session, job, max_attempts, where=[Job.lease_expires_at < now],
                                 detail=f"lease of {job.worker_id} expired")
        result.requeued += to is JobStatus.QUEUED
        result.failed += to is JobStatus.FAILED
        ended += [(job.id, end)] if end else []
    result.settled = leases.settle_lapsed(session, now, limit)
    session.commit()
    end_streams(redis_url, ended)  # stream readers (SSE) of the jobs failed here stop waiting
    if result.settled:
        log.info("settled %d stopped jobs whose worker died before writing what it produced", result.settled)
    if result.requeued or result.failed:
        log.warning("requeued %d jobs whose lease expired; failed %d on their last attempt",
                    result.requeued, result.failed)
    # queued: never sent (broker was down) or given back; a short grace lets the API send first
    queued = session.execute(select(Job.id, Job.model, Job.kind, Job.attempt).where(
        Job.status == JobStatus.QUEUED.value, Job.created_at < now - timedelta(seconds=queued_grace_s))
        .order_by(Job.created_at).limit(limit)).all()
    queues = queue_models(session, {j.model for j in queued})  # a runtime LoRA adapter's jobs: its model's queue
    # A job given back (it ran: its lease expired) goes to the head, the oldest ending first; one never sent (the
    # broker was down) to the tail, in order: a bulk of them goes out over several sweeps, and at the head each
    # sweep's share would go before the earlier ones still waiting
    order = [(j, send_back) for j in reversed(queued) if j.attempt] + [(j, send_to) for j in queued if not j.attempt]
    for job, send in order:
        if not dispatch(session, redis_url, job.id, queues[job.model], detail="sent by the sweeper",
                        priority=message_priority(job.kind), send=send):
            break  # the broker is down: try again next sweep
        result.dispatched += 1
    result.rerouted = _reroute_orphaned(session, redis_url, now - timedelta(seconds=silent_s))
    result.resent = _resend_lost(session, redis_url, now, resend_after_s, holder_stale_s, limit, served)
    session.commit()
    return result


def give_back_lost(session: Session, job, max_attempts: int, *, where: list, detail: str, cause: str | None = None
                   ) -> tuple[JobStatus | None, StreamEvent | None]:
    """Gives back a job its worker lost (``job``: a row with id, status, attempt and worker_id; its lease expired, or
    an operator resumed it once that worker stopped beating) where ``where`` still holds: queued for another worker
    (the sweep sends it; a caller may send it at once), or failed where that was its last allowed attempt (a job that
    kills workers), with the end its stream readers are sent (``end_streams``, after the commit). None where someone
    moved it meanwhile. ``detail``: the requeue's event. ``cause``: why its last attempt ended, which a failure's
    error tells its tenant (default: its lease expired, as the sweeper finds it). The caller commits."""
    now = utcnow()
    if job.attempt >= max_attempts:
        cause = cause or f"the lease of every worker that ran it expired (last {job.worker_id})"
        error = f"gave up after {job.attempt} attempts: {cause}"
        if transition(session, job.id, JobStatus(job.status), JobStatus.FAILED, attempt=job.attempt, where=where,
                      detail=error, values={"worker_id": None, "lease_expires_at": None, "error": error,
                                            "finished_at": now, "settled_at": now}):
            return JobStatus.FAILED, StreamEvent("end", job.attempt, status="failed", data={"error": error})
        return None, None
    if transition(session, job.id, JobStatus(job.status), JobStatus.QUEUED, attempt=job.attempt, where=where,
                  values={"worker_id": None, "lease_expires_at": None}, detail=detail):
        return JobStatus.QUEUED, None
    return None, None


def _reroute_orphaned(session: Session, redis_url: str, stale_before) -> int:
    """Sends the jobs a worker that stopped beating left to their model's queue: those waiting on its own queue
    (prefix routing's), and the one whose message its consumer took, off any queue, and never acked
    (``workers.taken``); returns how many were sent."""
    try:
        queues = [q.decode() for q in redis_client(redis_url).smembers(WORKER_QUEUES)]
        holders = takers(redis_url)
    except redis.RedisError as exc:
        log.warning("could not read the workers' own queues (%s); rerouting nothing this sweep", exc)
        return 0
    if not queues and not holders:
        return 0
    live = set(session.scalars(select(WorkerState.id).where(WorkerState.heartbeat_at >= stale_before)))
    lost = [q for q in queues if q.removeprefix(WORKER_QUEUE_PREFIX) not in live]
    held = take_back(redis_url, [w for w in holders if w not in live])
    ids = _taken_off(redis_url, set(lost)) | held_jobs(held)
    return reroute(session, redis_url, lost, taken=ids) if lost or ids else 0


def held_jobs(messages: list[bytes]) -> set[str]:
    """The ids of the jobs of ``messages`` (kombu's raw messages: the id is in their headers)."""
    return {m.decode() for raw in messages for m in _JOB_ID.findall(raw)}


def _taken_off(redis_url: str, queues: set[str]) -> set[str]:
    """The jobs whose messages the consumers of lost workers took off their own ``queues`` and never acked (killed
    before the job was leased): kombu's Redis transport keeps such a message in its unacked hash, which only its
    visibility timeout (an hour) restores, and the job, dispatched with no worker, waited for the lost-message rule.
    Each entry is removed by the one sweeper whose HDEL takes it, which returns its job (sent again, where still
    dispatched unleased, by ``reroute``). A message taken off the model's queue names no worker here: the worker's
    record of the message in hand finds it (``workers.taken``); this finds one a worker took before it recorded it,
    or one an older worker took."""
    from kombu.transport.redis import Channel

    ids: set[str] = set()
    if not queues:
        return ids
    try:
        client = redis_client(redis_url)
        for tag, raw in client.hscan_iter(Channel.unacked_key):
            try:
                _message, _exchange, routing_key = json.loads(raw)  # Celery sends to a queue by its name as key
            except ValueError:
                continue
            if routing_key in queues and client.hdel(Channel.unacked_key, tag):
                client.zrem(Channel.unacked_index_key, tag)
                ids |= held_jobs([raw])
    except redis.RedisError as exc:  # the ones left: sent again later as lost (_resend_lost)
        log.warning("could not read the messages lost workers took (%s)", exc)
    return ids


def reroute(session: Session, redis_url: str, queues: list[str], taken: set[str] | None = None) -> int:
    """Sends the jobs waiting on workers' own ``queues`` to their model's queue and removes those queues (a worker
    that stopped, died or drains), and ``taken`` (jobs whose messages a lost worker took and never leased) with them;
    returns how many were sent."""
    ids: set[str] = set(taken or ())
    try:
        client = redis_client(redis_url)
        for queue in queues:
            # in one transaction: no one's to look after any more, what waits there read, the list and the binding
            # kombu declared for it removed. A job sent there after it makes a new list, which its sender names again
            # (app.services.dispatch) for the next sweep
            pipe = client.pipeline(transaction=True)
            pipe.srem(WORKER_QUEUES, queue)
            for key in queue_lists(queue):
                pipe.lrange(key, 0, -1)
            pipe.delete(*queue_lists(queue), f"_kombu.binding.{queue}")
            _named, *waiting, _deleted = pipe.execute()
            ids.update(m.decode() for raws in waiting for raw in raws for m in _JOB_ID.findall(raw))
    except redis.RedisError as exc:
        log.warning("could not read the workers' own queues (%s); rerouting nothing this time", exc)
        return 0
    waiting = session.execute(select(Job.id, Job.model, Job.kind, Job.created_at).where(
        Job.id.in_(ids), Job.status == JobStatus.DISPATCHED.value, Job.worker_id.is_(None))
        .order_by(Job.created_at, Job.id)).all() if ids else []
    # the interactive ones waited in line since before the model's newer messages came: to the head, the oldest taken
    # first; the batch ones in their turn by age among the model's (a message a dead worker's queue lost here is
    # sent again later as lost: _resend_lost)
    interactive = [j for j in waiting if message_priority(j.kind) != BATCH_PRIORITY]
    sent = len(send_back_all(redis_url, back_to_queues(session, interactive)))
    sent += len(_back_in_turn(session, redis_url, [j for j in waiting if message_priority(j.kind) == BATCH_PRIORITY]))
    if queues:
        log.info("removed the own queues of %d workers that are gone or draining; sent their %d waiting jobs to the "
                 "models' queues", len(queues), sent)
    return sent


def _back_in_turn(session: Session, redis_url: str, jobs) -> list[str]:
    """Sends batch ``jobs`` (rows with id, model, kind, created_at; oldest first) to their model queue's batch list in
    their turn by age: ahead of the jobs waiting there submitted after them, behind those submitted before (those
    wait for their own deadlines, and a dead worker's backlog at the head would make them wait behind all of it).
    Returns the ids sent; a list too long to read gets them at its head (a backlog's order is not read)."""
    sent: list[str] = []
    by_queue: dict[str, list] = {}
    for job, (_id, queue, _priority) in zip(jobs, back_to_queues(session, jobs)):
        by_queue.setdefault(queue, []).append(job)
    for queue, group in by_queue.items():
        try:
            key = queue_lists(queue)[1]
            client = redis_client(redis_url)
            raws = client.lrange(key, 0, -1) if client.llen(key) <= QUEUE_SCAN_CAP else None
        except redis.RedisError as exc:  # not sent: resent later as lost (_resend_lost)
            log.warning("could not read %s (%s); its rerouted batch jobs are sent later", queue, exc)
            continue
        if raws is None:
            sent += send_back_all(redis_url, [(j.id, queue, BATCH_PRIORITY) for j in group])
            continue
        # the waiting messages in the order consumers take them (kombu: BRPOP, the right end first), with their jobs
        line = [(raw, found[0].decode()) for raw in reversed(raws) if (found := _JOB_ID.findall(raw))]
        submitted = {i: (as_utc(at), i) for i, at in session.execute(
            select(Job.id, Job.created_at).where(Job.id.in_({i for _raw, i in line})))}
        for job in group:
            turn = (as_utc(job.created_at), job.id)
            # the first waiting message of a job submitted after this one: it goes just ahead of it, else at the tail
            later = next((raw for raw, i in line if i in submitted and submitted[i] > turn), None)
            ok = (send_back(redis_url, job.id, queue, BATCH_PRIORITY, before=later) if later is not None
                  else send_to(redis_url, job.id, queue, BATCH_PRIORITY))
            if not ok:
                break  # the broker is down: the rest are resent later as lost
            sent.append(job.id)
    return sent


def _resend_lost(session: Session, redis_url: str, now, resend_after_s: float, holder_stale_s: float,
                 limit: int, served: tuple[str, ...] = ()) -> int:
    """Sends again the dispatched jobs whose message is lost, not merely old ones (a batch backlog
    keeps jobs dispatched for hours, and a copy per sweep would flood the queue):

    * held: a worker marked the dispatched row (``worker_id``) as it waited for engine room with the message in
      hand, as workers did before they handed such a message back at once (a mark an older worker left in a rolling
      upgrade); lost when that worker's heartbeat is stale (killed: the message sits unacked in Redis until the
      visibility timeout);
    * unheld, dispatched for ``resend_after_s``, and not in the model's queue (e.g. a worker died
      between taking the message and marking it, or Redis lost it).
    """
    stale_before = now - timedelta(seconds=holder_stale_s)
    held = session.execute(
        select(Job.id, Job.model, Job.kind, Job.created_at, Job.worker_id)
        .outerjoin(WorkerState, WorkerState.id == Job.worker_id)
        .where(Job.status == JobStatus.DISPATCHED.value, Job.worker_id.is_not(None),
               or_(WorkerState.id.is_(None), WorkerState.heartbeat_at < stale_before)).limit(limit)).all()
    unheld = session.execute(select(Job.id, Job.model, Job.kind, Job.created_at).where(
        Job.status == JobStatus.DISPATCHED.value, Job.worker_id.is_(None),
        Job.dispatched_at < now - timedelta(seconds=resend_after_s)).limit(limit)).all()
    lost = {j.id: (j, f"its holder {j.worker_id} stopped beating") for j in held}
    if unheld:
        waiting = _queued_ids(redis_url, {j.model for j in unheld} | set(served))
        lost |= {j.id: (j, "its message left the queue unprocessed") for j in unheld
                 if waiting is not None and j.id not in waiting}
    # a lost message had its place in line (a holder took it from the head): back to the head, oldest taken first
    jobs = sorted((j for j, _why in lost.values()), key=lambda j: (j.created_at, j.id))
    resent = send_back_all(redis_url, back_to_queues(session, jobs))
    for job_id in resent:
        session.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.DISPATCHED.value)
                        .values(dispatched_at=utcnow(), worker_id=None).execution_options(synchronize_session=False))
        log.info("resent job %s: %s", job_id, lost[job_id][1])
    return len(resent)


def back_to_queues(session: Session, jobs) -> list[tuple[str, str, int]]:
    """What ``send_back_all`` hands back of ``jobs`` (rows with id, model, kind): each to its model's queue (a
    configured LoRA adapter's to its own, a runtime adapter's to its base model's), at its kind's priority: the rule
    dispatch sends by (``lora_adapters.queue_model``), for every job handed back (sweeps, a stopping worker)."""
    models = queue_models(session, {j.model for j in jobs})
    return [(j.id, queue_name(models[j.model]), message_priority(j.kind)) for j in jobs]


def _queued_ids(redis_url: str, models: set[str]) -> set[str] | None:
    """Ids of the jobs whose message waits in the models' queues or a worker's own; None when unknown (Redis down,
    or a queue too long to scan: a long queue is a backlog, and its messages are not lost)."""
    try:
        client = redis_client(redis_url)
        ids: set[str] = set()
        for key in (key for model in models for key in queue_lists(queue_name(model))):
            if client.llen(key) > QUEUE_SCAN_CAP:
                return None
            for raw in client.lrange(key, 0, -1):
                ids.update(m.decode() for m in _JOB_ID.findall(raw))
        for queue in client.smembers(WORKER_QUEUES):  # the workers' own (prefix routing's)
            for key in queue_lists(queue.decode() if isinstance(queue, bytes) else queue):
                for raw in client.lrange(key, 0, QUEUE_SCAN_CAP):
                    ids.update(m.decode() for m in _JOB_ID.findall(raw))
        return ids
    except redis.RedisError as exc:
        log.warning("could not read the queues (%s); resending nothing unheld this sweep", exc)
        return None


def end_streams(redis_url: str, events: list[tuple[str, StreamEvent]]) -> None:
    if not events or not redis_url:
        return
    try:
        pipe = redis_client(redis_url).pipeline(transaction=False)
        for job_id, ev in events:
            publish(pipe, job_id, ev)
        pipe.execute()
    except redis.RedisError as exc:  # best effort: readers also poll SQL
        log.warning("could not end the streams of %d failed jobs: %s", len(events), exc)
