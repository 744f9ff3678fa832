"""What a large Batch API fan-out does to interactive submissions and worker writes on SQLite (the default store).

For each line count it migrates a fresh SQLite database, starts an embedded redis-server and the real app
(TestClient), uploads an input file of N lines and creates the batch (``POST /v1/batches``: validation and fan-out
run as the request's background task). While the batch fans out, two probes write every ``--interval`` seconds:

* ``submit``: an interactive ``POST /v1/jobs`` through the same app (the group-commit submit path);
* ``worker``: a worker-style state write (``BEGIN IMMEDIATE``, an UPDATE, commit: what a worker's heartbeat and
  lease writes do, on their own connection, bounded by SQLite's busy timeout).

It prints each probe's latency (p50/p99/max) and failures during the fan-out. With ``--baseline DIR`` (a checkout of
other code, e.g. the commit before a change) it runs the same measurement with that code too and prints both side
by side.

``--mode cancel`` fans the batch out first (unprobed) and probes while the batch is cancelled instead
(``POST /v1/batches/{id}/cancel``: every job stopped, then its fan-in); ``--mode expire`` while the sweeper's fan-in
(``workers.batch_tasks.finalize_open_batches``) expires a batch whose completion window has ended. The "fan-out s"
column is then that operation's seconds.

    python ops/bench_fanout_lock.py --lines 10000,50000 --baseline /tmp/old-checkout
    python ops/bench_fanout_lock.py --lines 50000 --mode cancel
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import side_by_side

ROOT = Path(__file__).resolve().parents[1]


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    s = sorted(values)
    return {"p50": s[len(s) // 2], "p99": s[min(len(s) - 1, int(len(s) * 0.99))], "max": s[-1]}


def _probe(name: str, stop: threading.Event, interval: float, once, out: dict) -> None:
    """Calls ``once()`` every ``interval`` s (or right after the previous call, if that took longer) until ``stop``."""
    lat, failures = [], []
    due = time.perf_counter()
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            error = once()
        except Exception as exc:  # noqa: BLE001 - a failure is what is measured
            error = f"{type(exc).__name__}: {str(exc)[:80]}"
        lat.append(time.perf_counter() - t0)
        if error:
            failures.append(error)
        due += interval
        time.sleep(max(0.0, due - time.perf_counter()))
    out[name] = {"n": len(lat), "failed": len(failures), "first_failure": failures[0] if failures else None,
                 **_percentiles(lat)}


def measure(lines: int, interval: float, mode: str = "fanout") -> dict:
    """One run with the code on ``sys.path``; returns the figures."""
    sys.path.insert(0, os.environ.get("COSERVE_CODE", str(ROOT)))
    from fastapi.testclient import TestClient
    from sqlalchemy import func, select, text, update

    from app.auth import clear_cache
    from app.db.models import Batch, Job
    from app.db.session import session_scope
    from app.embedded import start_redis, terminate_group
    from app.main import create_app
    tmp = Path(tempfile.mkdtemp(prefix="bench-fanout-"))
    redis_proc, redis_url = start_redis(tmp / "redis")
    try:
        _, settings, keys = side_by_side.fresh_stack("bench-fanout-", 512, redis_url)
        db_url = settings.sqlalchemy_url
        auth = {"Authorization": f"Bearer {keys.paid}"}
        body = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                     "body": {"model": "tiny", "prompt": f"Say {i}", "max_tokens": 4}})
                         for i in range(lines))
        clear_cache()
        with TestClient(create_app(settings)) as client:
            file_id = client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                                  files={"file": ("in.jsonl", body.encode())}).json()["id"]
            probe_job = client.post("/v1/jobs", headers=auth, json={"prompt": "warm", "max_tokens": 2}).json()["id"]

            def submit() -> str | None:
                r = client.post("/v1/jobs", headers=auth, json={"prompt": "Hi there", "max_tokens": 4})
                return None if r.status_code in (200, 201) else f"HTTP {r.status_code}: {r.text[:80]}"

            def worker_write() -> None:
                with session_scope(db_url, immediate=True) as s:
                    s.execute(text("UPDATE jobs SET lease_expires_at = CURRENT_TIMESTAMP WHERE id = :id"),
                              {"id": probe_job})

            def create_batch():
                return client.post("/v1/batches", headers=auth, json={"input_file_id": file_id,
                                                                     "endpoint": "/v1/completions",
                                                                     "completion_window": "24h"})

            if mode != "fanout":  # the batch's jobs are there (unprobed) before the measured operation
                r = create_batch()
                batch_id = r.json()["id"]
                if mode == "expire":
                    with session_scope(db_url) as s:
                        s.execute(update(Batch).where(Batch.id == batch_id).values(
                            expires_at=datetime.now(UTC) - timedelta(seconds=1)))

            def operation():
                if mode == "cancel":
                    return client.post(f"/v1/batches/{batch_id}/cancel", headers=auth)
                if mode == "expire":
                    from workers.batch_tasks import finalize_open_batches

                    finalize_open_batches(db_url, settings.data_dir, redis_url)
                    return r
                return create_batch()

            stop, out = threading.Event(), {}
            probes = [threading.Thread(target=_probe, args=(n, stop, interval, f, out))
                      for n, f in (("submit", submit), ("worker", worker_write))]
            t0 = time.perf_counter()
            for p in probes:
                p.start()
            r = operation()
            fanout_s = time.perf_counter() - t0  # a background fan-out ends before TestClient answers
            stop.set()
            for p in probes:
                p.join()
        with session_scope(db_url) as s:
            batch = s.get(Batch, r.json()["id"])
            jobs = s.scalar(select(func.count()).select_from(Job).where(Job.batch_id == batch.id))
            ended = s.scalar(select(func.count()).select_from(Job).where(Job.batch_id == batch.id,
                                                                         Job.status.in_(("cancelled", "expired"))))
            status = batch.status
        return {"lines": lines, "mode": mode, "fanout_s": fanout_s, "batch": status, "jobs": jobs, "ended": ended,
                **out}
    finally:
        terminate_group([redis_proc])


def _row(label: str, fig: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:8.0f}"

    cells = [f"{label:<9}", f"{fig['fanout_s']:7.1f}", f"{fig['batch']:<11}", f"{fig['jobs']:>6}",
             f"{fig['ended']:>6}"]
    for probe in ("submit", "worker"):
        p = fig[probe]
        cells += [f"{p['n']:>4}", ms(p["p50"]), ms(p["p99"]), ms(p["max"]), f"{p['failed']:>4}"]
    return " | ".join(cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", default="10000", help="comma-separated line counts")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between a probe's writes")
    ap.add_argument("--mode", choices=("fanout", "cancel", "expire"), default="fanout",
                    help="what is probed: the batch's fan-out, its cancel, or its expiry by the sweeper")
    ap.add_argument("--baseline", help="a checkout of other code to measure too (e.g. before a change)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child run: print one run's JSON
    args = ap.parse_args()
    if args.one:
        side_by_side.report(measure(args.one, args.interval, args.mode))
        return
    header = ("code      | fan-out s | batch       |   jobs |  ended | submit n/p50 ms/p99/max/failed"
              " | worker n/p50 ms/p99/max/failed")
    rows = []
    for n in (int(x) for x in args.lines.split(",")):
        for label, code in side_by_side.checkouts(ROOT, args.baseline):
            fig = side_by_side.measure_in(__file__, code, ["--one", str(n), "--interval", str(args.interval),
                                                           "--mode", args.mode], f"{label} run of {n} lines")
            rows.append(f"{n:>6} " + _row(label, fig))
            print(rows[-1], flush=True)
            for probe in ("submit", "worker"):
                if fig[probe]["first_failure"]:
                    print(f"       {label} {probe}'s first failure: {fig[probe]['first_failure']}", flush=True)
    print("\n lines " + header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
