"""Telling workers and stream readers about API-side state changes (best effort)."""

from __future__ import annotations

import logging
from functools import lru_cache

import redis

from app.db.models import Job
from app.services.streaming import CANCEL_CHANNEL, StreamEvent, publish

log = logging.getLogger(__name__)


@lru_cache(maxsize=8)
def redis_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=2.0)


def announce_cancel(redis_url: str | None, job: Job) -> None:
    """Ends the job's stream and asks its worker to abort it; workers also poll SQL."""
    if not redis_url:
        return
    try:
        client = redis_client(redis_url)
        pipe = client.pipeline()
        publish(pipe, job.id, StreamEvent("end", attempt=job.attempt, status=job.status, finish_reason="cancelled"))
        pipe.publish(CANCEL_CHANNEL, job.id)
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("could not announce cancel of %s: %s", job.id, exc)
