"""Telling workers and stream readers about API-side state changes (best effort)."""

from __future__ import annotations

import logging
import time
from functools import lru_cache

import redis

from app.db.models import Job
from app.services.streaming import CANCEL_CHANNEL, KEPT_FOLLOWS, StreamEvent, publish, stream_key

log = logging.getLogger(__name__)


@lru_cache(maxsize=8)
def redis_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=2.0)


def announce_cancel(redis_url: str | None, job: Job, held: bool = False) -> str | None:
    """Ends the job's stream and asks its worker to abort it; workers also poll SQL. Returns the id of the
    stream's end event (None without Redis, or where Redis could not be told). ``held``: a worker ran the job, and
    writes what it keeps (its text so far and its usage) after this end, with a ``kept`` event: the end says so,
    and followers read on to it (``streaming.follow_job``)."""
    if not redis_url:
        return None
    try:
        pipe = redis_client(redis_url).pipeline()
        _queue_cancel(pipe, job.id, job.attempt, job.status, held)
        end_id = pipe.execute()[0]
        return end_id.decode() if isinstance(end_id, bytes) else end_id
    except redis.RedisError as exc:
        log.warning("could not announce cancel of %s: %s", job.id, exc)
        return None


def announce_cancels(redis_url: str | None, jobs: list[tuple[str, int]], status: str) -> None:
    """``announce_cancel`` for many (job id, attempt) pairs that ended as ``status``, in one Redis round trip."""
    if not redis_url or not jobs:
        return
    try:
        pipe = redis_client(redis_url).pipeline(transaction=False)
        for job_id, attempt in jobs:
            _queue_cancel(pipe, job_id, attempt, status, False)
        pipe.execute()
    except redis.RedisError as exc:  # their workers still see the cancel in SQL
        log.warning("could not announce the cancel of %d jobs: %s", len(jobs), exc)


def _queue_cancel(pipe: redis.client.Pipeline, job_id: str, attempt: int, status: str, held: bool) -> None:
    """Queues on ``pipe`` the end of the job's stream and the word to its worker."""
    publish(pipe, job_id, StreamEvent("end", attempt=attempt, status=status, finish_reason="cancelled",
                                      data={KEPT_FOLLOWS: True} if held else {}))
    pipe.publish(CANCEL_CHANNEL, job_id)


def await_kept(redis_url: str, job: Job, end_id: str, timeout_s: float) -> bool:
    """Waits (at most ``timeout_s``) for the worker that ran the job's attempt to say, with a ``kept`` event on
    the job's stream, that it stopped the job and wrote what the attempt produced. False: no word in time."""
    client, key = redis_client(redis_url), stream_key(job.id)
    deadline = time.monotonic() + timeout_s

    def kept(entries: list) -> bool:
        return any((ev := StreamEvent.parse(fields)).type == "kept" and ev.attempt == job.attempt
                   for _id, fields in entries)
    try:
        # a worker that saw the cancel in SQL before the end was published wrote its word just before it
        if kept(client.xrevrange(key, count=4)):
            return True
        after = end_id
        while (left := deadline - time.monotonic()) > 0:
            # blocks under the client's socket timeout (2 s)
            for _key, entries in client.xread({key: after}, count=64, block=max(1, int(min(left, 1.0) * 1000))):
                if kept(entries):
                    return True
                after = entries[-1][0]
    except redis.RedisError as exc:
        log.warning("could not hear whether the worker stopped %s: %s", job.id, exc)
    return False
