"""Submission throughput of ``POST /v1/jobs`` on the embedded setup (SQLite WAL + Redis).

For each API configuration it starts a fresh data dir, an embedded redis-server and
uvicorn, then runs ``--concurrency`` aiohttp clients for ``--requests`` jobs: closed loop
(each client sends again as soon as it is answered: the most the server takes) and open
loop at ``--rate`` jobs/s (latency counted from each request's due time). Afterwards it
checks that every accepted job is in SQL and its id is in the model's Redis queue.
``GET /healthz`` through the same server is the baseline (the HTTP floor without DB or
broker work).

    python ops/bench_submit.py --api-workers 1,2 --requests 4000 --concurrency 64
    python ops/bench_submit.py --api-workers 1 --rate-limits     # with and without a rate-limited tenant
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import redis
from rich.console import Console
from rich.table import Table
from sqlalchemy import func, select

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.auth import create_key, create_tenant  # noqa: E402
from app.db.migrate import upgrade  # noqa: E402
from app.db.models import Job  # noqa: E402
from app.db.session import session_scope  # noqa: E402
from app.embedded import start_redis, terminate_group  # noqa: E402
from tests.conftest import free_port  # noqa: E402

console = Console(width=200)


async def _load(url: str, key: str, n: int, concurrency: int, submit: bool,
                rate: float | None = None) -> tuple[list[float], list[str], int, float]:
    """Returns latencies, accepted job ids, errors and the wall time of the timed part.

    Closed loop (``rate`` None): each of ``concurrency`` clients sends its next request
    as soon as the previous one is answered. Open loop: request i is due at i / rate
    seconds; a free client sends it then, and its latency counts from when it was due, so
    time spent waiting for a free client is included (no coordinated omission).
    """
    latencies: list[float] = []
    ids: list[str] = []
    errors = 0
    todo = iter(range(n))
    headers = {"Authorization": f"Bearer {key}"}
    # aiohttp: its client costs a fraction of httpx's CPU per request, and the client
    # shares this machine's cores with the server under test
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(base_url=url, headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=30)) as session:

        async def one_client() -> None:
            nonlocal errors
            for i in todo:
                due = t0 + i / rate if rate else time.perf_counter()
                if rate:
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                if submit:
                    body = {"prompt": f"Question {i}: what is {i} + {i}?", "max_tokens": 16, "tbt_ms": 200}
                    async with session.post("/v1/jobs", json=body) as r:
                        ok = r.status in (200, 201)
                        payload = await r.json() if ok else await r.read()
                else:
                    async with session.get("/healthz") as r:
                        ok = r.status == 200
                        await r.read()
                latencies.append(time.perf_counter() - due)
                if ok and submit:
                    ids.append(payload["id"])
                elif not ok:
                    errors += 1

        # open every connection first: the timed part measures steady state, not the TCP burst
        async def warm() -> None:
            async with session.get("/healthz") as r:
                await r.read()
        await asyncio.gather(*(warm() for _ in range(concurrency)))
        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return latencies, ids, errors, wall


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by every process in the process group."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # pgrp; utime and stime follow at 11 and 12
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def run_config(api_workers: int, n: int, concurrency: int, model: str, rate: float,
               limited: bool = False) -> list[dict]:
    """``limited``: the tenant has rate limits too high to refuse anything, so every submission pays the bucket
    check (one Redis script call) and nothing else changes."""
    data = Path(tempfile.mkdtemp(prefix="bench-submit-"))
    db = f"sqlite:///{data / 'coserve.db'}"
    upgrade(db)
    with session_scope(db) as s:
        tenant = create_tenant(s, "bench")
        if limited:
            tenant.requests_per_minute = tenant.tokens_per_minute = 10**9
        key = create_key(s, tenant)[1]
    rproc, rurl = start_redis(data / "redis")
    port = free_port()
    env = dict(os.environ, REDIS_URL=rurl, COSERVE_DATABASE_URL=db, COSERVE_DATA_DIR=str(data),
               COSERVE_MODEL=model, COSERVE_MODEL_NAME="bench")
    api = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "app.main:app_factory", "--port", str(port),
                            "--workers", str(api_workers), "--log-level", "warning", "--no-access-log"],
                           env=env, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or api.poll() is not None:
                raise RuntimeError("API did not start")
            time.sleep(0.2)
        # warm up every API process (tokenizer load, connection pools)
        asyncio.run(_load(url, key, 50 * api_workers, 8, True))
        rclient = redis.Redis.from_url(rurl)
        rclient.delete("coserve.bench")
        phases = [("GET /healthz (baseline)", False, None), ("POST /v1/jobs", True, None)]
        if rate:
            phases.append(("POST /v1/jobs", True, rate))
        for label, submit, phase_rate in phases:
            cpu0 = group_cpu_s(api.pid)
            lat, ids, errors, wall = asyncio.run(_load(url, key, n, concurrency, submit, phase_rate))
            cpu_ms = 1e3 * (group_cpu_s(api.pid) - cpu0) / n
            row = {"config": f"{api_workers} uvicorn worker(s)" + (", rate-limited tenant" if limited else ""),
                   "endpoint": label, "n": n, "errors": errors,
                   "load": f"open loop, {phase_rate:.0f}/s offered" if phase_rate else "closed loop",
                   "rps": n / wall, "p50_ms": 1e3 * float(np.percentile(lat, 50)),
                   "p99_ms": 1e3 * float(np.percentile(lat, 99)), "verified": "-",
                   "cpu_ms": cpu_ms}
            if submit:
                settle = time.monotonic() + 15  # the dispatcher thread sends right after the commit
                while rclient.llen("coserve.bench") < len(ids) and time.monotonic() < settle:
                    time.sleep(0.1)
                with session_scope(db) as s:
                    in_sql = s.scalar(select(func.count()).select_from(Job).where(Job.id.in_(ids)))
                queued = rclient.lrange("coserve.bench", 0, -1)
                queued_ids = {m.split(b'"args": ["')[1].split(b'"')[0].decode() for m in queued if b'"args"' in m}
                if not queued_ids:  # kombu puts the args in the base64 body
                    import base64
                    import json

                    queued_ids = {json.loads(base64.b64decode(json.loads(m)["body"]))[0][0] for m in queued}
                ok = in_sql == len(ids) and set(ids) <= queued_ids
                row["verified"] = f"{'OK' if ok else 'MISMATCH'}: {in_sql}/{len(ids)} in SQL, " \
                                  f"{len(set(ids) & queued_ids)}/{len(ids)} in queue"
            rows.append(row)
    finally:
        terminate_group([api, rproc])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--api-workers", default="1,2", help="comma-separated uvicorn worker counts to compare")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rate", type=float, default=500.0,
                    help="offered jobs/s of the open-loop phase (0: skip it); latency counts from each "
                         "request's due time")
    ap.add_argument("--model", default="smollm2-135m", help="tokenizer used to count prompt tokens")
    ap.add_argument("--rate-limits", action="store_true",
                    help="each configuration again with a rate-limited tenant (limits it never reaches): the cost of "
                         "the bucket check, side by side")
    args = ap.parse_args()
    rows = []
    for w in (int(x) for x in args.api_workers.split(",")):
        for limited in (False, True) if args.rate_limits else (False,):
            rows += run_config(w, args.requests, args.concurrency, args.model, args.rate, limited)
    t = Table(title=f"POST /v1/jobs submission, {args.concurrency} concurrent clients, {os.cpu_count()} CPUs "
                    f"(goal: >= 500 jobs/s, p99 < 50 ms)")
    for col in ("config", "endpoint", "load", "requests", "errors", "req/s", "p50 ms", "p99 ms", "API CPU ms/req",
                "req/s per API core", "accepted jobs check"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["config"], r["endpoint"], r["load"], str(r["n"]), str(r["errors"]), f"{r['rps']:.0f}",
                  f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{r['cpu_ms']:.2f}",
                  f"{1e3 / r['cpu_ms']:.0f}" if r["cpu_ms"] else "-", r["verified"])
    console.print(t)
    load = os.getloadavg()
    console.print(f"load average during the run: {load[0]:.1f} (on {os.cpu_count()} CPUs); the client shares the "
                  "CPUs with the server, so 'req/s per API core' is the server's capacity per core.")


if __name__ == "__main__":
    main()
