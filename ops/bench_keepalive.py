"""What the streams' keepalive wrapper (``answer_events.kept_alive``, stop 66) costs a chunk, beside the bare stream.

Every streamed answer (chat, completions, Responses, Messages, the native job stream) now passes through
``kept_alive``, which runs the stream in a task of its own and waits on each chunk with a timeout, so that a stream
with nothing to send sends a keepalive. This times ``--chunks`` SSE-sized chunks read from an async generator that
yields at once (no Redis, no HTTP: the wrapper alone, the most it can add per chunk), bare and wrapped, in the same
run, alternating ``--rounds`` times.

    python ops/bench_keepalive.py --chunks 20000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.services.answer_events import KEEPALIVE_COMMENT, kept_alive  # noqa: E402

CHUNK = b'data: {"choices": [{"index": 0, "delta": {"content": " token"}}]}\n\n'


async def source(chunks: int) -> AsyncIterator[bytes]:
    for _ in range(chunks):
        yield CHUNK
        await asyncio.sleep(0)  # a stream hands the loop back between its chunks (it awaits Redis)


async def read(stream: AsyncIterator[bytes]) -> int:
    n = 0
    async for _chunk in stream:
        n += 1
    return n


async def per_chunk_us(chunks: int, wrapped: bool) -> float:
    stream = source(chunks)
    start = time.perf_counter()
    n = await read(kept_alive(stream, KEEPALIVE_COMMENT) if wrapped else stream)
    assert n == chunks, n
    return (time.perf_counter() - start) / chunks * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    bare, wrapped = [], []
    for _ in range(args.rounds):
        bare.append(asyncio.run(per_chunk_us(args.chunks, wrapped=False)))
        wrapped.append(asyncio.run(per_chunk_us(args.chunks, wrapped=True)))
    table = Table(title=f"{args.chunks} chunks a stream, {args.rounds} rounds alternating (median, min-max)")
    table.add_column("stream")
    table.add_column("µs a chunk", justify="right")
    for name, values in (("bare generator", bare), ("kept_alive(generator)", wrapped)):
        table.add_row(name, f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
    Console().print(table)


if __name__ == "__main__":
    main()
