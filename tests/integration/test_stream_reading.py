"""Following jobs' Redis streams from the API (a real Redis, a real migrated SQL database): how far a reader reads
ahead of a slow client, and what a stream takes from SQL where Redis no longer has the job's events."""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import aclosing
from types import SimpleNamespace

import httpx
import pytest
import redis
import requests

from app.services import answer_events
from app.services.answer_events import BUFFERED_EVENTS, merged_events
from app.services.streaming import StreamEvent, publish
from app.settings import Settings
from tests.conftest import Keys, served_by_uvicorn

pytestmark = pytest.mark.integration

DELTAS = 400  # per job: far more than a reader may hold for its client
FOLLOWERS = 50  # more streams at once than the API's pool holds connections on either database (30 and 48)


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


def test_a_burst_of_followers_holds_no_database_connection_while_it_streams(settings, keys):
    """GET /v1/jobs/{id}/stream read the job in its request's session, which stayed open, in its transaction, until
    the stream ended: each follower held one of the API's pooled connections for as long as it streamed, and past
    the pool's size (30 on a database server) a burst's other followers waited out the pool's timeout and got a 500.
    The request's session closes once the route has answered now, before the stream's body. A real server; the job
    waits queued (no worker), so every stream stays open."""
    from app.main import create_app

    with served_by_uvicorn(create_app(settings), "uvicorn-followers") as base:
        job = requests.post(f"{base}/v1/jobs", json={"prompt": "hi", "max_tokens": 4}, headers=Keys.header(keys.paid),
                            timeout=30).json()

        async def burst() -> tuple[list[int], int]:
            limits = httpx.Limits(max_connections=FOLLOWERS + 1)
            async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
                follow = client.build_request("GET", f"/v1/jobs/{job['id']}/stream", headers=Keys.header(keys.paid))
                streams = await asyncio.gather(*(client.send(follow, stream=True) for _ in range(FOLLOWERS)))
                try:  # every stream still open: another request is answered too
                    polled = await client.get(f"/v1/jobs/{job['id']}", headers=Keys.header(keys.paid))
                finally:
                    await asyncio.gather(*(stream.aclose() for stream in streams))
            return [stream.status_code for stream in streams], polled.status_code

        statuses, polled = asyncio.run(burst())
    assert Counter(statuses) == {200: FOLLOWERS} and polled == 200, (Counter(statuses), polled)
