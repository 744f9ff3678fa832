"""PostgreSQL: migrations (upgrade, drift, downgrade, concurrent starts) and the lease SQL against a throwaway
cluster on a loopback port (conftest's ``pg_url``: ``tests/postgres.py``). Needs Debian's postgresql binaries
(scripts/test.sh installs them when it can) and psycopg2; skipped with the reason otherwise."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, func, inspect, select, text, update

from tests.conftest import ROOT
from tests.postgres import needs_a_server

pytestmark = [pytest.mark.integration, *needs_a_server()]


def test_migrations_upgrade_without_drift_and_downgrade(pg_url):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from app.db.migrate import downgrade, upgrade
    from app.db.models import Base

    upgrade(pg_url)
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        assert {"tenants", "api_keys", "jobs", "job_events", "files", "batches", "workers"} <= set(
            inspect(conn).get_table_names())
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == [], f"models and migrations drifted apart on PostgreSQL: {diff}"
    downgrade(pg_url, "base")
    with engine.connect() as conn:
        assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
    upgrade(pg_url)
    engine.dispose()


def test_a_database_built_by_revisions_as_first_written_is_repaired_on_postgres(pg_url):
    from app.db.migrate import upgrade
    from tests.integration.test_migrations import as_first_written, assert_schema_is_the_models

    as_first_written(pg_url)
    upgrade(pg_url)
    assert_schema_is_the_models(pg_url)


def test_concurrent_starts_migrate_once(pg_url):
    """Workers and the API all migrate at start (separate processes); the advisory lock serializes them."""
    code = "import sys; from app.db.migrate import upgrade; upgrade(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, pg_url], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(3)]
    outs = [(p.wait(180), p.stdout.read()) for p in procs]
    assert all(rc == 0 for rc, _ in outs), outs
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
        assert "jobs" in inspect(conn).get_table_names()
    engine.dispose()


def test_lease_sql_on_postgres(pg_url, tmp_path, redis_url):
    from app.auth import authenticate, clear_cache, create_key, create_tenant
    from app.db.migrate import upgrade
    from app.db.models import Job, JobEvent, JobStatus, WorkerState
    from app.db.session import session_scope
    from app.schemas import JobCreate
    from app.services import jobs as job_service
    from app.services.transitions import utcnow
    from app.settings import Settings
    from workers import lease as leases
    from workers.sweeper import sweep

    upgrade(pg_url)
    settings = Settings(data_dir=tmp_path, database_url=pg_url, REDIS_URL=redis_url, model_name="smollm2-135m")
    with session_scope(pg_url) as s:
        key = create_key(s, create_tenant(s, "acme"))[1]
    clear_cache()
    with session_scope(pg_url) as s:
        principal = authenticate(s, key)
        sub = lambda p, **kw: job_service.submit_job(  # noqa: E731
            s, principal, JobCreate(prompt=p, max_tokens=4), settings, dispatch=False, **kw)
        a, b, c = sub("a").job.id, sub("b").job.id, sub("c", idempotency_key="k1").job.id
        assert sub("c", idempotency_key="k1").job.id == c  # the idempotent path on PostgreSQL
        with pytest.raises(job_service.IdempotencyConflict):
            sub("other", idempotency_key="k1")
        rows, _ = job_service.list_jobs(s, principal.tenant_id, created_after=utcnow() - timedelta(minutes=5))
        assert {j.id for j in rows} == {a, b, c}

    with session_scope(pg_url) as s:
        la = leases.acquire(s, a, "w1", lease_s=0.2)
        lb = leases.acquire(s, b, "w1", lease_s=30)
        assert la and lb and leases.acquire(s, a, "w2", lease_s=5) is None  # one holder at a time
        assert leases.renew(s, "w1", [lb], 30) == {b}
    time.sleep(0.3)  # a's lease runs out (w1 "died" for it)
    with session_scope(pg_url) as s:
        s.add(WorkerState(id="w9", model="smollm2-135m", queue="coserve.smollm2-135m", device="cpu",
                          heartbeat_at=utcnow() - timedelta(hours=1)))
        s.flush()
        s.execute(update(Job).where(Job.id == c).values(status=JobStatus.DISPATCHED.value, worker_id="w9",
                                                        dispatched_at=utcnow()))
    with session_scope(pg_url) as s:
        result = sweep(s, redis_url, queued_grace_s=3600, holder_stale_s=30, max_attempts=5)
    assert (result.requeued, result.failed, result.resent) == (1, 0, 1)  # a requeued; c's holder is dead
    with session_scope(pg_url) as s:
        assert s.get(Job, a).status == "queued" and s.get(Job, a).worker_id is None
        assert s.get(Job, c).worker_id is None
        assert leases.finish(s, lb, JobStatus.SUCCEEDED, {"output_text": "done"})
        assert not leases.finish(s, lb, JobStatus.SUCCEEDED, {"output_text": "again"})  # idempotent
        second = leases.acquire(s, a, "w2", lease_s=30)
        assert second.attempt == 2 and not leases.finish(s, la, JobStatus.SUCCEEDED, {})  # stale attempt
        assert leases.finish(s, second, JobStatus.SUCCEEDED, {"output_text": "ok"})
        ends = s.scalars(select(JobEvent.job_id).where(JobEvent.to_status == "succeeded")).all()
    assert sorted(ends) == sorted([a, b])



def _plans(url: str, run) -> list[tuple[str, str]]:
    """Each SELECT that ``run(session)`` sends, and its plan as PostgreSQL would take it with sequential scans
    off (EXPLAIN, not run): the indexes it can use on a table too small to need them."""
    from sqlalchemy import event

    from app.db.session import get_engine, session_scope

    seen: list[tuple[str, object]] = []

    def on_execute(_conn, _cursor, statement, parameters, _context, executemany) -> None:
        if not executemany and statement.lstrip().upper().startswith("SELECT"):
            seen.append((statement, parameters))

    engine = get_engine(url)
    event.listen(engine, "before_cursor_execute", on_execute)
    try:
        with session_scope(url) as s:
            run(s)
    finally:
        event.remove(engine, "before_cursor_execute", on_execute)
    raw = engine.raw_connection()
    try:
        cur = raw.cursor()
        cur.execute("SET enable_seqscan = off")
        plans = []
        for statement, parameters in seen:
            cur.execute("EXPLAIN " + statement, parameters)
            plans.append((statement, "\n".join(row[0] for row in cur.fetchall())))
        raw.rollback()
        return plans
    finally:
        raw.close()


def test_the_sweeps_scans_take_the_status_indexes_on_postgres(pg_url, tmp_path, redis_url):
    """The sweeper's queued jobs oldest first are a range of ix_jobs_status_created (before migration 0045 the
    planner walked ix_jobs_created through every ended job); the finalizer's open batches and the batches left
    validating are found by ix_batches_status."""
    from app.batch.finalize import stalled_or_open
    from app.db.migrate import upgrade
    from app.db.models import Batch
    from app.settings import Settings
    from workers.batch_tasks import restart_stalled_validation
    from workers.sweeper import sweep

    upgrade(pg_url)
    settings = Settings(data_dir=tmp_path, database_url=pg_url, REDIS_URL=redis_url)
    queued = [plan for sql, plan in _plans(pg_url, lambda s: sweep(s, redis_url))
              if "ORDER BY jobs.created_at" in sql and "jobs.status =" in sql]
    assert len(queued) == 1 and "ix_jobs_status_created" in queued[0], queued
    open_batches = _plans(pg_url, lambda s: s.scalars(select(Batch.id).where(stalled_or_open())).all())
    validating = _plans(pg_url, lambda s: restart_stalled_validation(settings))
    assert [plan for _sql, plan in open_batches + validating if "ix_batches_status" in plan] == [
        plan for _sql, plan in open_batches + validating] and len(open_batches + validating) == 2, (
        open_batches, validating)

def test_usage_buckets_on_postgres(pg_url):
    """The Usage API's grouped SQL (bucket index from PostgreSQL's epoch) gives what it gives on SQLite."""
    from datetime import UTC, datetime

    from app.auth import create_tenant
    from app.db.migrate import upgrade
    from app.db.models import Job
    from app.db.session import session_scope
    from app.services.usage import UsageQuery, completions_usage

    upgrade(pg_url)
    t0 = int(datetime(2026, 11, 1, tzinfo=UTC).timestamp())
    with session_scope(pg_url) as s:
        tenant = create_tenant(s, "usage-pg")
        for offset, model, tokens in ((59, "a", 10), (60, "a", 20), (61, "b", 40), (3 * 60 + 1, "a", 80)):
            s.add(Job(tenant_id=tenant.id, kind="interactive", tier="paid", model=model, sampling={},
                      status="succeeded", created_at=datetime.fromtimestamp(t0 + offset, UTC), prompt_tokens=tokens,
                      completion_tokens=1, slo_met=True))
        s.commit()
        page = completions_usage(s, UsageQuery(t0, t0 + 4 * 60, "1m", 60, group_by=("model",),
                                               tenant_ids=(tenant.id,)), str)
    assert [sorted((r["model"], r["input_tokens"]) for r in b["results"]) for b in page["data"]] == [
        [("a", 10)], [("a", 20), ("b", 40)], [], [("a", 80)]]


def test_usage_counts_a_request_whose_first_choice_never_ran_on_postgres(pg_url):
    """The Usage API's lookup of a request's other jobs (correlated on PostgreSQL as on SQLite): n=2, its first
    choice cancelled before it ran, the other run, counts the request and its prompt once, with the cached tokens of
    the choice run."""
    from datetime import UTC, datetime

    from app.auth import create_tenant
    from app.db.migrate import upgrade
    from app.db.models import Job
    from app.db.session import session_scope
    from app.services.jobs import choice_links
    from app.services.usage import UsageQuery, completions_usage

    upgrade(pg_url)
    t0 = int(datetime(2026, 11, 1, tzinfo=UTC).timestamp())
    with session_scope(pg_url) as s:
        tenant = create_tenant(s, "usage-links-pg")
        common = {"tenant_id": tenant.id, "kind": "interactive", "tier": "paid", "model": "a", "sampling": {},
                  "created_at": datetime.fromtimestamp(t0 + 5, UTC), "prompt_tokens": 30}
        first, second = choice_links(["job_first_choice", "job_second_choice"], 2)
        s.add_all([Job(**common, **first, id="job_first_choice", status="cancelled"),
                   Job(**common, **second, id="job_second_choice", status="succeeded", completion_tokens=4,
                       cached_tokens=16)])
        s.commit()
        page = completions_usage(s, UsageQuery(t0, t0 + 60, "1m", 1, tenant_ids=(tenant.id,)), str)
    (result,) = page["data"][0]["results"]
    assert (result["num_model_requests"], result["input_tokens"], result["input_cached_tokens"],
            result["output_tokens"]) == (1, 30, 16, 4)


def test_batch_usage_counts_a_lines_prompt_whose_first_choice_never_ran_on_postgres(pg_url):
    """A Batch object's ``usage`` bills a line's prompt by the Usage API's lookup (correlated on PostgreSQL as on
    SQLite): n=2, its first choice expired before it ran, the other run, counts the prompt once, with the cached
    tokens of the choice run."""
    from app.auth import create_tenant
    from app.batch.objects import batch_usage
    from app.db.migrate import upgrade
    from app.db.models import Batch, File, Job
    from app.db.session import session_scope
    from app.services.jobs import choice_links

    upgrade(pg_url)
    with session_scope(pg_url) as s:
        tenant = create_tenant(s, "batch-usage-links-pg")
        s.add(File(id="file_l", tenant_id=tenant.id, filename="in.jsonl", purpose="batch", bytes=1, path="/x"))
        s.flush()
        s.add(Batch(id="batch_l", tenant_id=tenant.id, endpoint="/v1/completions", input_file_id="file_l",
                    completion_window="24h", status="in_progress", tier="paid"))
        s.flush()
        common = {"tenant_id": tenant.id, "batch_id": "batch_l", "kind": "batch", "tier": "paid", "model": "m",
                  "sampling": {}, "prompt_tokens": 30, "custom_id": "line"}
        first, second = choice_links(["job_first_line_choice", "job_second_line_choice"], 2)
        s.add_all([Job(**common, **first, id="job_first_line_choice", status="expired", choice_index=0),
                   Job(**common, **second, id="job_second_line_choice", status="succeeded", choice_index=1,
                       completion_tokens=4, cached_tokens=16)])
        s.commit()
        usage = batch_usage(s, ["batch_l"])["batch_l"]
    assert (usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"], usage["output_tokens"]) == (
        30, 16, 4)


def test_slo_chart_counts_on_postgres(pg_url):
    """The dashboard's SLO chart's grouped SQL (minute from PostgreSQL's epoch) counts what it counts on SQLite."""
    from app.observability.slo_chart import SloChart, slo_series
    from app.auth import create_tenant
    from app.db.migrate import upgrade
    from app.db.session import session_scope
    from tests.unit.api.test_admin_overdue import slo_jobs

    upgrade(pg_url)
    with session_scope(pg_url) as s:
        _, expected = slo_jobs(s, create_tenant(s, "slo-pg").id)
        assert slo_series(s, 60) == expected
        chart = SloChart(fresh_s=0)
        assert chart.series(s, 60) == expected and chart.series(s, 60) == expected  # the settled minutes kept


def test_admin_jobs_table_pages_on_postgres(pg_url):
    """The dashboard's jobs cursor (a timestamptz written out and read back) starts the next page right."""
    from datetime import UTC, datetime

    from app.api.admin import _after_cursor, jobs_page
    from app.auth import create_tenant
    from app.db.migrate import upgrade
    from app.db.models import Job
    from app.db.session import session_scope

    upgrade(pg_url)
    with session_scope(pg_url) as s:
        tenant = create_tenant(s, "jobs-pg").id
        at = datetime(2026, 11, 1, 12, 0, 0, 123456, tzinfo=UTC)  # the same time to the microsecond: ties by id
        jobs = [Job(id=f"job_{i}", tenant_id=tenant, kind="interactive", tier="paid", model="m", sampling={},
                    status=st, created_at=at) for i, st in enumerate(("running", "relegated", "running", "running"))]
        s.add_all(jobs)
        s.commit()
        seen, after = [], None
        while True:
            rows, total, after = jobs_page(s, ["relegated", "running"], after and _after_cursor(after), 2)
            seen.append([j.id for j in rows])
            if after is None:
                break
    assert seen == [["job_1", "job_0"], ["job_2", "job_3"]] and total == 4


def test_metrics_keep_their_totals_on_postgres(pg_url):
    """/metrics' grouped SQL runs on PostgreSQL (the horizon's flag is one expression in SELECT and GROUP BY), and
    scrapes that read from the totals kept give what the first gave."""
    from app.db.migrate import upgrade
    from app.db.models import MetricTotals
    from app.db.session import session_scope
    from app.observability.collector import SqlCollector
    from tests.unit.api.test_metrics import _ended, _samples, _seed

    upgrade(pg_url)
    _seed(pg_url)
    _ended(pg_url, (timedelta(hours=1), 100))

    def scrape():  # all but the heartbeat's age, which the clock moves
        samples = _samples(SqlCollector(pg_url, "tiny", tiers=("free", "paid")).collect())
        return {key: value for key, value in samples.items() if "heartbeat_age" not in key[0]}

    def horizon():
        with session_scope(pg_url) as s:
            return s.scalars(select(MetricTotals.horizon)).one()

    scrapes = [scrape(), scrape()]  # the jobs since the horizon; from the totals kept
    kept = horizon()
    scrapes.append(scrape())  # from the totals the second kept: the guarded update found its horizon
    assert scrapes[0] == scrapes[1] == scrapes[2] and horizon() > kept
    # the end of an hour ago is before the totals began (a deployment's first scrape starts them)
    assert scrapes[0][("coserve:prompt_tokens_total", (("model_name", "tiny"),))] == 15 + 4


def test_stored_chat_completions_on_postgres(pg_url):
    """The stored-completion list's filter on a JSON field (``store``) and its cursor on PostgreSQL."""
    from datetime import UTC, datetime, timedelta

    from app.auth import create_tenant
    from app.db.migrate import upgrade
    from app.db.models import Job
    from app.db.session import session_scope
    from app.services import stored_completions

    upgrade(pg_url)
    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    with session_scope(pg_url) as s:
        tenant = create_tenant(s, "stored-pg")
        for i, store in enumerate((True, False, None, True, True)):
            kept = None if store is None else {"store": store, "metadata": {"n": str(i)}, "choices": [f"job_pg{i}"]}
            s.add(Job(id=f"job_pg{i}", tenant_id=tenant.id, kind="interactive", tier="paid", model="m", sampling={},
                      status="succeeded", endpoint="/v1/chat/completions", created_at=t0 + timedelta(seconds=i),
                      output_text="x", response=kept))
        s.commit()
        page = stored_completions.page(s, tenant.id, ("free", "paid"), limit=1, order="asc", after="chatcmpl-job_pg0")
        assert [c["id"] for c in page["data"]] == ["chatcmpl-job_pg3"] and page["has_more"]
        page = stored_completions.page(s, tenant.id, ("free", "paid"), limit=5, order="desc", metadata={"n": "0"})
        assert [c["id"] for c in page["data"]] == ["chatcmpl-job_pg0"] and not page["has_more"]


def test_file_expiry_and_webhook_deliveries_on_postgres(pg_url, tmp_path, webhook_receiver):
    """The sweep's expired-file query (a correlated NOT EXISTS) and a webhook delivery's claim (a guarded UPDATE on
    a timestamp) on PostgreSQL."""
    from datetime import UTC, datetime

    from app.auth import create_tenant
    from app.batch.storage import delete_expired_files
    from app.db.migrate import upgrade
    from app.db.models import File, WebhookDelivery, WebhookEndpoint
    from app.db.session import session_scope
    from app.services.webhooks import deliver_due, emit, new_secret

    upgrade(pg_url)
    with session_scope(pg_url) as s:
        tenant = create_tenant(s, "expiry-pg")
        content = tmp_path / "f"
        content.write_text("x")
        s.add(File(id="file_pg", tenant_id=tenant.id, filename="f", purpose="batch", bytes=1, path=str(content),
                   expires_at=datetime(2020, 1, 1, tzinfo=UTC)))
        s.add(WebhookEndpoint(id="we_pg", tenant_id=tenant.id, name="n", url=webhook_receiver.url,
                              event_types=["batch.completed"], secret=new_secret()))
        s.commit()
        assert delete_expired_files(s) == 1 and not content.exists()
        assert emit(s, tenant.id, "batch.completed", "batch_pg") == 1
        s.commit()
        assert deliver_due(s, retry_s=5.0, max_attempts=3, timeout_s=5.0) == 1
        assert s.scalars(select(WebhookDelivery)).one().delivered_at is not None
    assert len(webhook_receiver.received) == 1


def test_batch_queue_limit_and_usage_on_postgres(pg_url):
    """The queue limit's locked read of the tenant's cap and its sum of queued tokens, and a batch's usage, on
    PostgreSQL."""
    from app.auth import create_tenant
    from app.batch import finalize
    from app.batch.objects import batch_usage
    from app.batch.queue_limit import refusal
    from app.db.migrate import upgrade
    from app.db.models import Batch, File, Job
    from app.db.session import read_then_write, session_scope

    upgrade(pg_url)
    with session_scope(pg_url) as s:
        tenant = create_tenant(s, "queue-pg")
        tenant.batch_queue_tokens = 100
        s.add(File(id="file_q", tenant_id=tenant.id, filename="in.jsonl", purpose="batch", bytes=1, path="/x"))
        s.flush()
        s.add(Batch(id="batch_q", tenant_id=tenant.id, endpoint="/v1/completions", input_file_id="file_q",
                    completion_window="24h", status="in_progress", tier="paid"))
        s.flush()
        for status, tokens, out in (("queued", 60, None), ("succeeded", 500, 7), ("running", 30, None)):
            s.add(Job(tenant_id=tenant.id, batch_id="batch_q", kind="batch", tier="paid", model="m", sampling={},
                      status=status, prompt_tokens=tokens, completion_tokens=out))
        tenant_id = tenant.id
    with read_then_write(pg_url) as s:
        assert refusal(s, tenant_id, "m", 10) is None  # 90 queued + 10 fit in 100
        assert refusal(s, tenant_id, "m", 11)["code"] == "token_limit_exceeded"
        assert refusal(s, tenant_id, "other", 100) is None  # per model
        assert batch_usage(s, ["batch_q"])["batch_q"]["total_tokens"] == 507
    with session_scope(pg_url) as s:  # a line of two choices, one still running: one pending request
        for i, status in enumerate(("succeeded", "running")):
            s.add(Job(tenant_id=tenant_id, batch_id="batch_q", kind="batch", tier="paid", model="m", sampling={},
                      status=status, custom_id="two", choice_index=i, counts_request=i == 0, counts_prompt=i == 0))
    with session_scope(pg_url) as s:
        assert finalize._counts(s, "batch_q") == finalize.Counts(pending=3, completed=1, failed=0)


def test_writes_that_race_a_deletion_on_postgres(pg_url, tmp_path, redis_url, tiny_model_dir):
    """On PostgreSQL a read-then-write session does not hold the database as SQLite's does: a write raced by a
    deletion of what it read answered 500 (a foreign key, a row gone), or undid the deletion (a stored completion
    listed again, a conversation item back). The row read is now locked for the write; each race, run many times,
    answers 200 or 404 and a 200 deletion holds; of two responses on one conversation at once one is refused
    (they both read its items and added their turns before). So do a NUL in a jobs cursor and a LoRA adapter
    loaded thrice at once (422; one 200 and two 400s)."""
    import base64
    import json
    import threading

    from fastapi.testclient import TestClient

    from app.auth import clear_cache
    from app.db.migrate import upgrade
    from app.db.models import Job, new_id
    from app.db.session import session_scope
    from app.main import create_app
    from tests.conftest import make_keys, make_settings

    upgrade(pg_url)
    keys = make_keys(pg_url)
    settings = make_settings(tmp_path, pg_url, redis_url, tiny_model_dir).model_copy(update={"runtime_lora": True})
    clear_cache()
    client = TestClient(create_app(settings), raise_server_exceptions=False)
    auth = {"Authorization": f"Bearer {keys.paid}"}

    def race(*calls):
        start = threading.Barrier(len(calls))
        answers: list = [None] * len(calls)

        def run(i):
            start.wait()
            answers[i] = calls[i]()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return [a.status_code for a in answers]

    with client:
        for _ in range(12):
            conv = client.post("/v1/conversations", json={"items": [{"role": "user", "content": "x"}]},
                               headers=auth).json()["id"]
            added, deleted = race(lambda: client.post(f"/v1/conversations/{conv}/items", headers=auth, json={
                "items": [{"role": "user", "content": "y"}] * 5}), lambda: client.delete(f"/v1/conversations/{conv}",
                                                                                         headers=auth))
            assert added in (200, 404) and deleted == 200

            conv = client.post("/v1/conversations", json={}, headers=auth).json()["id"]
            respond = lambda: client.post("/v1/responses", headers=auth, json={  # noqa: E731
                "model": "tiny", "conversation": conv, "input": "hi", "background": True})
            assert sorted(race(respond, respond)) == [200, 400]  # the other is conversation_locked

            job_id = new_id("job")
            with session_scope(pg_url) as s:
                s.add(Job(id=job_id, tenant_id=keys.tenant_id, kind="interactive", tier="paid", model="tiny",
                          endpoint="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
                          response={"store": True, "metadata": {}, "choices": [job_id]}, status="succeeded",
                          output_text="hello", prompt_tokens=3, completion_tokens=1, finish_reason="stop",
                          sampling={}))
            url = f"/v1/chat/completions/chatcmpl-{job_id}"
            updated, deleted = race(lambda: client.post(url, json={"metadata": {"k": "v"}}, headers=auth),
                                    lambda: client.delete(url, headers=auth))
            assert updated in (200, 404) and deleted == 200 and client.get(url, headers=auth).status_code == 404

            hook = client.post("/v1/webhook_endpoints", headers=auth, json={
                "url": "https://example.com/hook", "event_types": ["batch.completed"], "name": "n"}).json()["id"]
            rotated, deleted = race(lambda: client.post(f"/v1/webhook_endpoints/{hook}/rotate_secret", headers=auth),
                                    lambda: client.delete(f"/v1/webhook_endpoints/{hook}", headers=auth))
            assert rotated in (200, 404) and deleted == 200

        cursor = base64.urlsafe_b64encode("2020-01-01T00:00:00+00:00|job_\x00x".encode()).decode()
        r = client.get("/v1/jobs", params={"cursor": cursor}, headers=auth)
        assert r.status_code == 422 and "invalid cursor" in r.text
        adapter = tmp_path / "adapter"
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
        (adapter / "adapter_model.safetensors").write_bytes(b"")
        admin = {"Authorization": f"Bearer {keys.admin}"}
        for i in range(5):
            load = lambda: client.post("/v1/load_lora_adapter", headers=admin,  # noqa: E731
                                       json={"lora_name": f"rt{i}", "lora_path": str(adapter)})
            assert sorted(race(load, load, load)) == [200, 400, 400]


def test_batch_fan_out_in_chunks_on_postgres(pg_url, tmp_path, redis_url, tiny_model_dir, monkeypatch):
    """A batch's jobs written staged in chunks start together (each once), and a failure midway leaves none."""
    from fastapi.testclient import TestClient

    from app.auth import clear_cache
    from app.batch import fanout
    from app.db.migrate import upgrade
    from app.db.models import Job
    from app.db.session import session_scope
    from app.main import create_app
    from tests.conftest import make_keys, make_settings
    from tests.integration.test_batch_fanout import _create, _jobs, _messages

    upgrade(pg_url)
    keys = make_keys(pg_url)
    settings = make_settings(tmp_path, pg_url, redis_url, tiny_model_dir)
    monkeypatch.setattr(fanout, "STAGE_CHUNK", 2)
    clear_cache()
    with TestClient(create_app(settings)) as client:
        started = _create(client, keys, 5)
        jobs = _jobs(settings, started["id"])
        assert len(jobs) == 5 and {status for _, status in jobs} == {"dispatched"}
        assert sorted(_messages(settings).elements()) == sorted(job_id for job_id, _ in jobs)
        with session_scope(pg_url) as s:  # the database refuses the third chunk's first row
            s.execute(text("CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                           "IF NEW.custom_id = 'c4' THEN RAISE EXCEPTION 'disk I/O error'; END IF; RETURN NEW; END $$"))
            s.execute(text("CREATE TRIGGER refuse_c4 BEFORE INSERT ON jobs FOR EACH ROW EXECUTE FUNCTION refuse()"))
        failed = _create(client, keys, 6)
        got = client.get(f"/v1/batches/{failed['id']}", headers={"Authorization": f"Bearer {keys.paid}"}).json()
        assert got["status"] == "failed" and got["errors"]["data"][0]["code"] == "internal_error"
        assert _jobs(settings, failed["id"]) == []
        with session_scope(pg_url) as s:
            assert s.scalar(select(func.count()).select_from(Job)) == 5


def test_timestamps_of_a_server_in_another_time_zone_are_shown_in_utc_on_postgres(pg_url):
    """PostgreSQL hands a timestamptz back in the server's (or the role's, the database's) TimeZone, which need not
    be UTC; a message batch's RFC 3339 times and a summarization's deadline are shown in UTC all the same."""
    from datetime import UTC, datetime

    from app.auth import create_tenant
    from app.batch.message_batches import message_batch
    from app.db.migrate import upgrade
    from app.db.models import Batch, File, SummarizationRun
    from app.db.session import session_scope
    from app.summarize.store import progress_of

    upgrade(pg_url)
    local = f"{pg_url}?options=-ctimezone%3DAsia/Kolkata"  # a server whose TimeZone is +05:30
    created = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    with session_scope(local) as s:
        tenant = create_tenant(s, "tz-pg")
        s.add(File(id="file_tz", tenant_id=tenant.id, filename="f", purpose="batch", bytes=1, path="f"))
        s.flush()
        s.add(Batch(id="msgbatch_tz", tenant_id=tenant.id, endpoint="/v1/messages", input_file_id="file_tz",
                    completion_window="24h", tier="paid", created_at=created, expires_at=created))
        s.add(SummarizationRun(id="sum_tz", tenant_id=tenant.id, model="m", tier="paid", deadline_at=created,
                               max_summary_tokens=8, chunk_tokens=64, overlap_tokens=0))
        s.commit()
    with session_scope(local) as s:
        shown = message_batch(s.get(Batch, "msgbatch_tz"), {}, "")
        deadline = progress_of(s.get(SummarizationRun, "sum_tz")).as_dict()["deadline_at"]
    assert (shown["created_at"], shown["expires_at"]) == ("2026-01-02T03:04:05Z", "2026-01-02T03:04:05Z")
    assert deadline == "2026-01-02T03:04:05Z"


def test_a_file_of_more_than_2_gib_is_recorded_on_postgres(pg_url):
    """A batch's output file may pass 2 GiB (50,000 long answers with their logprobs): its row's ``bytes`` does not
    fit PostgreSQL's INTEGER, and writing it failed the batch's fan-in (SQLite's integers are 64-bit)."""
    from app.auth import create_tenant
    from app.db.migrate import upgrade
    from app.db.models import File
    from app.db.session import session_scope

    upgrade(pg_url)
    size = 3 * 2**30
    with session_scope(pg_url) as s:
        tenant = create_tenant(s, "big-file-pg")
        s.add(File(id="file_big", tenant_id=tenant.id, filename="out.jsonl", purpose="batch_output", bytes=size,
                   path="out.jsonl"))
        s.commit()
    with session_scope(pg_url) as s:
        assert s.get(File, "file_big").bytes == size


def _wait_until_one_waits_for_a_lock(pg_url: str, racer, what: str) -> None:
    """Until ``racer`` (a thread) has ended or a session of the database waits for a lock. Each look is a
    transaction of its own: PostgreSQL reads pg_stat_activity once a transaction, so a watch that looked in one
    transaction saw the waiter never, timed out, and left the first write open (its waiter hung, the test too)."""
    from tests.conftest import wait_for

    engine = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    waiting = text("SELECT count(*) > 0 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                   "AND datname = current_database()")
    try:
        with engine.connect() as watch:
            wait_for(lambda: not racer.is_alive() or watch.execute(waiting).scalar(), 30, what)
    finally:
        engine.dispose()


def test_two_admins_revoking_each_others_key_at_once_leave_one_on_postgres(pg_url):
    """Each of the last two admin keys revoking the other at once: on PostgreSQL the lockout check read the other
    admin keys without a lock, so both revocations passed it and no admin key was left. The second revocation's check
    now waits for the first's transaction and, once that commits, is refused (409): one admin key stays."""
    import threading

    from fastapi import HTTPException

    from app.api.tenants import refuse_admin_lockout
    from app.auth import Principal, create_key, create_tenant
    from app.db.migrate import upgrade
    from app.db.models import ApiKey
    from app.db.session import get_sessionmaker, session_scope

    upgrade(pg_url)
    with session_scope(pg_url) as s:
        ops = create_tenant(s, "ops")
        a, b = (create_key(s, ops, is_admin=True)[0].id for _ in range(2))
    caller = {key: Principal(key_id=key, tenant_id="ops", tier="paid", is_admin=True) for key in (a, b)}

    def revoke(session, key_id: str, by: str) -> None:  # the revocation route's write
        key = session.get(ApiKey, key_id)
        refuse_admin_lockout(session, key, caller[by])
        key.revoked = True
        session.flush()

    first, second = get_sessionmaker(pg_url)(), get_sessionmaker(pg_url)()
    refused: list[HTTPException] = []

    def second_revokes() -> None:
        try:
            revoke(second, a, by=b)
            second.commit()
        except HTTPException as exc:
            refused.append(exc)
            second.rollback()

    revoke(first, b, by=a)  # its transaction stays open
    racer = threading.Thread(target=second_revokes)
    racer.start()
    try:
        _wait_until_one_waits_for_a_lock(pg_url, racer, "the second revocation to finish or wait for the first's lock")
    finally:
        first.commit()  # also after a failed wait: the second revocation never waits on this test's lock
        racer.join(30)
        first.close(), second.close()
    assert [(e.status_code, "last active admin key" in e.detail) for e in refused] == [(409, True)], refused
    with session_scope(pg_url) as s:
        assert {k: s.get(ApiKey, k).revoked for k in (a, b)} == {a: False, b: True}


def test_admins_disabling_each_others_tenants_at_once_leave_one_admin_key_on_postgres(pg_url, tmp_path, redis_url):
    """The last two admin keys, of two tenants: one admin revoking the other's key, or disabling the other's tenant,
    while that other admin disables the first's tenant. On PostgreSQL the disable checked only the caller's own
    tenant, so both writes went through and no admin key was usable (one revoked or disabled, the other disabled).
    The disable now takes the revocation's lock on the active admin keys (and their tenants): it waits for the
    first write's commit, then is refused (409) and the first admin's tenant stays enabled."""
    import threading

    from fastapi.testclient import TestClient

    from app.api.tenants import refuse_admin_lockout
    from app.auth import Principal, admin_key_left, clear_cache, create_key, create_tenant
    from app.db.migrate import upgrade
    from app.db.models import ApiKey, Tenant
    from app.db.session import get_sessionmaker, session_scope
    from app.main import create_app
    from tests.conftest import make_settings

    upgrade(pg_url)

    def revoke_theirs(session, mine: Principal, theirs: tuple[str, str]) -> None:  # the revocation route's write
        key = session.get(ApiKey, theirs[0])
        refuse_admin_lockout(session, key, mine)
        key.revoked = True
        session.flush()

    def disable_theirs(session, mine: Principal, theirs: tuple[str, str]) -> None:  # the disable route's write
        assert admin_key_left(session, disabling=theirs[1])
        session.get(Tenant, theirs[1]).disabled = True
        session.flush()

    clear_cache()
    with TestClient(create_app(make_settings(tmp_path, pg_url, redis_url, tmp_path))) as client:
        for n, first_write in enumerate((revoke_theirs, disable_theirs)):
            with session_scope(pg_url) as s:
                s.execute(update(ApiKey).values(revoked=True))  # the race before's keys: these two are the last
                a_tenant, b_tenant = create_tenant(s, f"ops-a{n}"), create_tenant(s, f"ops-b{n}")
                (a_key, _), (b_key, b_plain) = create_key(s, a_tenant, is_admin=True), create_key(s, b_tenant,
                                                                                                     is_admin=True)
                a, b = (a_key.id, a_tenant.id), (b_key.id, b_tenant.id)
            first = get_sessionmaker(pg_url)()
            first_write(first, Principal(key_id=a[0], tenant_id=a[1], tier="paid", is_admin=True), b)  # stays open
            answers: list = []
            racer = threading.Thread(target=lambda: answers.append(client.patch(
                f"/v1/admin/tenants/{a[1]}", json={"disabled": True}, headers={"Authorization": f"Bearer {b_plain}"})))
            racer.start()
            try:
                _wait_until_one_waits_for_a_lock(pg_url, racer, "the disable to finish or wait for the first's lock")
            finally:
                first.commit()  # also after a failed wait: the disable never waits on this test's lock
                racer.join(30)
                first.close()
            assert [(r.status_code, "last active admin key" in r.text) for r in answers] == [(409, True)], (
                first_write.__name__, [r.text for r in answers])
            with session_scope(pg_url) as s:
                assert s.get(Tenant, a[1]).disabled is False and s.get(ApiKey, a[0]).revoked is False


def test_a_nul_the_model_generates_is_stored_on_postgres(pg_url, tmp_path, redis_url, tiny_model_dir):
    """PostgreSQL's text refuses NUL: the engine thread's text holds U+FFFD in its place, the logprobs' JSON the
    escaped NUL (``test_generated_nul`` runs a real worker on a model that writes NULs, on either database)."""
    from app.db.migrate import upgrade
    from tests.conftest import make_keys, make_settings
    from tests.integration.test_worker_threads import assert_a_nul_and_its_logprobs_are_stored

    upgrade(pg_url)
    assert_a_nul_and_its_logprobs_are_stored(make_settings(tmp_path, pg_url, redis_url, tiny_model_dir),
                                             make_keys(pg_url))
