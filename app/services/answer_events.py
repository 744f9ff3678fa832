"""A request's answer while its jobs run (one job per choice): their events read as what a client is sent.

``answer_events`` turns the jobs' stream events into content, tool-call deltas and token logprobs as they come,
then each choice's whole answer (or the failure that ended it). The OpenAI chunks of chat and completions and
the Responses API's typed events are two ways of writing the same items. ``abandoned_on_hangup`` stops the jobs
of a client that leaves before its stream has ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from app.db.models import Job, JobStatus
from app.services.job_follow import (cancel_abandoned, job_events, rest_from_sql, rest_ids_from_sql,
                                     wait_for_end)
from app.services.streaming import StreamEvent
from app.settings import Settings
from app.tool_calls import Answer, AnswerStream

log = logging.getLogger(__name__)

ABANDONED = "client disconnected before the answer was complete"
ANOTHER_FAILED = "another choice of the request failed"
BUFFERED_EVENTS = 64  # a request's events read from its choices' streams ahead of its client
# a stream that has sent nothing for this long sends its keepalive: a proxy's idle timeout (nginx's
# proxy_read_timeout, an AWS ALB's: 60 s) would otherwise cut it while its job waits or is relegated
KEEPALIVE_S = 15.0
KEEPALIVE_COMMENT = b": keepalive\n\n"  # an SSE comment: every SSE client skips it


@dataclass
class Begun:
    """Choice ``choice`` produced its first event (a completion's echo goes out before its text)."""

    choice: int
    prompt_logprobs: list[dict[str, Any]] | None  # the prompt's token logprobs, where the job asked for them


@dataclass
class Piece:
    """What choice ``choice`` adds to its answer now."""

    choice: int
    content: str  # text that is the answer's content
    reasoning: str  # a reasoning model's thinking (where the job reads it apart: ``app.reasoning``)
    calls: list[dict[str, Any]] | None  # tool-call deltas, each naming its call's index
    logprobs: list[dict[str, Any]] | None  # token logprobs new with it (None where the job asked for none)
    offset: int  # characters of the choice's text before this piece's (completions' text_offset)
    generated: int  # output tokens of the choice so far, counted from the stream
    token_ids: list[int] = field(default_factory=list)  # ids generated since the last piece (with the text)


@dataclass
class Finished:
    """Choice ``choice`` succeeded; every piece of it was given."""

    choice: int
    answer: Answer
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # of the prompt tokens, those the engine's prefix cache held
    reasoning_tokens: int | None = None  # of the completion tokens, those it thought in (a reasoning parser's)
    token_ids: list[int] = field(default_factory=list)  # generated ids no piece carried (text held back to the end)
    cache_write_tokens: int | None = None  # of the prompt tokens, those the engine wrote to its prefix cache
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id that ended it


@dataclass
class Failed:
    """Choice ``choice`` ended without its answer (the items stop here)."""

    choice: int
    status: str
    error: str | None
    code: str | None


@dataclass
class Held:
    """Choice ``choice``'s job was relegated under overload (set aside until there is spare capacity, or until it
    expires), or resumed after it: ``status``. The job goes on either way."""

    choice: int
    status: str  # relegated | resumed


# what a client is told of a held job's status
HELD = {"relegated": "set aside under overload, waiting for spare capacity", "resumed": "running again"}


def held_comment(item: Held) -> bytes:
    """``item`` said in an SSE comment (which every SSE client skips): no silent stall."""
    return f": choice {item.choice} {item.status}: {HELD[item.status]}\n\n".encode()


@dataclass
class Interrupted:
    """The stream could not be read on; the jobs go on (the items stop here)."""

    message: str


AnswerItem = Begun | Piece | Finished | Failed | Held | Interrupted


async def merged_events(settings: Settings, jobs: list[Job]) -> AsyncIterator[tuple[int, StreamEvent]]:
    """The events of a request's jobs (one per choice) as they come, each with its choice's index; a job's own
    events stay in order."""
    if len(jobs) == 1:
        async with aclosing(job_events(settings, jobs[0].id)) as events:
            async for ev in events:
                yield 0, ev
        return
    # bounded: a reader waits while its client is slow rather than the API holding every choice's text for it
    queue: asyncio.Queue[tuple[int, StreamEvent | BaseException | None]] = asyncio.Queue(BUFFERED_EVENTS)

    async def pump(i: int, job: Job) -> None:
        """Job i's events, then None (or the exception that ended its reading); cancelled once the request's
        reading ends, so it puts nothing more then (a full queue would hold it)."""
        try:
            async with aclosing(job_events(settings, job.id)) as events:
                async for ev in events:
                    await queue.put((i, ev))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which fails the stream with it
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        running = len(tasks)
        while running:
            i, ev = await queue.get()
            if ev is None:
                running -= 1
            elif isinstance(ev, BaseException):
                raise ev
            else:
                yield i, ev
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def answer_events(settings: Settings, jobs: list[Job], chat: bool = True) -> AsyncIterator[AnswerItem]:
    """The answers of ``jobs`` (choice i = job i) as they come, until every choice has finished, one has
    failed, or the stream was interrupted. ``chat``: read tool calls as the jobs asked (a completion's text is
    all content)."""
    answers = [AnswerStream(job.id, job.sampling if chat else None) for job in jobs]
    delivered = [0] * len(jobs)  # characters of each choice's text given
    generated = [0] * len(jobs)  # its output tokens counted from the stream
    logprobs_given = [0] * len(jobs)  # its token logprobs given
    begun = [False] * len(jobs)
    unfinished = len(jobs)
    ids_pending: list[list[int]] = [[] for _ in jobs]  # generated ids not given yet (they go with the next piece)
    ids_seen = [0] * len(jobs)  # generated ids read from the stream

    def piece(i: int, reasoning: str, content: str, calls: list[dict[str, Any]] | None,
              logprobs: list[dict[str, Any]] | None, text: str) -> Piece | None:
        shown = bool(reasoning or content or calls or logprobs)
        given = Piece(i, content, reasoning, calls, logprobs, delivered[i], generated[i],
                      ids_pending[i] if shown else [])
        delivered[i] += len(text)
        logprobs_given[i] += len(logprobs or ())
        if shown:
            ids_pending[i] = []
        return given if shown else None

    async with aclosing(merged_events(settings, jobs)) as events:
        async for i, ev in events:
            if not begun[i] and ev.type in ("delta", "end") and ev.status in (None, JobStatus.SUCCEEDED):
                begun[i] = True
                yield Begun(i, ev.data.get("prompt_logprobs"))
            if ev.type == "delta":
                ids_pending[i] += ev.token_ids
                ids_seen[i] += len(ev.token_ids)
            if ev.type == "delta" and (ev.text or ev.data.get("logprobs")):
                generated[i] += len(ev.token_ids)
                if given := piece(i, *answers[i].feed(ev.text), ev.data.get("logprobs") or None, ev.text):
                    yield given
            elif ev.type == "status" and ev.status in HELD:
                yield Held(i, ev.status)
            elif ev.type == "error":
                yield Interrupted(ev.data.get("error") or "the stream was interrupted")
                return
            elif ev.type == "end":
                if ev.status != JobStatus.SUCCEEDED:
                    yield Failed(i, ev.status or JobStatus.FAILED, ev.data.get("error"), ev.data.get("code"))
                    return
                if ev.data.get("from_sql"):  # ended through SQL: what the stream missed
                    ids_pending[i] += rest_ids_from_sql(ev, ids_seen[i])
                    rest, rest_logprobs = rest_from_sql(ev, delivered[i], logprobs_given[i])
                    if given := piece(i, *answers[i].feed(rest), rest_logprobs or None, rest):
                        yield given
                reasoning, content, calls, answer = answers[i].end(ev.finish_reason)
                if given := piece(i, reasoning, content, calls, None, ""):
                    yield given
                yield Finished(i, answer, ev.data.get("prompt_tokens") or 0, ev.data.get("completion_tokens") or 0,
                               ev.data.get("cached_tokens"), ev.data.get("reasoning_tokens"), ids_pending[i],
                               ev.data.get("cache_write_tokens"), ev.data.get("stop_reason"))
                unfinished -= 1
                if not unfinished:
                    return


async def abandon(settings: Settings, jobs: list[Job], detail: str = ABANDONED) -> None:
    """Stops generating the unfinished ones of ``jobs`` (SQL and Redis I/O: in a worker thread)."""
    for job in jobs:
        await anyio.to_thread.run_sync(cancel_abandoned, settings, job.id, detail)


async def abandoned_on_hangup(settings: Settings, jobs: list[Job],
                              stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``stream`` as it is; a client that hangs up before it ends (Starlette closes or cancels this generator)
    stops the jobs. A stream that ends on its own, with an error too, leaves them alone."""
    ended = False
    try:
        async with aclosing(stream) as chunks:
            async for chunk in chunks:
                yield chunk
        ended = True
    finally:
        if not ended:  # shielded: this runs while the disconnected response's task is being cancelled
            with anyio.CancelScope(shield=True):
                await abandon(settings, jobs)


async def kept_alive(stream: AsyncIterator[bytes], keepalive: bytes) -> AsyncIterator[bytes]:
    """``stream`` as it is, with ``keepalive`` (a comment, a ping) sent each time it sends nothing for
    ``KEEPALIVE_S``. ``stream`` runs in a task of its own (it is read ahead by one chunk at most), cancelled if
    this one is closed or cancelled first (the client left)."""
    chunks: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(1)

    async def pump() -> None:
        try:
            async with aclosing(stream) as source:
                async for chunk in source:
                    await chunks.put(chunk)
        except Exception as exc:  # noqa: BLE001 - raised to the reader, as the stream itself would have
            await chunks.put(exc)
            return
        await chunks.put(None)

    task = asyncio.create_task(pump())
    try:
        while True:
            try:  # a chunk waiting is taken as it is: the timer only where the stream has nothing yet
                chunk = chunks.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    async with asyncio.timeout(KEEPALIVE_S):  # no task a chunk, as wait_for makes
                        chunk = await chunks.get()
                except TimeoutError:
                    yield keepalive
                    continue
            if chunk is None:
                return
            if isinstance(chunk, BaseException):
                raise chunk
            yield chunk
    finally:  # shielded: this runs while a disconnected response's task is being cancelled
        with anyio.CancelScope(shield=True):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def ends(settings: Settings, jobs: list[Job]) -> list[StreamEvent]:
    """Every job's end; or, as soon as one did not succeed, that end alone (the others are stopped)."""
    waits = [asyncio.ensure_future(wait_for_end(settings, job.id)) for job in jobs]
    try:
        pending = set(waits)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for wait in done:
                if (end := wait.result()).status != JobStatus.SUCCEEDED:
                    if len(jobs) > 1:
                        await abandon(settings, jobs, ANOTHER_FAILED)
                    return [end]
        return [wait.result() for wait in waits]
    finally:  # on an error or a cancel (the client left), no wait goes on alone
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
