"""How long ``POST /v1/batches`` keeps its client at a large input file, and how long validation takes after it.

For each line count it migrates a fresh SQLite database, serves the real app with uvicorn (no broker: the jobs stay
queued), uploads an input file of N ``/v1/completions`` lines (one in ``--bad-every`` of them invalid) and creates
the batch. It prints:

* ``create ms``: the create request's wall time over HTTP (what the client waits for);
* ``validated s``: from the create until the batch left ``validating`` (its jobs written, ``in_progress``);
* ``poll ms``: the median and worst ``GET /v1/batches/{id}`` while it validates (the API's other requests share
  the process with the validation);
* ``parse s``: ``app.batch.lines.parse_file`` over the same file alone, in this process (the validation's CPU);
* ``jobs`` / ``invalid``: the batch's jobs and the lines its error file will hold (nothing accepted may be lost).

With ``--baseline DIR`` (a checkout of other code, e.g. ``git worktree add /tmp/main main``) it measures that code
too and prints both side by side, alternating the two per line count.

    python ops/bench_batch_create.py --lines 50000 --baseline /tmp/main
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import side_by_side

ROOT = Path(__file__).resolve().parents[1]


def _content(lines: int, bad_every: int) -> bytes:
    rows = []
    for i in range(lines):
        if bad_every and i % bad_every == bad_every - 1:
            rows.append(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                    "body": {"model": "tiny", "prompt": f"Say {i}", "max_tokens": -1}}))
        else:
            rows.append(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                    "body": {"model": "tiny", "prompt": f"Say {i}", "max_tokens": 4}}))
    return ("\n".join(rows) + "\n").encode()


def measure(lines: int, bad_every: int) -> dict:
    """One run with the code on ``sys.path``; returns the figures."""
    sys.path.insert(0, os.environ.get("COSERVE_CODE", str(ROOT)))
    import httpx
    from sqlalchemy import func, select

    from app.batch import lines as batch_lines
    from app.db.models import Job
    from app.db.session import session_scope
    from tests.e2e.conftest import serving

    _, settings, keys = side_by_side.fresh_stack("bench-batch-create-", 512)
    db_url = settings.sqlalchemy_url
    content = _content(lines, bad_every)
    t0 = time.perf_counter()
    batch_lines.parse_file(content, "/v1/completions", 86400.0, settings.tiers)
    parse_s = time.perf_counter() - t0
    with serving(settings) as url, httpx.Client(base_url=url, timeout=600,
                                                headers={"Authorization": f"Bearer {keys.paid}"}) as client:
        file_id = client.post("/v1/files", data={"purpose": "batch"},
                              files={"file": ("in.jsonl", content)}).json()["id"]
        client.get("/v1/batches")  # a warm connection and route
        t0 = time.perf_counter()
        r = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                             "completion_window": "24h"})
        create_ms = (time.perf_counter() - t0) * 1000
        if r.status_code != 200:
            raise SystemExit(f"create: HTTP {r.status_code}: {r.text[:300]}")
        batch = r.json()
        polls = []
        while batch["status"] == "validating":
            t1 = time.perf_counter()
            batch = client.get(f"/v1/batches/{batch['id']}").json()
            polls.append((time.perf_counter() - t1) * 1000)
            time.sleep(0.05)
        validated_s = time.perf_counter() - t0
    # the lines the error file will hold (written by the validation, served once the batch ends)
    invalid = len((Path(settings.data_dir) / "batches" / batch["id"] / "invalid.jsonl").read_text().splitlines())
    with session_scope(db_url) as s:
        jobs = s.scalar(select(func.count()).select_from(Job).where(Job.batch_id == batch["id"]))
    polls.sort()
    return {"lines": lines, "create_ms": create_ms, "validated_s": validated_s, "parse_s": parse_s,
            "poll_p50_ms": polls[len(polls) // 2] if polls else None, "poll_max_ms": polls[-1] if polls else None,
            "status": batch["status"], "counts": batch["request_counts"], "jobs": jobs, "invalid": invalid,
            "created_status": r.json()["status"]}


def _row(label: str, f: dict) -> str:
    def ms(v):
        return "       -" if v is None else f"{v:8.1f}"

    return " | ".join([f"{f['lines']:>6} {label:<9}", f"{f['created_status']:<11}", f"{f['create_ms']:9.1f}",
                       f"{f['validated_s']:11.2f}", ms(f["poll_p50_ms"]), ms(f["poll_max_ms"]),
                       f"{f['parse_s']:7.2f}", f"{f['status']:<11}", f"{f['jobs']:>6}", f"{f['invalid']:>7}"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", default="50000", help="comma-separated line counts")
    ap.add_argument("--bad-every", type=int, default=1000, help="one line in this many is invalid (0: none)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per checkout and line count, alternating")
    ap.add_argument("--baseline", help="a checkout of other code to measure too (e.g. before a change)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child run: print one run's JSON
    args = ap.parse_args()
    if args.one:
        side_by_side.report(measure(args.one, args.bad_every))
        return
    header = (" lines code      | answered    | create ms | validated s | poll p50 | poll max | parse s | ended      "
              " |   jobs | invalid")
    runs = [(["--one", str(n), "--bad-every", str(args.bad_every)], f"{n} lines")
            for n in (int(x) for x in args.lines.split(",")) for _ in range(args.repeat)]
    rows = side_by_side.measured_rows(__file__, ROOT, args.baseline, runs, _row)
    print("\n" + header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
