"""What the admin's reads cost as the jobs table grows (SQLite, the functions the routes call, no HTTP).

A SQLite file migrated by Alembic gets ``--jobs`` jobs of 20 tenants over the past 30 days (bulk SQL inserts, in
the order they were submitted), each with an X-Request-Id. Then, side by side:

- the dashboard's search by request id (``GET /admin/api/jobs?request_id=``) before ``ix_jobs_request`` (dropped
  for the "before" column) and with it;
- the dashboard's SLO chart (read by every overview poll, once a second) over ``--hour-jobs`` jobs finished in the
  last hour: first, every job's row went to Python to be counted; then SQL counted the hour's jobs at each poll
  (``slo_series``); now an API process keeps the minutes settled five minutes ago and counts the later ones again
  (``SloChart``: a poll that counts them, and one within ``SLO_FRESH_S`` of the last that counts nothing);
- the Usage API (``GET /v1/organization/usage/completions``) for an admin and for one tenant, with the index each
  query plan uses (it has no "before": these are here to show they stay on an index at this size).

    python ops/bench_admin_lookups.py --jobs 200000 --hour-jobs 100000 --repeat 5
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

from rich.console import Console
from rich.table import Table
from sqlalchemy import insert, select, text
from sqlalchemy.dialects import sqlite

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.db.migrate import upgrade  # noqa: E402
from app.db.models import Job, Tenant  # noqa: E402
from app.db.session import session_scope  # noqa: E402
from app.services import usage  # noqa: E402
from app.services.transitions import as_utc, utcnow  # noqa: E402

TENANTS = 20
CHUNK = 20_000  # rows an insert
DAYS = 30


def fill(url: str, jobs: int, hour_jobs: int, seed: int = 0) -> None:
    upgrade(url)
    rnd = random.Random(seed)
    now = utcnow()
    ages = sorted([*(rnd.uniform(3600, DAYS * 86400) for _ in range(jobs - hour_jobs)),
                   *(rnd.uniform(1, 3600) for _ in range(hour_jobs))], reverse=True)  # oldest first, as submitted
    with session_scope(url) as s:
        s.add_all(Tenant(id=f"t{i}", name=f"tenant {i}", default_tier="paid") for i in range(TENANTS))
        s.commit()
        rows = []
        for i, age in enumerate(ages):
            rows.append({"id": f"job_{i:08d}", "tenant_id": f"t{rnd.randrange(TENANTS)}", "kind": "interactive",
                         "tier": rnd.choice(("free", "paid")), "model": "m", "sampling": {}, "status": "succeeded",
                         "created_at": now - timedelta(seconds=age), "request_id": f"req-{i:08d}",
                         "finished_at": now - timedelta(seconds=age - 1),
                         "api_key_id": f"key{rnd.randrange(2 * TENANTS)}", "prompt_tokens": rnd.randrange(10, 2000),
                         "completion_tokens": rnd.randrange(1, 500), "slo_met": rnd.random() < 0.9,
                         "relegation_count": int(rnd.random() < 0.05)})
            if len(rows) == CHUNK:
                s.execute(insert(Job), rows)
                rows = []
        if rows:
            s.execute(insert(Job), rows)
        s.commit()  # no ANALYZE: coserve never runs it, so SQLite plans without statistics as in production


def slo_series_before(session, minutes: int, bucket_s: int = 60) -> list[dict]:
    """The SLO chart's counts as coserve made them before: every finished job's row counted in Python."""
    since = utcnow() - timedelta(minutes=minutes)
    rows = session.execute(select(Job.finished_at, Job.tier, Job.slo_met)
                           .where(Job.finished_at >= since, Job.slo_met.is_not(None))).all()
    acc: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])
    for finished_at, tier, met in rows:
        acc[(int(as_utc(finished_at).timestamp()) // bucket_s * bucket_s, tier)][0 if met else 1] += 1
    return [{"t": t, "tier": tier, "met": m, "violated": v} for (t, tier), (m, v) in sorted(acc.items())]


def timed(fn, repeat: int) -> float:
    """Best of ``repeat`` runs, in milliseconds."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return 1000 * best


def plan(session, stmt) -> str:
    sql = str(stmt.compile(dialect=sqlite.dialect(), compile_kwargs={"literal_binds": True}))
    return "; ".join(row[3] for row in session.execute(text("EXPLAIN QUERY PLAN " + sql)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=200_000)
    ap.add_argument("--hour-jobs", type=int, default=100_000, help="of --jobs, those finished in the last hour")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    url = f"sqlite:///{tempfile.mkdtemp(prefix='coserve-bench-')}/bench.db"
    t = time.perf_counter()
    fill(url, args.jobs, min(args.hour_jobs, args.jobs))
    console = Console()
    console.print(f"{args.jobs:,} jobs of {TENANTS} tenants over {DAYS} days filled in {time.perf_counter() - t:.1f} s")

    from app.api.admin import jobs_of_request

    wanted = f"req-{args.jobs // 2:08d}"
    lookup = Table(title="admin search by request id (GET /admin/api/jobs?request_id=)")
    for col in ("", "before (no ix_jobs_request)", "after (ix_jobs_request)"):
        lookup.add_column(col)
    with session_scope(url) as s:
        s.execute(text("DROP INDEX ix_jobs_request"))
        before = timed(lambda: jobs_of_request(s, None, wanted), args.repeat)
        before_plan = s.execute(text("EXPLAIN QUERY PLAN SELECT id FROM jobs WHERE request_id = :r"),
                                {"r": wanted}).all()[0][3]
        s.execute(text("CREATE INDEX ix_jobs_request ON jobs (request_id)"))
        found = jobs_of_request(s, None, wanted)["data"]
        assert [j["id"] for j in found] == [f"job_{args.jobs // 2:08d}"], found
        after = timed(lambda: jobs_of_request(s, None, wanted), args.repeat)
        after_plan = s.execute(text("EXPLAIN QUERY PLAN SELECT id FROM jobs WHERE request_id = :r"),
                               {"r": wanted}).all()[0][3]
    lookup.add_row("ms (best of %d)" % args.repeat, f"{before:.2f}", f"{after:.2f}")
    lookup.add_row("query plan", before_plan, after_plan)
    console.print(lookup)

    from app.observability.slo_chart import SloChart, slo_series

    finished = min(args.hour_jobs, args.jobs)
    chart = Table(title=f"the SLO chart's counts over {finished:,} jobs finished in the last hour, per poll")
    for col in ("", "rows to Python", "before: the hour in SQL", "after: the unsettled minutes in SQL",
                "after: within SLO_FRESH_S"):
        chart.add_column(col)
    with session_scope(url) as s:
        old, new = slo_series_before(s, 60), slo_series(s, 60)
        oldest = min(p["t"] for p in old + new)  # the window's first minute loses jobs as the clock moves on
        # the same counts (SQLite reads a time to the millisecond: a job within half of one of a minute's end may
        # count in the next minute)
        total = lambda points: sum(p["met"] + p["violated"] for p in points if p["t"] > oldest)  # noqa: E731
        assert total(old) == total(new), (total(old), total(new))
        counting, lazy = SloChart(fresh_s=0), SloChart()  # the first counts the recent minutes at every poll
        assert counting.series(s, 60) == lazy.series(s, 60) == slo_series(s, 60)  # the settled minutes kept
        python = timed(lambda: slo_series_before(s, 60), args.repeat)
        before = timed(lambda: slo_series(s, 60), args.repeat)
        after = timed(lambda: counting.series(s, 60), args.repeat)
        memo = timed(lambda: lazy.series(s, 60), args.repeat)
    chart.add_row("ms (best of %d)" % args.repeat, f"{python:.1f}", f"{before:.1f}", f"{after:.1f}", f"{memo:.2f}")
    console.print(chart)

    end = int(utcnow().timestamp()) + 1
    queries = {"admin, 30 days by day": usage.UsageQuery(end - DAYS * 86400, end, "1d", 31),
               "one tenant, 30 days by day": usage.UsageQuery(end - DAYS * 86400, end, "1d", 31, tenant_ids=("t3",)),
               "admin, last day by tenant (dashboard)": usage.UsageQuery(end - 86400, end, "1d", 1,
                                                                          group_by=("project_id",)),
               "admin, 7 days by hour, key and model": usage.UsageQuery(end - 7 * 86400, end, "1h", 168,
                                                                         group_by=("api_key_id", "model"))}
    table = Table(title="Usage API (completions_usage)")
    for col in ("query", "ms (best of %d)" % args.repeat, "query plan"):
        table.add_column(col)
    with session_scope(url) as s:
        seen = []
        real = s.execute
        s.execute = lambda stmt, *a, **k: seen.append(stmt) or real(stmt, *a, **k)  # the statement it runs
        for name, q in queries.items():
            ms = timed(lambda q=q: usage.completions_usage(s, q, str), args.repeat)
            table.add_row(name, f"{ms:.1f}", plan(s, seen[-1]))
    console.print(table)


if __name__ == "__main__":
    main()
