"""Following a job from an API request: its events, its end, and cancelling it for a client
that went away.

Redis carries the job's tokens as they come (``follow_job``); SQL is the record. Whenever the
stream cannot say how a job ended (Redis away, text lost), SQL's end event does: it holds the
whole ``output_text``, and a consumer sends what its client lacks from it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi.concurrency import run_in_threadpool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from app.db.models import Job, JobStatus
from app.db.session import session_scope
from app.services import jobs as job_service
from app.services.notify import announce_cancel
from app.services.streaming import OUTAGE_ERRORS, USAGE, StreamEvent, follow_job, stream_key
from app.settings import Settings

log = logging.getLogger(__name__)

POLL_S = 0.1  # SQL polling interval when no Redis is configured
FALLBACK_POLL_S = 0.5  # the same once the stream could not be read (a rare, slower path)
BLOCK_MS = 500  # one blocking stream read; SQL is asked after a silent one


def sql_end_event(url: str, job_id: str) -> StreamEvent | None:
    """SQL's view: an ``end`` event if the job is terminal (with its whole text), else None."""
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        if job is None or not JobStatus(job.status).terminal:
            return None
        return StreamEvent("end", attempt=job.attempt, status=job.status, finish_reason=job.finish_reason,
                           data={**{k: getattr(job, k) for k in USAGE},
                                 "output_text": job.output_text or "", "error": job.error, "code": job.error_code,
                                 "logprobs": job.output_logprobs, "prompt_logprobs": job.prompt_logprobs,
                                 "output_token_ids": job.output_token_ids, "stop_reason": job.stop_reason,
                                 "from_sql": True})


def rest_from_sql(end: StreamEvent, delivered: int, logprobs_sent: int) -> tuple[str, list[dict] | None]:
    """What a follower has not yet sent of a job SQL reports ended (``end.data["from_sql"]``): the rest of its
    text after ``delivered`` characters, and of its token logprobs after ``logprobs_sent`` (None: none asked)."""
    logprobs = end.data.get("logprobs")
    return (end.data.get("output_text") or "")[delivered:], None if logprobs is None else logprobs[logprobs_sent:]


def rest_ids_from_sql(end: StreamEvent, ids_sent: int) -> list[int]:
    """The generated token ids after the first ``ids_sent`` of a job SQL reports ended ([] for a job that ended
    before its worker kept every job's ids, where it did not ask ``return_token_ids``)."""
    return (end.data.get("output_token_ids") or [])[ids_sent:]


async def job_events(settings: Settings, job_id: str) -> AsyncIterator[StreamEvent]:
    """The job's events until its ``end`` (or an ``error``: the stream stayed unreadable).

    From the Redis stream, riding out outages up to ``settings.stream_outage_s``; from SQL alone
    when no Redis is configured. An end with ``data["from_sql"]`` carries the whole text."""
    url = settings.sqlalchemy_url
    if not settings.redis_url:
        while (end := await run_in_threadpool(sql_end_event, url, job_id)) is None:
            await asyncio.sleep(POLL_S)
        yield end
        return

    async def sql_end() -> StreamEvent | None:
        return await run_in_threadpool(sql_end_event, url, job_id)

    # one quick retry for a pooled connection that died with a restarted server; follow_job paces
    # the retries over an outage itself. The socket timeout bounds a read from a vanished host.
    client = aioredis.Redis.from_url(settings.redis_url, retry=Retry(NoBackoff(), 1), socket_connect_timeout=2.0,
                                     socket_timeout=BLOCK_MS / 1000 + 5.0)
    try:
        async for ev in follow_job(client, job_id, block_ms=BLOCK_MS, sql_end=sql_end,
                                   outage_limit_s=settings.stream_outage_s, kept_wait_s=settings.cancel_wait_s):
            yield ev
    finally:
        await client.aclose()


async def stream_expired(settings: Settings, job_id: str) -> bool:
    """Whether the job's Redis stream is gone (it expires ``STREAM_TTL_S`` after the job's end); False where there
    is no Redis (SQL alone answers the same every time) or it cannot be asked."""
    if not settings.redis_url:
        return False
    client = aioredis.Redis.from_url(settings.redis_url, socket_connect_timeout=2.0, socket_timeout=5.0)
    try:
        return not await client.exists(stream_key(job_id))
    except OUTAGE_ERRORS:
        return False
    finally:
        await client.aclose()


async def wait_for_end(settings: Settings, job_id: str) -> StreamEvent:
    """SQL's end event of the job, once it has one.

    The stream says when to look (promptly, without polling); when it cannot (Redis away too
    long, any error reading it), SQL is polled until the job ends."""
    try:
        async for ev in job_events(settings, job_id):
            if ev.type in ("end", "error"):
                break
    except Exception as exc:  # noqa: BLE001 - any failure of the stream leaves SQL to ask
        log.warning("following job %s failed (%s); waiting on SQL", job_id, exc)
    while (end := await run_in_threadpool(sql_end_event, settings.sqlalchemy_url, job_id)) is None:
        await asyncio.sleep(FALLBACK_POLL_S)
    return end


def cancel_abandoned(settings: Settings, job_id: str, detail: str) -> None:
    """The client went away before the answer was done: stop generating for nobody."""
    try:
        with session_scope(settings.sqlalchemy_url) as s:
            job = s.get(Job, job_id)
            if job is not None and not JobStatus(job.status).terminal:
                if job_service.cancel_job(s, job, detail=detail):
                    announce_cancel(settings.redis_url, job)
    except Exception:
        log.exception("could not cancel abandoned job %s", job_id)
