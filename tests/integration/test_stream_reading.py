"""Following jobs' Redis streams from the API (a real Redis, a real migrated SQL database): how far a reader reads
ahead of a slow client, and what a stream takes from SQL where Redis no longer has the job's events."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from types import SimpleNamespace

import pytest
import redis

from app.services import answer_events
from app.services.answer_events import BUFFERED_EVENTS, merged_events
from app.services.streaming import StreamEvent, publish
from app.settings import Settings

pytestmark = pytest.mark.integration

DELTAS = 400  # per job: far more than a reader may hold for its client


def _published_job(rds: redis.Redis, job_id: str, deltas: int = DELTAS) -> None:
    """A finished job's stream as a worker publishes it: a token a delta, then its end."""
    for k in range(deltas):
        publish(rds, job_id, StreamEvent("delta", attempt=1, text="x", token_ids=[k], offset=k,
                                         data={"token_offset": k}))
    publish(rds, job_id, StreamEvent("end", attempt=1, status="succeeded", finish_reason="length"))


def test_a_stream_of_many_choices_reads_ahead_of_a_slow_client_no_more_than_its_buffer(tmp_path, redis_url, db_url,
                                                                                       monkeypatch):
    """The choices' readers put every event they read in an unbounded queue: a client that read slowly (or not at
    all) had the API hold all its choices' text in memory. They now wait while the buffer is full."""
    settings = Settings(data_dir=tmp_path, database_url=db_url, REDIS_URL=redis_url)
    rds = redis.Redis.from_url(redis_url)
    jobs = [SimpleNamespace(id=f"job_choice{i}") for i in range(3)]
    for job in jobs:
        _published_job(rds, job.id)
    read: list[StreamEvent] = []  # every event the readers took from Redis
    follow = answer_events.job_events

    async def counted(settings, job_id):
        async with aclosing(follow(settings, job_id)) as events:
            async for ev in events:
                read.append(ev)
                yield ev

    monkeypatch.setattr(answer_events, "job_events", counted)

    async def a_slow_client() -> tuple[int, int]:
        async with aclosing(merged_events(settings, jobs)) as events:
            await anext(events)
            await asyncio.sleep(1.0)  # the client reads nothing more meanwhile: the readers could read it all
            read_while_waiting = len(read)
            rest = [ev async for _i, ev in events]
        return read_while_waiting, 1 + len(rest)

    read_while_waiting, handed_on = asyncio.run(a_slow_client())
    assert read_while_waiting <= BUFFERED_EVENTS + 2 * len(jobs), read_while_waiting
    assert handed_on == len(jobs) * (DELTAS + 1)  # and the client, reading on, gets every event
