"""Submission throughput of ``POST /v1/jobs`` on the embedded setup (SQLite WAL + Redis).

For each API configuration it starts a fresh data dir, an embedded redis-server and
uvicorn, then runs ``--concurrency`` async httpx clients for ``--requests`` jobs and
reports jobs/s and latency percentiles. Afterwards it checks that every accepted job is
in SQL and its id is in the model's Redis queue. ``GET /healthz`` through the same
server is the baseline (the HTTP floor without DB or broker work).

    python ops/bench_submit.py --api-workers 1,2 --requests 4000 --concurrency 64
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

console = Console()


async def _load(url: str, key: str, n: int, concurrency: int, submit: bool) -> tuple[list[float], list[str], int, float]:
    """Returns latencies, accepted job ids, errors and the wall time of the timed part."""
    latencies: list[float] = []
    ids: list[str] = []
    errors = 0
    todo = iter(range(n))
    # one AsyncClient (one keep-alive connection) per simulated client: a single shared
    # client's connection pool costs more CPU than the server at 64 connections
    clients = [httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
               for _ in range(concurrency)]

    async def one_client(client: httpx.AsyncClient) -> None:
        nonlocal errors
        for i in todo:
            t = time.perf_counter()
            if submit:
                r = await client.post("/v1/jobs", json={"prompt": f"Question {i}: what is {i} + {i}?",
                                                        "max_tokens": 16, "tbt_ms": 200})
            else:
                r = await client.get("/healthz")
            latencies.append(time.perf_counter() - t)
            if r.status_code in (200, 201):
                if submit:
                    ids.append(r.json()["id"])
            else:
                errors += 1
    try:
        # connect every client first: the timed part measures steady state, not the TCP burst
        await asyncio.gather(*(c.get("/healthz") for c in clients))
        t0 = time.perf_counter()
        await asyncio.gather(*(one_client(c) for c in clients))
        wall = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
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


def run_config(api_workers: int, n: int, concurrency: int, model: str) -> list[dict]:
    data = Path(tempfile.mkdtemp(prefix="bench-submit-"))
    db = f"sqlite:///{data / 'coserve.db'}"
    upgrade(db)
    with session_scope(db) as s:
        key = create_key(s, create_tenant(s, "bench"))[1]
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
        for label, submit in (("GET /healthz (baseline)", False), ("POST /v1/jobs", True)):
            cpu0 = group_cpu_s(api.pid)
            lat, ids, errors, wall = asyncio.run(_load(url, key, n, concurrency, submit))
            cpu_ms = 1e3 * (group_cpu_s(api.pid) - cpu0) / n
            row = {"config": f"{api_workers} uvicorn worker(s)", "endpoint": label, "n": n, "errors": errors,
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
    ap.add_argument("--model", default="smollm2-135m", help="tokenizer used to count prompt tokens")
    args = ap.parse_args()
    rows = []
    for w in (int(x) for x in args.api_workers.split(",")):
        rows += run_config(w, args.requests, args.concurrency, args.model)
    t = Table(title=f"POST /v1/jobs submission, {args.concurrency} concurrent clients, {os.cpu_count()} CPUs "
                    f"(goal: >= 500 jobs/s, p99 < 50 ms)")
    for col in ("config", "endpoint", "requests", "errors", "req/s", "p50 ms", "p99 ms", "API CPU ms/req",
                "req/s per API core", "accepted jobs check"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["config"], r["endpoint"], str(r["n"]), str(r["errors"]), f"{r['rps']:.0f}", f"{r['p50_ms']:.1f}",
                  f"{r['p99_ms']:.1f}", f"{r['cpu_ms']:.2f}", f"{1e3 / r['cpu_ms']:.0f}" if r["cpu_ms"] else "-",
                  r["verified"])
    console.print(t)
    load = os.getloadavg()
    console.print(f"load average during the run: {load[0]:.1f} (on {os.cpu_count()} CPUs); the client shares the "
                  "CPUs with the server, so 'req/s per API core' is the server's capacity per core.")


if __name__ == "__main__":
    main()
