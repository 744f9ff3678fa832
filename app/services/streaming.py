"""Token streaming through Redis Streams (``coserve:job:<id>``).

The worker XADDs ``delta`` events (text and token ids) while a job runs and one
terminal ``end`` event; the API follows a job's stream with ``follow_job`` (the
OpenAI-compatible SSE endpoints are built on it). Each event carries the job's attempt:
when a crashed worker's job is rerun, the new attempt starts over and ``follow_job``
skips the text the client already received.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

CANCEL_CHANNEL = "coserve:cancel"
STREAM_TTL_S = 3600  # a finished job's stream is kept this long for late readers
STREAM_MAXLEN = 100_000


def stream_key(job_id: str) -> str:
    return f"coserve:job:{job_id}"


@dataclass
class StreamEvent:
    type: str  # "delta" | "end" | "status"
    attempt: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    status: str | None = None  # on "end": succeeded | failed | cancelled | expired; on "status": the new state
    finish_reason: str | None = None
    data: dict[str, Any] = field(default_factory=dict)  # usage and metrics on "end"

    @property
    def terminal(self) -> bool:
        return self.type == "end"

    def fields(self) -> dict[str, str]:
        return {"type": self.type, "attempt": str(self.attempt), "text": self.text,
                "token_ids": json.dumps(self.token_ids), "status": self.status or "",
                "finish_reason": self.finish_reason or "", "data": json.dumps(self.data)}

    @classmethod
    def parse(cls, raw: dict) -> StreamEvent:
        f = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in raw.items()}
        return cls(type=f.get("type", "delta"), attempt=int(f.get("attempt", 0)), text=f.get("text", ""),
                   token_ids=json.loads(f.get("token_ids") or "[]"), status=f.get("status") or None,
                   finish_reason=f.get("finish_reason") or None, data=json.loads(f.get("data") or "{}"))


def publish(pipe: Any, job_id: str, event: StreamEvent) -> None:
    """Queue an XADD on a (sync) redis pipeline or client; terminal events set the TTL."""
    key = stream_key(job_id)
    pipe.xadd(key, event.fields(), maxlen=STREAM_MAXLEN, approximate=True)
    if event.terminal:
        pipe.expire(key, STREAM_TTL_S)


async def follow_job(redis: Any, job_id: str, *, block_ms: int = 1000,
                     check_done: Callable[[], Awaitable[StreamEvent | None]] | None = None,
                     ) -> AsyncIterator[StreamEvent]:
    """Yields a job's events from the start until its terminal event.

    ``redis`` is a ``redis.asyncio.Redis``. ``check_done`` is polled whenever no event
    arrived for ``block_ms``: it returns a terminal event when SQL says the job ended
    without one in the stream (e.g. cancelled while queued), else None.
    """
    key = stream_key(job_id)
    last_id = "0-0"
    attempt = None
    delivered = 0  # characters of text already yielded (over all attempts)
    produced = 0  # characters the current attempt produced so far
    while True:
        resp = await redis.xread({key: last_id}, count=256, block=block_ms)
        if not resp:
            if check_done is not None:
                done = await check_done()
                if done is not None:
                    yield done
                    return
            continue
        for _key, entries in resp:
            for entry_id, raw in entries:
                last_id = entry_id
                ev = StreamEvent.parse(raw)
                if attempt is None or ev.attempt > attempt:
                    attempt, produced = ev.attempt, 0
                elif ev.attempt < attempt:
                    continue  # a stale attempt's leftovers
                if ev.type == "delta" and ev.text:
                    start, produced = produced, produced + len(ev.text)
                    if produced <= delivered:
                        continue  # a rerun regenerating text the client already has
                    ev.text = ev.text[max(0, delivered - start):]
                    delivered = produced
                yield ev
                if ev.terminal:
                    return
