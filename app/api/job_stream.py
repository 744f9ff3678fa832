"""A job's native stream (``GET /v1/jobs/{id}/stream``) as server-sent events, resumable with ``Last-Event-ID``.

Every ``delta`` carries an SSE ``id``: its job and how far the stream has gone (characters, token ids and token
logprobs sent), ``<job id>:12.3.0``. A client that reconnects with that id as ``Last-Event-ID`` (a browser's
``EventSource`` does so by itself) gets the rest from there, nothing twice; the ``end`` event's id is
``<job id>:end``, and a reconnect after it is answered 204, which tells an ``EventSource`` to stop reconnecting. An
id of another job's stream is refused (it would skip this one's events); one without a job (``12.3.0``, ``end``:
what the stream sent before ids named their job) is taken as it is."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from app.api.errors import stream_failure
from app.services.job_follow import job_events, rest_from_sql, rest_ids_from_sql
from app.services.streaming import StreamEvent
from app.settings import Settings

log = logging.getLogger(__name__)

END = "end"  # the end event's position: a reconnect after it has nothing left to read


@dataclass
class StreamPosition:
    """How much of a job's stream was sent: characters of text, token ids, token logprobs."""

    chars: int = 0
    tokens: int = 0
    logprobs: int = 0

    @property
    def event_id(self) -> str:
        return f"{self.chars}.{self.tokens}.{self.logprobs}"

    @classmethod
    def parse(cls, last_event_id: str) -> StreamPosition:
        """The position a ``delta``'s id names; ValueError for anything else."""
        parts = last_event_id.split(".")
        if len(parts) != 3 or not all(p.isascii() and p.isdigit() and len(p) <= 12 for p in parts):
            raise ValueError(f"Last-Event-ID {last_event_id[:40]!r} is not the id of an event of this stream "
                             "(the job's id and three numbers, e.g. 'job_1:12.3.0'); leave it out to read from the "
                             "start")
        return cls(*map(int, parts))

    def passed(self, other: StreamPosition) -> bool:
        return self.chars >= other.chars and self.tokens >= other.tokens and self.logprobs >= other.logprobs


def event_id(job_id: str, position: str) -> str:
    """The SSE id of the event of ``job_id``'s stream at ``position`` (a ``StreamPosition``'s, or ``END``)."""
    return f"{job_id}:{position}"


def resume_point(job_id: str, last_event_id: str) -> StreamPosition | None:
    """Where a ``Last-Event-ID`` resumes ``job_id``'s stream (None: after its end); ValueError for an id of another
    job's stream, or no id of a stream at all."""
    named, _, position = last_event_id.rpartition(":")
    if named and named != job_id:
        raise ValueError(f"Last-Event-ID {last_event_id[:60]!r} is an event of job {named[:40]!r}'s stream, not of "
                         f"{job_id!r}'s: reconnect to that job's stream, or leave it out to read this one from the "
                         "start")
    return None if position == END else StreamPosition.parse(position)


def sse(event: str, data: dict[str, Any], event_id: str | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _end_data(job_id: str, ev: StreamEvent) -> dict[str, Any]:
    return {"id": job_id, "status": ev.status, "finish_reason": ev.finish_reason,
            "error": ev.data.get("error"), "error_code": ev.data.get("code"),
            "prompt_tokens": ev.data.get("prompt_tokens"), "completion_tokens": ev.data.get("completion_tokens"),
            "cached_tokens": ev.data.get("cached_tokens"), "reasoning_tokens": ev.data.get("reasoning_tokens")}


async def sse_events(settings: Settings, job_id: str, resume: StreamPosition | None = None) -> AsyncIterator[bytes]:
    """The job's events from its first token, or from ``resume`` on; ``status`` events from the resume point on."""
    sent = StreamPosition()  # the whole stream's, the part a resumed client had included
    skip = resume or StreamPosition()

    def delta(text: str, token_ids: list[int], logprobs: list[dict] | None) -> bytes | None:
        """The part of a delta a resumed client has not had, with the position after it as its id."""
        cut = StreamPosition(max(0, skip.chars - sent.chars), max(0, skip.tokens - sent.tokens),
                             max(0, skip.logprobs - sent.logprobs))
        sent.chars, sent.tokens = sent.chars + len(text), sent.tokens + len(token_ids)
        sent.logprobs += len(logprobs or ())
        body: dict[str, Any] = {"text": text[cut.chars:], "token_ids": token_ids[cut.tokens:]}
        if logprobs is not None:
            body["logprobs"] = logprobs[cut.logprobs:]
        if not (body["text"] or body["token_ids"] or body.get("logprobs")):
            return None
        return sse("delta", body, event_id(job_id, sent.event_id))

    try:
        async with aclosing(job_events(settings, job_id)) as events:
            async for ev in events:
                if ev.type == "delta":
                    if (ev.text or ev.token_ids) and (out := delta(ev.text, ev.token_ids, ev.data.get("logprobs"))):
                        yield out
                elif ev.type == "status":
                    if sent.passed(skip):
                        yield sse("status", {"status": ev.status})
                elif ev.type == "error":  # the stream could not be read on; the job goes on
                    yield sse("error", {"id": job_id, "error": ev.data.get("error"), "code": ev.data.get("code")})
                    return
                elif ev.type == "end":
                    if ev.data.get("from_sql"):  # what SQL kept (a cancelled job keeps its text too)
                        rest, rest_logprobs = rest_from_sql(ev, sent.chars, sent.logprobs)
                        rest_ids = rest_ids_from_sql(ev, sent.tokens)
                        if (rest or rest_ids or rest_logprobs) and (out := delta(rest, rest_ids, rest_logprobs)):
                            yield out
                    yield sse("end", _end_data(job_id, ev), event_id(job_id, END))
                    return
    except Exception as exc:  # a bug or a database error: an error event rather than a body cut short
        _status, message = stream_failure(exc, job_id, f"GET /v1/jobs/{job_id}")
        yield sse("error", {"id": job_id, "error": message, "code": "stream_interrupted"})
