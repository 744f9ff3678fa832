"""The store's hot queries on PostgreSQL at scale: their plans, and what migration 0045's indexes change.

A throwaway PostgreSQL cluster (the one tests/integration/test_postgres.py starts) gets a database migrated by
Alembic to 0044 and a population of ``--jobs`` jobs of 50 tenants in every state, ``--batches`` batches (OpenAI and
message batches) with their files, workers, job events, webhook deliveries and summarization runs, then ANALYZE.
The code's own functions run on it (the worker's lease, acquire and renewal, the sweeper, the list endpoints with
cursors and status filters, the admin dashboard, usage, webhook claims) while an engine hook records each statement
they send with its parameters. Each statement is then explained (EXPLAIN (ANALYZE, BUFFERS), in a transaction
rolled back, best of ``--repeat``) at 0044, and again after the upgrade to 0045 and ANALYZE.

    python ops/bench_store_queries.py --jobs 200000 --batches 2000 --repeat 3

Rate limits are not here: they are counted in Redis (app/services/rate_limits.py), not in SQL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

from rich.console import Console
from rich.table import Table
from sqlalchemy import create_engine, event, insert, select, text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.db.migrate import upgrade  # noqa: E402
from app.db.models import (ApiKey, Batch, File, Job, JobEvent, SummarizationRun, Tenant, WebhookDelivery,  # noqa: E402
                           WebhookEndpoint, WorkerState)
from app.db.session import get_engine, session_scope  # noqa: E402
from app.services.transitions import utcnow  # noqa: E402

TENANTS = 50
CHUNK = 10_000
# jobs' statuses and their shares: most have ended; the open ones are the few the hot queries look for
JOB_STATUSES = {"succeeded": 0.90, "failed": 0.03, "cancelled": 0.025, "expired": 0.01, "queued": 0.01,
                "dispatched": 0.005, "running": 0.015, "relegated": 0.005}
BATCH_STATUSES = {"completed": 0.88, "failed": 0.02, "cancelled": 0.03, "expired": 0.03, "in_progress": 0.03,
                  "validating": 0.005, "finalizing": 0.005}
MESSAGES = "/v1/messages"
OPEN = ("queued", "dispatched", "running", "relegated")


@contextlib.contextmanager
def cluster() -> Iterator[str]:
    """A PostgreSQL server on a loopback port, as tests/integration/test_postgres.py starts one; yields its URL."""
    from tests.conftest import free_port
    from tests.integration.test_postgres import _as_owner, _bin_dir, _server_user

    bin_dir, user = _bin_dir(), _server_user()
    if bin_dir is None:
        sys.exit("PostgreSQL is not installed (apt-get install postgresql)")
    base = Path(tempfile.mkdtemp(prefix="coserve-pg-bench-"))
    data, sock = base / "data", base / "sock"
    sock.mkdir()
    if user is not None:
        shutil.chown(base, user, user)
        shutil.chown(sock, user, user)
    port = free_port()
    run = dict(check=True, capture_output=True, text=True, timeout=120)
    subprocess.run(_as_owner([str(bin_dir / "initdb"), "-D", str(data), "-U", "coserve", "--auth=trust", "-E", "UTF8",
                              "--no-sync"], user), **run)
    subprocess.run(_as_owner([str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(base / "server.log"), "-w", "-t",
                              "60", "-o", f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off", "start"],
                             user), **run)
    try:
        admin = create_engine(f"postgresql+psycopg2://coserve@127.0.0.1:{port}/postgres", isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text("CREATE DATABASE bench"))
        admin.dispose()
        yield f"postgresql+psycopg2://coserve@127.0.0.1:{port}/bench"
    finally:
        subprocess.run(_as_owner([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"], user),
                       capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)


def _pick(rnd: random.Random, shares: dict[str, float]) -> str:
    return rnd.choices(list(shares), weights=list(shares.values()))[0]


def fill(url: str, jobs: int, batches: int, seed: int = 0) -> None:
    """The population, written in bulk (Core inserts: the models' Python defaults apply)."""
    rnd = random.Random(seed)
    now = utcnow()
    day = 86400
    with session_scope(url) as s:
        s.execute(insert(Tenant), [{"id": f"t{i:02d}", "name": f"tenant {i}"} for i in range(TENANTS)])
        s.execute(insert(ApiKey), [{"id": f"key{i:03d}", "tenant_id": f"t{i % TENANTS:02d}", "key_hash": f"h{i}",
                                    "prefix": "sk"} for i in range(2 * TENANTS)])
        s.execute(insert(WorkerState), [{"id": f"w{i}", "model": "m", "queue": "m", "device": "cuda",
                                         "heartbeat_at": now - timedelta(seconds=60 * (i >= 6))} for i in range(8)])
        files, rows = [], []
        for i in range(batches):
            tenant = f"t{rnd.randrange(TENANTS):02d}"
            created = now - timedelta(seconds=rnd.uniform(0, 30 * day))
            status = _pick(rnd, BATCH_STATUSES)
            messages = rnd.random() < 0.2
            files.append({"id": f"file_in{i:06d}", "tenant_id": tenant, "filename": "in.jsonl",
                          "purpose": "message_batch" if messages else "batch", "bytes": 1000, "path": "x",
                          "created_at": created, "deleted": rnd.random() < 0.05,
                          "expires_at": created + timedelta(days=30) if rnd.random() < 0.5 else None})
            if status == "completed":
                files.append({"id": f"file_out{i:06d}", "tenant_id": tenant, "filename": "out.jsonl",
                              "purpose": "message_batch_results" if messages else "batch_output", "bytes": 1000,
                              "path": "x", "created_at": created + timedelta(hours=1),
                              "expires_at": created + timedelta(days=30)})
            rows.append({"id": f"batch_{i:06d}", "tenant_id": tenant, "endpoint": MESSAGES if messages else
                         "/v1/chat/completions", "input_file_id": f"file_in{i:06d}", "completion_window": "24h",
                         "status": status, "tier": "paid", "created_at": created, "total": 100,
                         "completed": 100 if status == "completed" else 10,
                         "finalizing_at": now - timedelta(hours=1) if status == "finalizing" else None,
                         "deleted_at": now if messages and rnd.random() < 0.1 else None})
        for i in range(batches):  # files users uploaded for other purposes
            files.append({"id": f"file_up{i:06d}", "tenant_id": f"t{rnd.randrange(TENANTS):02d}", "filename": "f",
                          "purpose": "fine-tune", "bytes": 10, "path": "x",
                          "created_at": now - timedelta(seconds=rnd.uniform(0, 30 * day))})
        s.execute(insert(File), files)
        s.execute(insert(Batch), rows)
        open_batches = [r["id"] for r in rows if r["status"] == "in_progress"]
        # the jobs not ended are the last ten minutes' (queued, held by a worker), the rest over 30 days
        statuses = [_pick(rnd, JOB_STATUSES) for _ in range(jobs)]
        ages = [rnd.uniform(0, 600) if st in OPEN else rnd.uniform(600, 30 * day) for st in statuses]
        events, rows = [], []
        for i, (age, status) in enumerate(sorted(zip(ages, statuses, strict=True), reverse=True)):
            created = now - timedelta(seconds=age)
            in_batch = rnd.random() < 0.5
            ended = status in ("succeeded", "failed", "cancelled", "expired")
            held = status in ("dispatched", "running", "relegated")
            chat = rnd.random() < 0.6
            rows.append({"id": f"job_{i:08d}", "tenant_id": f"t{rnd.randrange(TENANTS):02d}",
                         "kind": "batch" if in_batch else "interactive", "tier": rnd.choice(("free", "paid")),
                         "model": "m", "status": status, "created_at": created, "request_id": f"req-{i:08d}",
                         "batch_id": (rnd.choice(open_batches) if not ended else f"batch_{rnd.randrange(batches):06d}")
                         if in_batch else None,
                         "endpoint": "/v1/chat/completions" if chat else "/v1/responses",
                         "response": {"store": rnd.random() < 0.3} if chat else {"store": True},
                         "api_key_id": f"key{rnd.randrange(2 * TENANTS):03d}", "prompt_tokens": rnd.randrange(10, 2000),
                         "completion_tokens": rnd.randrange(1, 500) if ended else None, "slo_met": rnd.random() < 0.9,
                         "finished_at": created + timedelta(seconds=5) if ended else None,
                         "settled_at": created + timedelta(seconds=5) if ended else None,
                         "worker_id": f"w{rnd.randrange(8)}" if held else None,
                         # a few leases lapsed (a worker died): the sweeper's work
                         "lease_expires_at": (now + timedelta(seconds=-60 if rnd.random() < 0.02 else 30)
                                              if held else None),
                         "attempt": 1 if held or ended else 0, "relegation_count": int(status == "relegated")})
            events.append({"job_id": f"job_{i:08d}", "from_status": "running", "to_status": status, "at": created})
            if len(rows) == CHUNK:
                s.execute(insert(Job), rows)
                s.execute(insert(JobEvent), events)
                events, rows = [], []
        if rows:
            s.execute(insert(Job), rows)
            s.execute(insert(JobEvent), events)
        s.execute(insert(WebhookEndpoint), [{"id": f"we{i:02d}", "tenant_id": f"t{i:02d}", "name": "e", "url": "x",
                                             "event_types": [], "secret": "whsec_x"} for i in range(TENANTS)])
        deliveries = [{"id": f"wh_{i:08d}", "endpoint_id": f"we{rnd.randrange(TENANTS):02d}", "event_id": f"ev{i}",
                       "type": "batch.completed", "body": "{}", "created_at": now - timedelta(seconds=i),
                       "next_attempt_at": now - timedelta(seconds=i),
                       "delivered_at": now if i >= 200 else None} for i in range(jobs // 4)]
        for at in range(0, len(deliveries), CHUNK):
            s.execute(insert(WebhookDelivery), deliveries[at:at + CHUNK])
        s.execute(insert(SummarizationRun), [
            {"id": f"sum_{i:06d}", "tenant_id": f"t{rnd.randrange(TENANTS):02d}", "model": "m", "tier": "paid",
             "status": "running" if i % 50 == 0 else "completed", "deadline_at": now + timedelta(hours=1),
             "max_summary_tokens": 100, "chunk_tokens": 500, "overlap_tokens": 0,
             "created_at": now - timedelta(seconds=rnd.uniform(0, 30 * day))} for i in range(batches)])
    with get_engine(url).connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))


def hot_queries(url: str, redis_url: str, data_dir: Path) -> dict[str, Callable[[], object]]:
    """What the code runs most, by name: each a call of the code's own function on a session."""
    from starlette.requests import Request

    from app.api import admin, batches, files, message_batches
    from app.auth import Principal
    from app.batch.finalize import stalled_or_open
    from app.batch.objects import batch_usage
    from app.batch.storage import delete_expired_files
    from app.services import jobs as job_service
    from app.services import stored_completions, usage, webhooks
    from app.settings import Settings
    from app.summarize.driver import advance_open_runs
    from workers import lease, sweeper

    settings = Settings(data_dir=data_dir, database_url=url, REDIS_URL=redis_url)
    tenant = "t07"
    me = Principal(key_id="key007", tenant_id=tenant, tier="paid", is_admin=True)
    request = Request({"type": "http", "method": "GET", "path": "/", "headers": [], "query_string": b"",
                       "server": ("coserve", 80), "scheme": "http", "root_path": "", "router": message_batches.router})
    with session_scope(url) as s:
        held = s.execute(select(Job.id, Job.worker_id, Job.attempt).where(Job.status == "running")).first()
        queued = s.scalar(select(Job.id).where(Job.status == "queued").limit(1))
        page2 = job_service.list_jobs(s, tenant, limit=20)[1]
        open_batch = s.scalar(select(Batch.id).where(Batch.status == "in_progress").limit(1))
        run_ids = list(s.scalars(select(SummarizationRun.id).limit(20)))
    end = int(utcnow().timestamp()) + 1

    def leases(s):
        mine = lease.Lease(held.id, held.attempt, held.worker_id)
        lease.renew(s, held.worker_id, [mine], 30)

    def open_batches(s):
        return s.scalars(select(Batch.id).where(stalled_or_open())).all()  # workers.batch_tasks.finalize_open_batches

    def stalled_validation(s):  # workers.batch_tasks.restart_stalled_validation's scan
        return s.scalars(select(Batch.id).where(Batch.status == "validating",
                                                Batch.created_at < utcnow() - timedelta(seconds=300))).all()

    return {
        "lease: acquire a queued job": lambda s: lease.acquire(s, queued, "w0", 30),
        "lease: renew the held jobs": leases,
        "lease: drop held marks (worker start)": lambda s: lease.drop_held_marks(s, "w0"),
        "lease: settle lapsed stopped jobs": lambda s: lease.settle_lapsed(s, utcnow(), 500),
        "sweeper: sweep": lambda s: sweeper.sweep(s, redis_url),
        "jobs list: first page": lambda s: job_service.list_jobs(s, tenant, limit=20),
        "jobs list: cursor page": lambda s: job_service.list_jobs(s, tenant, limit=20, cursor=page2),
        "jobs list: status=failed": lambda s: job_service.list_jobs(s, tenant, status="failed", limit=20),
        "jobs list: status=running": lambda s: job_service.list_jobs(s, tenant, status="running", limit=20),
        "jobs list: batch_id": lambda s: job_service.list_jobs(s, tenant, batch_id=open_batch, limit=20),
        "batches list": lambda s: batches.list_batches(s, me, settings, limit=20),
        "message batches list": lambda s: message_batches.list_message_batches(request, s, me, settings, limit=20),
        "files list": lambda s: files.list_files(s, me, limit=100),
        "files list: purpose=batch_output": lambda s: files.list_files(s, me, purpose="batch_output", limit=100),
        "stored completions list": lambda s: stored_completions.page(s, tenant, ("free", "paid"), limit=20,
                                                                     order="desc"),
        "batch usage of a page": lambda s: batch_usage(s, [open_batch]),
        "admin overview (relegated, counts)": lambda s: admin.overview(s, settings, me, minutes=60),
        "admin overview: queued page": lambda s: admin.overview(s, settings, me, status_=["queued"]),
        "admin summarizations": lambda s: admin.summarizations(s, me, limit=20),
        "usage: one tenant, 30 days": lambda s: usage.completions_usage(
            s, usage.UsageQuery(end - 30 * 86400, end, "1d", 31, tenant_ids=(tenant,)), str),
        "webhooks: due deliveries": lambda s: s.execute(webhooks.due_query(50)).all(),
        "batches: open or stalled (finalizer)": open_batches,
        "batches: stalled validation": stalled_validation,
        "files: expired (sweeper)": lambda s: delete_expired_files(s),
        "webhooks: delete settled (sweeper)": lambda s: webhooks.delete_settled(s, timedelta(days=7)),
        "summarization runs: open (sweeper)": lambda s: advance_open_runs(settings, "w0"),
        "summarization runs": lambda s: s.scalars(select(SummarizationRun).where(
            SummarizationRun.id.in_(run_ids))).all(),
    }


def capture(url: str, queries: dict[str, Callable]) -> dict[str, list[tuple[str, object]]]:
    """Each query's statements as sent to the server, with their parameters."""
    seen: dict[str, list[tuple[str, object]]] = {}
    current: list[tuple[str, object]] = []

    def hook(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001, ARG001
        if not executemany and statement.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE", "WITH")):
            current.append((statement, parameters))

    engine = get_engine(url)
    event.listen(engine, "before_cursor_execute", hook)
    try:
        for name, fn in queries.items():
            current.clear()
            with session_scope(url) as s:
                fn(s)
            seen[name] = list(current)
    finally:
        event.remove(engine, "before_cursor_execute", hook)
    return seen


def _nodes(node: dict) -> Iterator[dict]:
    yield node
    for child in node.get("Plans", ()):
        yield from _nodes(child)


SHOWN_NODES = ("Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Index Scan", "Sort")


def _node(node: dict) -> str:
    """A plan node in short: its type, the index or table it reads, the rows it gave."""
    where = node.get("Index Name") or node.get("Relation Name")
    return f"{node['Node Type']}{' ' + where if where else ''} ({node['Actual Rows']}r)"


def explain(url: str, statement: str, parameters: object, repeat: int) -> tuple[float, str]:
    """Best execution time (ms) of ``repeat`` EXPLAIN ANALYZE runs, rolled back, and the plan's shape in short."""
    raw = get_engine(url).raw_connection()
    try:
        best, shape = float("inf"), ""
        for _ in range(repeat):
            cur = raw.cursor()
            cur.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, parameters)
            out = cur.fetchone()[0]
            raw.rollback()
            top = (out if isinstance(out, list) else json.loads(out))[0]
            if top["Execution Time"] < best:
                best = top["Execution Time"]
                shape = ", ".join(_node(n) for n in _nodes(top["Plan"]) if n["Node Type"] in SHOWN_NODES)
        return best, shape
    finally:
        raw.close()


def measure(url: str, seen: dict[str, list[tuple[str, object]]], repeat: int) -> dict[str, list[tuple[float, str]]]:
    """Per query, each of its statements' best time (ms) and plan shape."""
    return {name: [explain(url, sql, params, repeat) for sql, params in statements]
            for name, statements in seen.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=200_000)
    ap.add_argument("--batches", type=int, default=2_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--detail", action="store_true", help="print each statement above 1 ms and its plan")
    ap.add_argument("--before", default="0044", help="the revision measured first")
    args = ap.parse_args()
    from app.embedded import start_redis

    console = Console(width=300)
    data_dir = Path(tempfile.mkdtemp(prefix="coserve-bench-"))
    redis, redis_url = start_redis(data_dir)
    with cluster() as url, contextlib.ExitStack() as stack:
        stack.callback(redis.terminate)
        upgrade(url, args.before)
        fill(url, args.jobs, args.batches)
        console.print(f"{args.jobs:,} jobs, {args.batches:,} batches of {TENANTS} tenants; at {args.before}")
        seen = capture(url, hot_queries(url, redis_url, data_dir))
        before = measure(url, seen, args.repeat)
        upgrade(url)
        with get_engine(url).connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))
        after = measure(url, seen, args.repeat)
    table = Table(title=f"hot queries, EXPLAIN ANALYZE best of {args.repeat} (ms: the query's statements summed)")
    for col in ("query", "stmts", f"before ms ({args.before})", "after ms (head)", "slowest statement's plan before",
                "after"):
        table.add_column(col, overflow="fold")
    for name, statements in seen.items():
        b, a = before[name], after[name]
        slowest = max(range(len(b)), key=lambda i: b[i][0], default=None)
        plans = (b[slowest][1], a[slowest][1]) if slowest is not None else ("", "")
        table.add_row(name, str(len(b)), f"{sum(ms for ms, _ in b):.2f}", f"{sum(ms for ms, _ in a):.2f}", plans[0],
                      plans[1] if plans[1] != plans[0] else "same")
        for (sql, _params), (b_ms, b_plan), (a_ms, a_plan) in zip(statements, b, a, strict=True):
            if args.detail and max(b_ms, a_ms) > 1:
                console.print(f"[bold]{name}[/bold] {b_ms:.2f} -> {a_ms:.2f} ms: {' '.join(sql.split())[:300]}\n"
                              f"  before: {b_plan}\n  after: {a_plan}")
    console.print(table)

if __name__ == "__main__":
    main()
