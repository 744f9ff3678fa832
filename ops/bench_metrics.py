"""What a ``/metrics`` scrape costs the API as the jobs table grows (SQLite; the SQL collector alone, no HTTP).

A SQLite file gets ``--jobs`` ended jobs spread over the past week (and a few live ones), then each row scrapes
``--scrapes`` times: "first scrape" deletes the kept totals before each scrape (a deployment's first scrape; before
stop 56 it read every finished job), "kept totals" reads from the totals the scrape before kept, as the API does.

    python ops/bench_metrics.py --jobs 300000 --scrapes 4
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console
from rich.table import Table
from sqlalchemy import insert

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.db.migrate import upgrade  # noqa: E402
from app.db.models import Job, MetricTotals, Tenant  # noqa: E402
from app.db.session import session_scope  # noqa: E402
from app.observability.collector import SqlCollector  # noqa: E402
from app.services.transitions import utcnow  # noqa: E402

ENDS = ["succeeded"] * 8 + ["failed", "cancelled", "expired"]
CHUNK = 20_000  # rows an insert


def fill(url: str, jobs: int, seed: int = 0) -> None:
    """``jobs`` ended jobs over the past week, with every value a series reads; 20 live ones."""
    upgrade(url)
    rng, now = random.Random(seed), utcnow()
    with session_scope(url) as s:
        tenant = Tenant(name="bench")
        s.add(tenant)
        s.flush()
        tenant_id = tenant.id

    def row(i: int) -> dict:
        ended = now - timedelta(seconds=rng.uniform(600, 7 * 86400))
        status = ENDS[i % len(ENDS)] if i >= 20 else "running"
        return dict(tenant_id=tenant_id, kind=rng.choice(["interactive", "batch"]), tier=rng.choice(["free", "paid"]),
                    model="bench", status=status, prompt="x", sampling={}, created_at=ended - timedelta(seconds=60),
                    started_at=ended - timedelta(seconds=50), finished_at=ended if status != "running" else None,
                    settled_at=ended if status != "running" else None,
                    ttft_s=rng.uniform(0, 3), tbt_p50_s=rng.uniform(0, 0.2), ttlt_s=rng.uniform(0, 60),
                    queue_s=rng.uniform(0, 2), slo_met=rng.random() < 0.8, finish_reason=rng.choice(["stop", "length"]),
                    prompt_tokens=100, completion_tokens=20, cached_tokens=10)

    for start in range(0, jobs, CHUNK):
        with session_scope(url) as s:
            s.execute(insert(Job), [row(i) for i in range(start, min(jobs, start + CHUNK))])


def scrape(url: str, keep: bool) -> float:
    """Seconds one scrape's SQL and rendering took; ``keep``: from the totals kept before (else none are)."""
    if not keep:
        with session_scope(url) as s:
            s.query(MetricTotals).delete()
    began = time.perf_counter()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SqlCollector(url, "bench", tiers=("free", "paid")))
    generate_latest(registry)
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=300_000)
    ap.add_argument("--scrapes", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/metrics.db"
        began = time.perf_counter()
        fill(url, args.jobs)
        console = Console()
        console.print(f"{args.jobs:,} jobs written in {time.perf_counter() - began:.0f} s")
        rows = [("first scrape (no totals kept)", [scrape(url, keep=False) for _ in range(args.scrapes)]),
                ("kept totals (as the API keeps them)", [scrape(url, keep=True) for _ in range(args.scrapes)])]
    table = Table(title=f"/metrics SQL collector, {args.jobs:,} jobs (SQLite), seconds per scrape")
    table.add_column("collector")
    for i in range(args.scrapes):
        table.add_column(f"scrape {i + 1}", justify="right")
    for name, times in rows:
        table.add_row(name, *(f"{t:.2f}" for t in times))
    console.print(table)


if __name__ == "__main__":
    main()
