"""Token streaming through Redis Streams (``coserve:job:<id>``).

The worker XADDs ``delta`` events (text and token ids) while a job runs and one
terminal ``end`` event; the API follows a job's stream with ``follow_job`` (the
OpenAI-compatible SSE endpoints are built on it). Each event carries the job's attempt:
when a crashed worker's job is rerun, the new attempt starts over and ``follow_job``
skips the text the client already received. A delta also carries its ``offset`` in the
attempt's text, so a follower tells a lost event (Redis restarted empty, a dropped
publish) from a repeated one and never hands on text out of order: after a gap the
attempt's text comes from SQL once the job ends. ``follow_job`` rides out a Redis outage
(reading on from its last entry), polling SQL meanwhile for the job's end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

CANCEL_CHANNEL = "coserve:cancel"
STREAM_TTL_S = 3600  # a finished job's stream is kept this long for late readers
STREAM_MAXLEN = 100_000
OUTAGE_LIMIT_S = 60.0  # how long a follower waits for Redis to answer again before its error event
KEPT_FOLLOWS = "kept_follows"  # a cancel's end: the worker that ran the job writes what it keeps after it
# a job's token counts, as its end and kept events carry them and as its columns hold them
USAGE = ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens", "cache_write_tokens")
RETRY_FIRST_S, RETRY_MAX_S = 0.1, 2.0  # its pauses between reads while Redis is away (doubling)
# what a read during an outage raises: refused or reset connections, a server still loading its data
# (BusyLoadingError is a ConnectionError), a socket timeout; OSError for errors redis-py did not wrap
OUTAGE_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


def stream_key(job_id: str) -> str:
    return f"coserve:job:{job_id}"


@dataclass
class StreamEvent:
    type: str  # "delta" | "end" | "status"; followers also yield "error" (the stream could not be read)
    attempt: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    status: str | None = None  # on "end": succeeded | failed | cancelled | expired; on "status": the new state
    finish_reason: str | None = None
    data: dict[str, Any] = field(default_factory=dict)  # usage and metrics on "end"
    # on "delta": characters of this attempt's text before this one (None: a publisher that did not say)
    offset: int | None = None
    at: float | None = None  # read back: when Redis took it (its entry id's milliseconds, epoch seconds); not sent

    @property
    def terminal(self) -> bool:
        return self.type == "end"

    def fields(self) -> dict[str, str]:
        out = {"type": self.type, "attempt": str(self.attempt), "text": self.text,
               "token_ids": json.dumps(self.token_ids), "status": self.status or "",
               "finish_reason": self.finish_reason or "", "data": json.dumps(self.data)}
        if self.offset is not None:
            out["offset"] = str(self.offset)
        return out

    @classmethod
    def parse(cls, raw: dict, entry_id: bytes | str | None = None) -> StreamEvent:
        """The event in a stream entry's fields; ``entry_id`` (``<ms>-<seq>``) tells when Redis took it (``at``)."""
        at = None
        if entry_id is not None:
            at = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0]) / 1e3
        f = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in raw.items()}
        return cls(type=f.get("type", "delta"), attempt=int(f.get("attempt", 0)), text=f.get("text", ""),
                   token_ids=json.loads(f.get("token_ids") or "[]"), status=f.get("status") or None,
                   finish_reason=f.get("finish_reason") or None, data=json.loads(f.get("data") or "{}"),
                   offset=int(f["offset"]) if f.get("offset") else None, at=at)


def publish(pipe: Any, job_id: str, event: StreamEvent) -> None:
    """Queue an XADD on a (sync) redis pipeline or client; terminal events set the TTL."""
    key = stream_key(job_id)
    pipe.xadd(key, event.fields(), maxlen=STREAM_MAXLEN, approximate=True)
    if event.terminal:
        pipe.expire(key, STREAM_TTL_S)


SqlEnd = Callable[[], Awaitable[StreamEvent | None]]


@dataclass
class _Progress:
    """What a follower has handed on, and how much of the current attempt's text it has seen."""

    job_id: str
    attempt: int | None = None
    produced: int = 0  # characters of the current attempt's text seen without a hole, from its start
    sent: list[str] = field(default_factory=list)  # the text yielded, over all attempts
    delivered: int = 0  # its length
    logprobs_delivered: int = 0  # token logprobs yielded (deltas carry them by index in their attempt)
    tokens_delivered: int = 0  # token ids yielded, over all attempts
    gap: bool = False  # the current attempt's stream lost text: no more deltas; SQL has it at the end
    relegated: bool = False  # the last status yielded was ``relegated``

    def _sent_text(self) -> str:
        if len(self.sent) > 1:
            self.sent[:] = ["".join(self.sent)]
        return self.sent[0] if self.sent else ""

    def admit(self, ev: StreamEvent) -> StreamEvent | None:
        """``ev`` as the client should get it (a delta cut to the text it lacks), or None to skip it."""
        if self.attempt is None or ev.attempt > self.attempt:
            self.attempt, self.produced, self.gap = ev.attempt, 0, False
        elif ev.attempt < self.attempt:
            return None  # a stale attempt's leftovers
        if ev.type != "delta":
            return ev
        if self.gap:
            return None
        if (first := ev.data.get("logprobs_offset")) is not None and first > self.logprobs_delivered:
            log.warning("the stream of %s lost token logprobs %d-%d of attempt %d; the rest will come from SQL",
                        self.job_id, self.logprobs_delivered, first, ev.attempt)
            self.gap = True  # a lost delta of token ids only (no text) leaves this hole alone
            return None
        if not ev.text:  # token ids whose text is not complete yet: nothing to place
            return self._new_logprobs(self._new_tokens(ev))
        start = self.produced if ev.offset is None else ev.offset
        if start > self.produced:
            log.warning("the stream of %s lost characters %d-%d of attempt %d; its text will come from SQL",
                        self.job_id, self.produced, start, ev.attempt)
            self.gap = True
            return None
        end = start + len(ev.text)
        # a repeated publish, or a rerun regenerating text the client already has: the part the client has
        # must be the same text (a rerun after a worker died may sample differently, or a different batch
        # may round a near-tie the other way); a rerun that parted from it cannot be streamed on
        have = self.delivered
        if start < have:
            overlap = ev.text[:have - start]
            if overlap != self._sent_text()[start:start + len(overlap)]:
                return self.diverged()
        self.produced = max(self.produced, end)
        if end <= have:  # text the client has; ids it lacks (placed by their token_offset) go on alone
            ev.text = ""
            placed = ev.data.get("token_offset") is not None
            return self._new_logprobs(ev) if placed and self._new_tokens(ev).token_ids else None
        self._new_tokens(ev)
        ev.text = ev.text[max(0, have - start):]
        self.delivered = end
        self.sent.append(ev.text)
        return self._new_logprobs(ev)

    def in_status_order(self, ev: StreamEvent) -> list[StreamEvent]:
        """``ev`` as the client should get it among the job's status changes: the worker publishes a resumed job's
        tokens at once but its ``resumed`` only once SQL has the job running again (later still where that write is
        retried), so a delta after ``relegated`` comes after a ``resumed`` made here; a status that changes nothing
        (that late ``resumed``, a publish repeated) is dropped."""
        if ev.type == "status":
            if (ev.status == "relegated") == self.relegated:
                return []
            self.relegated = ev.status == "relegated"
        elif ev.type == "delta" and self.relegated:
            self.relegated = False
            return [StreamEvent("status", ev.attempt, status="resumed"), ev]
        return [ev]

    def _new_tokens(self, ev: StreamEvent) -> StreamEvent:
        """``ev`` with only the token ids not yet yielded: a rerun (a job handed back, or its lease lapsed) generates
        its ids from the start again, and a publish may repeat; the ids the client has are cut as its text is, by
        their index in the attempt (``token_offset``; an older publisher's deltas, without it, pass as they are)."""
        first = ev.data.get("token_offset")
        if first is None or not ev.token_ids:
            return ev
        end = first + len(ev.token_ids)
        ev.token_ids = ev.token_ids[max(0, self.tokens_delivered - first):]
        self.tokens_delivered = max(self.tokens_delivered, end)
        return ev

    def _new_logprobs(self, ev: StreamEvent) -> StreamEvent:
        """``ev`` with only the token logprobs not yet yielded (a rerun repeats the ones before)."""
        entries = ev.data.get("logprobs")
        if entries:
            skip = max(0, self.logprobs_delivered - int(ev.data.get("logprobs_offset", self.logprobs_delivered)))
            ev.data = {**ev.data, "logprobs": entries[skip:]}
            self.logprobs_delivered += len(entries) - min(skip, len(entries))
        return ev

    def settle(self, end: StreamEvent) -> StreamEvent:
        """SQL's end, if its text goes on from what was streamed (the consumer sends the rest); else an error."""
        text = end.data.get("output_text")
        if end.data.get("from_sql") and text is not None and not text.startswith(self._sent_text()):
            return self.diverged()
        return end

    def diverged(self) -> StreamEvent:
        log.warning("job %s: attempt %s's text parted from what its stream already sent", self.job_id, self.attempt)
        return StreamEvent("error", attempt=self.attempt or 0, data={
            "error": f"the job was run again after a worker failure and the new run's text differs from what this "
                     f"stream already sent; the job goes on: GET /v1/jobs/{self.job_id} has its result",
            "code": "stream_diverged"})

    def error(self, message: str) -> StreamEvent:
        return StreamEvent("error", attempt=self.attempt or 0, data={"error": message, "code": "stream_interrupted"})


@dataclass
class _Outage:
    """A run of failed reads: when it began and how long to pause before the next try."""

    job_id: str
    began: float = field(default_factory=time.monotonic)
    delay: float = RETRY_FIRST_S

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def pause(self) -> float:
        delay, self.delay = self.delay, min(self.delay * 2, RETRY_MAX_S)
        return delay


async def _end_from_sql(sql_end: SqlEnd | None, progress: _Progress, wait_s: float = 10.0) -> StreamEvent:
    """The end of an attempt whose stream lost text: SQL's end, which carries the whole text.

    The worker commits the job before it publishes the end, so SQL normally has it at once."""
    if sql_end is None:
        return progress.error("the job's stream lost text and there is no other source for it")
    deadline = time.monotonic() + wait_s
    while (end := await sql_end()) is None:
        if time.monotonic() > deadline:
            return progress.error("the job's stream lost text and the job has not ended in the database")
        await asyncio.sleep(0.1)
    return end


def _raise_a_lost_cancel() -> None:
    """Raises the cancel of this task that a call returned over.

    redis-py writes a command under ``asyncio.wait_for``; on Python 3.11 that returns the write's
    result and drops a cancel that arrives as the write completes (CPython gh-86296, fixed in 3.12).
    The follower then read on until the job ended, and the API, waiting for it to stop, cancelled
    a hung-up client's job only then."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def follow_job(redis: Any, job_id: str, *, block_ms: int = 1000, sql_end: SqlEnd | None = None,
                     outage_limit_s: float = OUTAGE_LIMIT_S, kept_wait_s: float = 10.0) -> AsyncIterator[StreamEvent]:
    """Yields a job's events from the start until its terminal one; text once each, in order.

    ``redis`` is a ``redis.asyncio.Redis``. ``sql_end`` returns SQL's view of the job's end (an
    ``end`` event whose data holds ``output_text`` and ``from_sql``) or None while it runs. It is
    asked when the stream stays silent for ``block_ms`` (a job that ended with no end event in the
    stream, e.g. cancelled while queued; a success is trusted on the second silent look, since the
    worker commits SQL just before it publishes the last events), while Redis is away, and for the
    end of an attempt whose stream lost text (deltas stop at the gap; the consumer takes the rest
    from ``output_text``).

    Redis errors: the read is retried from the last entry, with growing pauses. If the job ends
    meanwhile, SQL's end is yielded; if Redis stays away for ``outage_limit_s``, an ``error`` event
    is (the job itself goes on: its result is in SQL).

    A cancel's end that says the worker's word follows (``KEPT_FOLLOWS``) is held for up to ``kept_wait_s`` (the
    cancel's own wait): the worker's deltas come on meanwhile, and its ``kept`` event ends the stream with SQL's end,
    which then holds the text and usage the job kept.
    """
    key = stream_key(job_id)
    last_id = "0-0"
    progress = _Progress(job_id)
    quiet_end = False  # SQL said succeeded while the stream was silent
    cancelled: tuple[StreamEvent, float] | None = None  # a cancel's end held for the worker's word, and until when
    kept = False  # the worker wrote what it keeps before the cancel's end reached the stream
    outage: _Outage | None = None
    while True:
        try:
            resp = await redis.xread({key: last_id}, count=256, block=block_ms)
            _raise_a_lost_cancel()
        except OUTAGE_ERRORS as exc:
            if outage is None:
                outage = _Outage(job_id)
                log.warning("cannot read the stream of %s (%s); retrying for up to %.0f s", job_id, exc,
                            outage_limit_s)
            if sql_end is not None and (end := await sql_end()) is not None:
                yield progress.settle(end)  # the job ended meanwhile: SQL has all of its text
                return
            if outage.elapsed() >= outage_limit_s:
                yield progress.error(f"the job's stream was unreachable for {outage.elapsed():.0f} s ({exc}); "
                                     f"the job goes on: GET /v1/jobs/{job_id} has its result when it ends")
                return
            await asyncio.sleep(outage.pause())
            continue
        if outage is not None:
            log.info("the stream of %s is readable again after %.1f s", job_id, outage.elapsed())
            outage = None
        if not resp:
            if cancelled is not None:  # SQL says cancelled already: what the worker keeps may not be written yet
                if time.monotonic() >= cancelled[1]:
                    yield cancelled[0]
                    return
                continue
            if sql_end is not None:
                end = await sql_end()
                if end is not None and (quiet_end or progress.gap or end.status != "succeeded"):
                    yield progress.settle(end)
                    return
                quiet_end = end is not None
            continue
        quiet_end = False
        for _key, entries in resp:
            for entry_id, raw in entries:
                last_id = entry_id
                ev = progress.admit(StreamEvent.parse(raw))
                if ev is None:
                    continue
                if ev.type == "kept":
                    kept = True
                elif ev.terminal and ev.data.get(KEPT_FOLLOWS):
                    cancelled = ev, time.monotonic() + kept_wait_s
                elif cancelled is not None:  # held: what the worker made before it took the abort comes on
                    if ev.type == "delta":
                        yield ev
                    continue
                if cancelled is not None and kept:
                    yield progress.settle(await _end_from_sql(sql_end, progress)) if sql_end else cancelled[0]
                    return
                if cancelled is not None or ev.type == "kept":  # the held end, or the word before it
                    continue
                if ev.terminal and progress.gap:
                    yield progress.settle(await _end_from_sql(sql_end, progress))
                    return
                for shown in progress.in_status_order(ev):
                    yield shown
                if ev.terminal or ev.type == "error":
                    return
