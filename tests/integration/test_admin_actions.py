"""Actions on a job (the admin's, and a cancel) answer as documented when Redis is away or the job moves on
meanwhile (real app, migrated SQLite, real Redis, no worker): never a 500, never a change to a job that has ended,
and a cancel judges the job's state by its own write."""

from __future__ import annotations

import pytest
from sqlalchemy import delete, update

from app.api import admin
from app.api import jobs as jobs_api
from app.db.models import Job, JobEvent
from app.db.session import session_scope
from tests.conftest import Keys
from tests.sql_statements import query_plan, sorts_rows, statements

pytestmark = pytest.mark.integration

H = Keys.header


def _job(client, keys, settings, **values) -> str:
    job_id = client.post("/v1/jobs", json={"prompt": "hi"}, headers=H(keys.paid)).json()["id"]
    with session_scope(settings.sqlalchemy_url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(**values))
    return job_id


def test_resume_and_promote_with_redis_away_stand_in_sql_and_say_undelivered(client, keys, settings, monkeypatch):
    job_id = _job(client, keys, settings, status="relegated", worker_id="w1")
    monkeypatch.setattr(settings, "redis_url", "redis://127.0.0.1:1/0")  # nothing listens there
    r = client.post(f"/admin/api/jobs/{job_id}/resume", headers=H(keys.admin))
    assert r.status_code == 200 and r.json()["delivered"] is False, r.text
    r = client.post(f"/admin/api/jobs/{job_id}/promote", json={"tier": "free"}, headers=H(keys.admin))
    assert r.status_code == 200 and r.json()["delivered"] is False, r.text
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, job_id).tier == "free"  # the promote stands in SQL


def test_promote_of_a_job_that_ends_meanwhile_is_a_409_and_changes_nothing(client, keys, settings, monkeypatch):
    job_id = _job(client, keys, settings, status="running", worker_id="w1")
    read = admin._job

    def then_it_ends(session, job_id: str) -> Job:  # the worker finishes the job between the read and the write
        job = read(session, job_id)
        with session_scope(settings.sqlalchemy_url) as s:
            s.execute(update(Job).where(Job.id == job_id).values(status="succeeded"))
        return job

    monkeypatch.setattr(admin, "_job", then_it_ends)
    r = client.post(f"/admin/api/jobs/{job_id}/promote", json={"tier": "free"}, headers=H(keys.admin))
    assert r.status_code == 409 and "already ended (succeeded)" in r.json()["detail"], r.text
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, job_id).tier == "paid"


def test_a_cancel_waits_for_the_worker_of_a_job_that_started_running_after_it_was_read(client, keys, settings,
                                                                                      monkeypatch):
    """Whether a worker holds the job (and so writes what it produced before the cancel answers) is judged by the
    cancel's own guarded write, not by the read before it."""
    from app.services import cancel as cancelling

    job_id = _job(client, keys, settings, status="dispatched")
    waited = []
    monkeypatch.setattr(cancelling, "await_kept", lambda *args: waited.append(args[1].id) or False)
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, job_id)  # read while dispatched
        with session_scope(settings.sqlalchemy_url) as other:  # a worker leases it meanwhile
            other.execute(update(Job).where(Job.id == job_id).values(status="running", worker_id="w1", attempt=1))
        assert cancelling.cancel(s, settings, job, "cancelled by the user")
        assert job.status == "cancelled" and waited == [job_id]


def _promote_messages(client, keys, settings, job_id: str, *tiers: str) -> list[dict]:
    """What the job's worker hears of promotions to ``tiers`` in turn (a real Redis subscriber in its place)."""
    import json
    import time

    import redis

    from workers.control import control_channel

    pubsub = redis.Redis.from_url(settings.redis_url).pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(control_channel("w-listening"))
    heard = []
    try:
        pubsub.get_message(timeout=1.0)  # the subscription is in place
        for tier in tiers:
            r = client.post(f"/admin/api/jobs/{job_id}/promote", json={"tier": tier}, headers=H(keys.admin))
            assert r.status_code == 200 and r.json()["delivered"] is True, r.text
            deadline = time.monotonic() + 5
            while (msg := pubsub.get_message(timeout=0.5)) is None and time.monotonic() < deadline:
                pass
            heard.append(json.loads(msg["data"]))
    finally:
        pubsub.close()
    return heard


def test_a_relegated_job_moved_down_stays_relegated_and_one_moved_up_comes_back(client, keys, settings):
    job_id = _job(client, keys, settings, status="relegated", worker_id="w-listening")
    assert [(m["tier"], m["resume"]) for m in _promote_messages(client, keys, settings, job_id, "free", "paid")] == [
        ("free", False), ("paid", True)]


def test_configured_tier_names_reach_the_engine_as_its_free_and_paid(client, keys, settings, monkeypatch):
    monkeypatch.setattr(settings, "tiers", ("bronze", "silver", "gold"))
    job_id = _job(client, keys, settings, status="relegated", worker_id="w-listening", tier="silver")
    heard = _promote_messages(client, keys, settings, job_id, "gold", "bronze", "silver")
    assert [(m["tier"], m["resume"]) for m in heard] == [("paid", True), ("free", False), ("free", True)]


def test_an_operator_finds_any_tenants_job_with_its_history(client, keys, settings):
    job_id = _job(client, keys, settings, status="queued")
    client.post(f"/v1/jobs/{job_id}/cancel", headers=H(keys.paid))
    assert client.get(f"/admin/api/jobs/{job_id}", headers=H(keys.paid)).status_code == 403  # a tenant's key
    assert client.get("/admin/api/jobs/job_none", headers=H(keys.admin)).status_code == 404
    found = client.get(f"/admin/api/jobs/{job_id}", headers=H(keys.admin)).json()
    assert (found["job"]["id"], found["job"]["status"], found["tenant_id"]) == (job_id, "cancelled", keys.tenant_id)
    assert [(e["from"], e["to"], e["detail"]) for e in found["events"]][-1] == (
        "queued", "cancelled", "cancelled by the user")


def test_the_overview_says_how_many_jobs_its_table_leaves_out_and_which_workers_are_lost(client, keys, settings,
                                                                                        monkeypatch):
    from datetime import timedelta

    from app.db.models import WorkerState
    from app.services.transitions import utcnow

    monkeypatch.setattr(admin, "JOBS_SHOWN", 2)
    ids = [_job(client, keys, settings, status="running") for _ in range(3)]
    with session_scope(settings.sqlalchemy_url) as s:
        s.add_all([WorkerState(id="w-live", model="m", queue="q", device="cpu"),
                   WorkerState(id="w-gone", model="m", queue="q", device="cpu",
                               heartbeat_at=utcnow() - timedelta(hours=1))])
    body = client.get("/admin/api/overview", headers=H(keys.admin)).json()
    assert [j["id"] for j in body["jobs"]] == ids[:2] and body["jobs_total"] == 3  # the oldest, and how many
    assert {w["id"]: w["alive"] for w in body["workers"]} == {"w-live": True, "w-gone": False}


def test_a_cut_overview_shows_the_relegated_jobs_before_older_running_ones(client, keys, settings, monkeypatch):
    """More running jobs than the table shows must not hide a relegated one: it is what the operator acts on."""
    monkeypatch.setattr(admin, "JOBS_SHOWN", 3)
    running = [_job(client, keys, settings, status="running") for _ in range(3)]
    relegated = [_job(client, keys, settings, status="relegated") for _ in range(2)]
    body = client.get("/admin/api/overview", headers=H(keys.admin)).json()
    assert [j["id"] for j in body["jobs"]] == [*relegated, running[0]] and body["jobs_total"] == 5
    assert [j["status"] for j in body["jobs"]] == ["relegated", "relegated", "running"]


def test_the_dashboards_tenants_say_which_are_disabled_and_the_switch_needs_the_admin_key(client, keys, settings):
    """The tenants table shows a disabled tenant as such; its Enable/Disable button is the admin PATCH."""
    from app.db.models import Tenant

    with session_scope(settings.sqlalchemy_url) as s:
        globex = s.query(Tenant.id).filter(Tenant.name == "globex").scalar()
    patch = f"/v1/admin/tenants/{globex}"
    assert client.patch(patch, json={"disabled": True}, headers=H(keys.paid)).status_code == 403
    assert client.patch(patch, json={"disabled": True}, headers=H(keys.admin)).status_code == 200
    rows = {t["name"]: t for t in client.get("/admin/api/tenants", headers=H(keys.admin)).json()["tenants"]}
    assert {name: t["disabled"] for name, t in rows.items()} == {"acme": False, "globex": True, "ops": False}
    assert client.patch(patch, json={"disabled": False}, headers=H(keys.admin)).status_code == 200
    rows = client.get("/admin/api/tenants", headers=H(keys.admin)).json()["tenants"]
    assert not any(t["disabled"] for t in rows)


def _pages(client, keys, path: str, table: str, key: str, **params) -> list[list[str]]:
    """Every page of an admin table (``table``: its rows' field in the answer), following ``{table}_next``, each
    row by its ``key``; each page says how many rows all the pages hold and its first row's number."""
    out, totals, after = [], set(), None
    while True:
        r = client.get(path, params={**params, **({"after": after} if after else {})}, headers=H(keys.admin))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body[f"{table}_before"] == sum(map(len, out)), body  # the page's first row number, less one
        out.append([row[key] for row in body[table]])
        totals.add(body[f"{table}_total"])
        if not (after := body[f"{table}_next"]):
            assert totals == {sum(map(len, out))}, totals
            return out


def test_the_tenants_table_pages_by_name_with_a_cursor(client, keys, settings):
    """Thousands of tenants are not read on every poll: a page of them by name, its cursor the next's start."""
    for name in ("beta", "delta"):
        assert client.post("/v1/admin/tenants", json={"name": name}, headers=H(keys.admin)).status_code == 201

    def pages(**params) -> list[list[str]]:
        return _pages(client, keys, "/admin/api/tenants", "tenants", "name", **params)

    assert pages(limit=2) == [["acme", "beta"], ["delta", "globex"], ["ops"]]
    assert pages() == [["acme", "beta", "delta", "globex", "ops"]]
    # a tenant added before the cursor meanwhile leaves the next page as it was
    first = client.get("/admin/api/tenants", params={"limit": 2}, headers=H(keys.admin)).json()
    assert client.post("/v1/admin/tenants", json={"name": "alpha"}, headers=H(keys.admin)).status_code == 201
    nxt = client.get("/admin/api/tenants", params={"limit": 2, "after": first["tenants_next"]},
                     headers=H(keys.admin)).json()
    assert [t["name"] for t in nxt["tenants"]] == ["delta", "globex"] and nxt["tenants_total"] == 6
    assert nxt["tenants_before"] == 3  # its rows are the 4th and 5th now
    for bad in ({"after": "@@"}, {"after": "_w"}, {"limit": 101}, {"limit": 0}):
        r = client.get("/admin/api/tenants", params=bad, headers=H(keys.admin))
        assert r.status_code == 422, (bad, r.text)


def test_an_operator_finds_any_tenants_jobs_by_the_request_id_a_client_reports(client, keys, settings):
    """Clients choose their X-Request-Id, so two tenants may send the same: the admin search lists both; a tenant's
    key cannot search."""
    sent = []
    for key in (keys.paid, keys.other):
        r = client.post("/v1/jobs", json={"prompt": "hi"}, headers={**H(key), "X-Request-Id": "req-reported-1"})
        assert r.status_code == 201, r.text
        sent.append(r.json()["id"])
    client.post("/v1/jobs", json={"prompt": "hi"}, headers={**H(keys.paid), "X-Request-Id": "req-other"})
    url = "/admin/api/jobs"
    assert client.get(url, params={"request_id": "req-reported-1"}, headers=H(keys.paid)).status_code == 403
    found = client.get(url, params={"request_id": "req-reported-1"}, headers=H(keys.admin)).json()
    assert [j["id"] for j in found["data"]] == sent and found["has_more"] is False
    assert found["data"][0]["tenant_id"] == keys.tenant_id and found["data"][1]["tenant_id"] != keys.tenant_id
    assert client.get(url, params={"request_id": "req-none"}, headers=H(keys.admin)).json()["data"] == []
    assert client.get(url, headers=H(keys.admin)).status_code == 422  # the request id is what it searches by


def _runs(settings, tenant_id: str, *statuses: str) -> list[str]:
    """Summarization runs of ``tenant_id``, one a second apart in this order (the last the newest), each with a
    document and, but a completed one, one of its two jobs not ended; the running ones' model is one no worker
    serves, so nothing steps them."""
    from datetime import timedelta

    from app.db.models import Job, SummarizationDocument, SummarizationRun, new_id
    from app.services.transitions import utcnow

    now, ids = utcnow(), []
    with session_scope(settings.sqlalchemy_url) as s:
        for i, st in enumerate(statuses):
            run = SummarizationRun(tenant_id=tenant_id, model="no-worker-model", tier="paid", status=st,
                                   deadline_at=now + timedelta(hours=1), max_summary_tokens=64, chunk_tokens=256,
                                   overlap_tokens=0, documents=1, jobs_submitted=2, jobs_done=1,
                                   created_at=now - timedelta(seconds=len(statuses) - i),
                                   reason="no document was summarized" if st == "failed" else None)
            s.add(run)
            s.flush()
            s.add(SummarizationDocument(run_id=run.id, position=0, doc_id="d0", text="some text"))
            if st != "completed":  # a failed run's running jobs go on (a poll counts them as they end)
                s.add(Job(id=new_id("job"), tenant_id=tenant_id, kind="batch", tier="paid", model=run.model,
                          sampling={}, status="queued", created_at=now, summarization_run_id=run.id))
            ids.append(run.id)
    return ids


def test_an_operator_sees_every_tenants_summarization_runs_newest_first_and_pages_them(client, keys, settings):
    from app.db.models import Tenant

    with session_scope(settings.sqlalchemy_url) as s:
        globex = s.query(Tenant.id).filter(Tenant.name == "globex").scalar()
    older = _runs(settings, keys.tenant_id, "completed", "failed", "cancelling")
    newer = _runs(settings, globex, "running")
    url = "/admin/api/summarizations"
    assert client.get(url, headers=H(keys.paid)).status_code == 403  # a tenant's key sees no other's runs
    body = client.get(url, headers=H(keys.admin)).json()
    assert [r["id"] for r in body["data"]] == [*newer, *reversed(older)] and body["has_more"] is False
    assert body["counts"] == {"validating": 0, "running": 1, "cancelling": 1, "failed": 1, "completed": 1,
                              "cancelled": 0}
    failed = body["data"][2]
    assert (failed["status"], failed["reason"], failed["tenant"], failed["tenant_id"]) == (
        "failed", "no document was summarized", "acme", keys.tenant_id)
    assert (failed["documents"], failed["jobs_submitted"], failed["jobs_done"]) == (1, 2, 1)
    assert body["data"][0]["tenant"] == "globex" and body["data"][0]["deadline_at"].endswith("Z")
    live = client.get(url, params=[("status", "running"), ("status", "cancelling")], headers=H(keys.admin)).json()
    assert [r["id"] for r in live["data"]] == [newer[0], older[2]]
    page = client.get(url, params={"limit": 2}, headers=H(keys.admin)).json()
    assert [r["id"] for r in page["data"]] == [newer[0], older[2]] and page["has_more"] is True
    rest = client.get(url, params={"limit": 2, "after": older[2]}, headers=H(keys.admin)).json()
    assert [r["id"] for r in rest["data"]] == [older[1], older[0]] and rest["has_more"] is False
    for bad in ({"status": "done"}, {"limit": 51}, {"after": "sum_none"}, {"after": "a\0b"}):
        r = client.get(url, params=bad, headers=H(keys.admin))
        assert r.status_code == 422, (bad, r.text)


def test_an_operator_cancels_any_tenants_running_summarization_run(client, keys, settings):
    from app.db.models import Tenant

    with session_scope(settings.sqlalchemy_url) as s:
        globex = s.query(Tenant.id).filter(Tenant.name == "globex").scalar()
    running, done = _runs(settings, globex, "running", "completed")
    url = f"/admin/api/summarizations/{running}/cancel"
    assert client.post(url, headers=H(keys.other)).status_code == 403  # not even its own tenant's key here
    r = client.post(url, headers=H(keys.admin))
    assert r.status_code == 200, r.text
    assert (r.json()["status"], r.json()["reason"], r.json()["cancelled"]) == (
        "cancelled", "cancelled by an admin", True)
    # the tenant sees it as its own cancel would leave it: the document not done failed, naming why
    mine = client.get(f"/v1/summarize/{running}", headers=H(keys.other)).json()
    assert (mine["status"], mine["reason"], mine["documents_failed"]) == ("cancelled", "cancelled by an admin", 1)
    again = client.post(url, headers=H(keys.admin))
    assert again.status_code == 409 and "is cancelled" in again.json()["detail"], again.text
    assert client.post(f"/admin/api/summarizations/{done}/cancel", headers=H(keys.admin)).status_code == 409
    assert client.post("/admin/api/summarizations/sum_none/cancel", headers=H(keys.admin)).status_code == 404


def test_an_operator_finishes_a_run_whose_cancelling_process_died_holding_its_lease(client, keys, settings):
    from datetime import timedelta

    from app.db.models import SummarizationDocument, SummarizationRun
    from app.services.transitions import utcnow

    (run_id,) = _runs(settings, keys.tenant_id, "cancelling")
    job_id = _job(client, keys, settings, status="queued")
    with session_scope(settings.sqlalchemy_url) as s:  # its cancel failed the document, then the process was killed
        s.execute(update(SummarizationDocument).where(SummarizationDocument.run_id == run_id).values(
            pending=[job_id], done=True, error="cancelled with its summarization run"))
        s.execute(update(SummarizationRun).where(SummarizationRun.id == run_id).values(
            reason="cancelled by request", lease_owner="api-dead", lease_expires_at=utcnow() + timedelta(hours=1)))
    r = client.post(f"/admin/api/summarizations/{run_id}/cancel", headers=H(keys.admin))
    assert r.status_code == 200, r.text
    assert (r.json()["status"], r.json()["reason"]) == ("cancelled", "cancelled by request")
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, job_id).status == "cancelled"
        assert s.get(SummarizationRun, run_id).lease_owner is None
    mine = client.post(f"/v1/summarize/{run_id}/cancel", headers=H(keys.paid))  # ended now: a repeat is a 409
    assert mine.status_code == 409 and "already ended (cancelled)" in mine.json()["detail"], mine.text


def test_the_jobs_table_filters_by_status_and_pages_by_cursor(client, keys, settings):
    running = [_job(client, keys, settings, status="running") for _ in range(3)]
    relegated = [_job(client, keys, settings, status="relegated") for _ in range(2)]
    queued = [_job(client, keys, settings, status="queued") for _ in range(2)]

    def pages(**params) -> list[list[str]]:
        return _pages(client, keys, "/admin/api/overview", "jobs", "id", **params)

    assert pages(limit=2) == [relegated, running[:2], running[2:]]  # the relegated first, each oldest first
    assert pages(status="queued") == [queued]
    assert pages(status=["queued", "relegated"], limit=3) == [[*relegated, queued[0]], queued[1:]]
    # a row that moves on between pages leaves the next page as it was
    first = client.get("/admin/api/overview", params={"limit": 3}, headers=H(keys.admin)).json()
    with session_scope(settings.sqlalchemy_url) as s:
        s.execute(update(Job).where(Job.id == running[0]).values(status="succeeded"))
    nxt = client.get("/admin/api/overview", params={"limit": 3, "after": first["jobs_next"]},
                     headers=H(keys.admin)).json()
    assert [j["id"] for j in nxt["jobs"]] == running[1:] and nxt["jobs_total"] == 4
    assert nxt["jobs_before"] == 2  # its rows are the 3rd and 4th now, not the 4th and 5th of when the page turned
    import base64
    import json

    forged = [base64.urlsafe_b64encode(json.dumps(c).encode()).decode() for c in (
        [10**30, "2026-01-01T00:00:00", "job_x"], [0, "2026-01-01T00:00:00", "job\u0000x"], [0, 5, "job_x"])]
    for bad in ({"status": "succeeded"}, {"after": "not-a-cursor"}, {"limit": 501}, *({"after": c} for c in forged)):
        r = client.get("/admin/api/overview", params=bad, headers=H(keys.admin))
        assert r.status_code == 422, (bad, r.text)


def test_the_jobs_table_reads_a_page_a_status_on_the_status_index(client, keys, settings):
    """A poll of the overview read its table as one query sorted by a CASE rank of the status, which sorts every job
    shown to return a page; now one query a status, each on ``ix_jobs_status_created`` in its own order (no sort
    of the status's jobs), and the page's total comes from the grouped queue counts (no count of its own)."""
    running = [_job(client, keys, settings, status="running") for _ in range(3)]
    relegated = [_job(client, keys, settings, status="relegated") for _ in range(2)]
    with statements(with_parameters=True) as seen:
        body = client.get("/admin/api/overview", params={"limit": 3}, headers=H(keys.admin)).json()
    assert [j["id"] for j in body["jobs"]] == [*relegated, running[0]] and body["jobs_total"] == 5
    on_jobs = [(q, p) for q, p in seen if "FROM jobs" in q and "job_events" not in q and "slo_met" not in q]
    counts = [q for q, _ in on_jobs if "count(" in q.lower()]
    pages = [(q, p) for q, p in on_jobs if "count(" not in q.lower()]
    assert len(counts) == 1 and "GROUP BY jobs.status, jobs.tier" in counts[0], counts  # the queues' counts only
    assert len(pages) == 2 and not any("CASE" in q for q, _ in pages), pages  # relegated, then running
    with session_scope(settings.sqlalchemy_url) as s:
        for q, p in pages:
            # whole sorts priced out too: on a few rows PostgreSQL sorts them all rather than the index's ties only
            plan = query_plan(s.connection(), q, p, priced_out=("seqscan", "sort"))
            assert "ix_jobs_status_created" in plan and not sorts_rows(plan), plan


def test_a_promote_is_in_the_jobs_history_and_leaves_its_overdue_as_it_was(client, keys, settings):
    """An operator's move of a job to another tier is one of its events (who moved it, from which tier to which);
    the event is no relegation: the job's overdue, counted from its last relegation, stays."""
    job_id = _relegated_ten_minutes_ago(client, keys, settings)

    def overdue() -> float:
        return client.get("/admin/api/overview", headers=H(keys.admin)).json()["jobs"][0]["overdue_s"]

    assert overdue() > 500  # ten minutes since its relegation, its next token due 100 ms after it
    r = client.post(f"/admin/api/jobs/{job_id}/promote", json={"tier": "free"}, headers=H(keys.admin))
    assert r.status_code == 200, r.text
    events = client.get(f"/admin/api/jobs/{job_id}", headers=H(keys.admin)).json()["events"]
    assert (events[-1]["from"], events[-1]["to"], events[-1]["detail"]) == (
        "relegated", "relegated", "moved from tier paid to free by an admin")
    assert overdue() > 500


def test_a_promote_tells_the_worker_that_leased_the_job_after_it_was_read(client, keys, settings, monkeypatch):
    """A dispatched job a worker leases between the promote's read and its write runs on that worker at the tier
    the lease read: the worker the write finds is the one told, not the none of the read."""
    job_id = _job(client, keys, settings, status="dispatched")
    read = admin._job

    def then_a_worker_leases_it(session, job_id: str) -> Job:
        job = read(session, job_id)
        with session_scope(settings.sqlalchemy_url) as s:
            s.execute(update(Job).where(Job.id == job_id).values(status="running", worker_id="w-listening"))
        return job

    monkeypatch.setattr(admin, "_job", then_a_worker_leases_it)
    assert [(m["job_id"], m["tier"]) for m in _promote_messages(client, keys, settings, job_id, "free")] == [
        (job_id, "free")]


def test_a_promote_of_a_job_no_worker_holds_says_there_was_no_one_to_tell(client, keys, settings):
    """A queued or dispatched job (one waiting in a worker for engine room too) takes its tier when a worker leases
    it: the promote took full effect, and ``delivered`` null says no worker was there to hear it (false is kept for a
    worker that holds the job and did not hear)."""
    for values in ({"status": "queued"}, {"status": "dispatched"}, {"status": "dispatched", "worker_id": "w-room"}):
        job_id = _job(client, keys, settings, **values)
        r = client.post(f"/admin/api/jobs/{job_id}/promote", json={"tier": "free"}, headers=H(keys.admin))
        assert r.status_code == 200 and r.json()["delivered"] is None, (values, r.text)
        assert r.json()["worker_id"] is None, r.text
        with session_scope(settings.sqlalchemy_url) as s:
            assert s.get(Job, job_id).tier == "free"
    held = _job(client, keys, settings, status="running", worker_id="w-deaf")  # no one listens on its channel
    r = client.post(f"/admin/api/jobs/{held}/promote", json={"tier": "free"}, headers=H(keys.admin))
    assert (r.json()["delivered"], r.json()["worker_id"]) == (False, "w-deaf"), r.text


def test_a_staged_job_is_refused_as_not_started_yet_not_as_ended(client, keys, settings):
    """A job its batch's fan-out wrote ``staged`` (the batch not started) has not ended: it is no job of the
    batch's yet, and becomes queued when the batch starts. Each action says so, and changes nothing."""
    job_id = _job(client, keys, settings, status="staged-0a1b2c3d")
    for action, body in (("promote", {"tier": "free"}), ("resume", None), ("cancel", None)):
        r = client.post(f"/admin/api/jobs/{job_id}/{action}", json=body, headers=H(keys.admin))
        assert r.status_code == 409, (action, r.text)
        detail = r.json()["detail"]
        assert "not started yet" in detail and "ended" not in detail and "0a1b2c3d" not in detail, (action, detail)
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, job_id)
        assert (job.status, job.tier) == ("staged-0a1b2c3d", "paid")


def _relegated_ten_minutes_ago(client, keys, settings) -> str:
    """A relegated job of worker w1 whose next token was due ten minutes ago (its relegation's event then)."""
    from datetime import timedelta

    from app.db.models import JobEvent
    from app.services.transitions import utcnow

    now = utcnow()
    job_id = _job(client, keys, settings, status="relegated", worker_id="w1", first_token_at=now - timedelta(hours=1),
                  tbt_ms=100)
    with session_scope(settings.sqlalchemy_url) as s:
        s.add(JobEvent(job_id=job_id, from_status="running", to_status="relegated", at=now - timedelta(minutes=10),
                       worker_id="w1", attempt=1, detail="relegated"))
    return job_id


def test_an_admin_resume_is_in_the_jobs_history_and_leaves_its_overdue_as_it_was(client, keys, settings):
    """The operator's resume is one of the job's events whether or not its worker heard it (the worker's own
    "engine resumed it" follows where it did); the job stays relegated until its worker moves it, and the event is
    no relegation: its overdue stays."""
    job_id = _relegated_ten_minutes_ago(client, keys, settings)

    def overdue() -> float:
        return client.get("/admin/api/overview", headers=H(keys.admin)).json()["jobs"][0]["overdue_s"]

    assert overdue() > 500
    r = client.post(f"/admin/api/jobs/{job_id}/resume", headers=H(keys.admin))
    assert r.status_code == 200 and r.json()["delivered"] is False, r.text  # w1 does not listen here
    found = client.get(f"/admin/api/jobs/{job_id}", headers=H(keys.admin)).json()
    assert found["job"]["status"] == "relegated"
    assert [(e["from"], e["to"], e["detail"]) for e in found["events"]][-1] == (
        "relegated", "relegated", "resumed by an admin")
    assert overdue() > 500


def test_a_resume_of_a_job_that_left_relegated_meanwhile_is_a_409_and_records_nothing(client, keys, settings,
                                                                                      monkeypatch):
    job_id = _job(client, keys, settings, status="relegated", worker_id="w1")
    read = admin._job

    def then_its_engine_resumes_it(session, job_id: str) -> Job:
        job = read(session, job_id)
        with session_scope(settings.sqlalchemy_url) as s:
            s.execute(update(Job).where(Job.id == job_id).values(status="running"))
        return job

    monkeypatch.setattr(admin, "_job", then_its_engine_resumes_it)
    r = client.post(f"/admin/api/jobs/{job_id}/resume", headers=H(keys.admin))
    assert r.status_code == 409 and "is running, not relegated" in r.json()["detail"], r.text
    monkeypatch.undo()
    events = client.get(f"/admin/api/jobs/{job_id}", headers=H(keys.admin)).json()["events"]
    assert not [e for e in events if e["detail"] == "resumed by an admin"], events


def test_a_resume_of_a_lost_workers_job_on_its_last_attempt_fails_it_as_the_sweeper_would(client, keys, settings):
    """A job given back from a lost worker on its last allowed attempt (a job that kills workers) is not run again."""
    from datetime import timedelta

    from app.db.models import WorkerState
    from app.services.transitions import utcnow

    job_id = _job(client, keys, settings, status="relegated", worker_id="w-gone", attempt=settings.max_attempts)
    with session_scope(settings.sqlalchemy_url) as s:
        s.add(WorkerState(id="w-gone", model="m", queue="q", device="cpu", heartbeat_at=utcnow() - timedelta(hours=1)))
    r = client.post(f"/admin/api/jobs/{job_id}/resume", headers=H(keys.admin))
    assert r.status_code == 200, r.text
    assert (r.json()["status"], r.json()["worker_lost"]) == ("failed", True), r.text
    assert f"gave up after {settings.max_attempts} attempts" in r.json()["detail"]
    found = client.get(f"/admin/api/jobs/{job_id}", headers=H(keys.admin)).json()
    assert (found["job"]["status"], found["events"][-1]["from"]) == ("failed", "relegated")


def test_of_two_operators_promoting_one_job_at_once_the_one_that_writes_second_gets_a_409(client, keys, settings,
                                                                                        monkeypatch):
    """Each promote writes only where the job is still at the tier it read (and its event says from which): the
    second of two at once finds the first's tier, changes nothing, and its 409 names that tier."""
    monkeypatch.setattr(settings, "tiers", ("bronze", "silver", "gold"))
    job_id = _job(client, keys, settings, status="running", worker_id="w1", tier="silver")
    read = admin._job

    def then_another_operator_promotes_it(session, job_id: str) -> Job:
        job = read(session, job_id)
        with session_scope(settings.sqlalchemy_url) as s:
            admin._move_tier(s, job_id, job.tier, "gold")
        return job

    monkeypatch.setattr(admin, "_job", then_another_operator_promotes_it)
    r = client.post(f"/admin/api/jobs/{job_id}/promote", json={"tier": "bronze"}, headers=H(keys.admin))
    assert r.status_code == 409 and "is at tier gold now" in r.json()["detail"], r.text
    monkeypatch.setattr(admin, "_job", read)
    found = client.get(f"/admin/api/jobs/{job_id}", headers=H(keys.admin)).json()
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, job_id).tier == "gold"
    assert [e["detail"] for e in found["events"]][-1] == "moved from tier silver to gold by an admin"


def test_a_promote_to_the_tier_the_job_has_changes_nothing_and_says_so(client, keys, settings):
    """A promote to the job's own tier is a 200 that says nothing moved, with no event ("moved from tier paid to
    paid" was recorded); its worker is told the tier again, so a retry of a promote it did not hear still reaches it.
    A job that ended is a 409 whatever the tier."""
    job_id = _job(client, keys, settings, status="running", worker_id="w-listening", attempt=1)
    r = client.post(f"/admin/api/jobs/{job_id}/promote", json={"tier": "paid"}, headers=H(keys.admin))
    assert r.status_code == 200, r.text
    events = client.get(f"/admin/api/jobs/{job_id}", headers=H(keys.admin)).json()["events"]
    assert not [e for e in events if "moved from tier" in (e["detail"] or "")], events
    assert r.json()["moved"] is False and f"job {job_id} is at tier paid already" in r.json()["detail"], r.text
    assert [(m["tier"], m["attempt"], m["resume"]) for m in _promote_messages(client, keys, settings, job_id,
                                                                               "paid")] == [("paid", 1, False)]
    r = client.post(f"/admin/api/jobs/{job_id}/promote", json={"tier": "free"}, headers=H(keys.admin))
    assert r.status_code == 200 and r.json()["moved"] is True, r.text
    ended = _job(client, keys, settings, status="succeeded")
    r = client.post(f"/admin/api/jobs/{ended}/promote", json={"tier": "paid"}, headers=H(keys.admin))
    assert r.status_code == 409 and "already ended (succeeded)" in r.json()["detail"], r.text


def _deleted_after_the_read(monkeypatch, settings, module, read_name: str) -> None:
    """``module.read_name`` (the route's read of the job) reads the job, then the job's rows are deleted (as a batch's
    fan-out drops the jobs of a batch that never starts) before the route writes."""
    read = getattr(module, read_name)

    def then_it_is_deleted(session, *args):
        job = read(session, *args)
        with session_scope(settings.sqlalchemy_url) as s:
            s.execute(delete(JobEvent).where(JobEvent.job_id == job.id))
            s.execute(delete(Job).where(Job.id == job.id))
        return job

    monkeypatch.setattr(module, read_name, then_it_is_deleted)


@pytest.mark.parametrize(("action", "body", "status"), [("resume", None, "relegated"),
                                                        ("promote", {"tier": "free"}, "running"),
                                                        ("cancel", None, "running")],
                         ids=["resume", "promote", "cancel"])
def test_an_action_on_a_job_deleted_after_it_was_read_is_a_404_naming_it(client, keys, settings, monkeypatch,
                                                                         action, body, status):
    """The action's write found no row and its re-read of the job (session.refresh) raised: a 500."""
    job_id = _job(client, keys, settings, status=status, worker_id="w1")
    _deleted_after_the_read(monkeypatch, settings, admin, "_job")
    r = client.post(f"/admin/api/jobs/{job_id}/{action}", json=body, headers=H(keys.admin))
    assert r.status_code == 404 and r.json()["detail"] == f"no job {job_id!r} (it was deleted meanwhile)", r.text


def test_a_cancel_of_a_job_deleted_after_it_was_read_is_a_404_naming_it(client, keys, settings, monkeypatch):
    job_id = _job(client, keys, settings, status="running", worker_id="w1")
    _deleted_after_the_read(monkeypatch, settings, jobs_api, "_own_job")
    r = client.post(f"/v1/jobs/{job_id}/cancel", headers=H(keys.paid))
    assert r.status_code == 404 and r.json()["detail"] == f"no job {job_id!r} (it was deleted meanwhile)", r.text


@pytest.mark.parametrize("ended", ["succeeded", "failed", "expired", "cancelled"])
def test_an_admin_cancel_of_a_job_that_ended_is_a_409_naming_its_state(client, keys, settings, ended):
    """As a resume or promote of it is: an operator whose Cancel came after the job ended is told so (where a 200
    said the action went through), and the job keeps its end."""
    job_id = _job(client, keys, settings, status=ended)
    r = client.post(f"/admin/api/jobs/{job_id}/cancel", headers=H(keys.admin))
    assert r.status_code == 409 and r.json()["detail"] == f"job {job_id} already ended ({ended}): nothing to cancel", (
        r.text)
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, job_id).status == ended
        assert not s.query(JobEvent).filter(JobEvent.job_id == job_id, JobEvent.to_status == "cancelled",
                                            JobEvent.from_status == ended).count()


def test_an_admin_cancel_ends_a_job_in_each_open_state(client, keys, settings):
    for values in ({"status": "queued"}, {"status": "dispatched"}, {"status": "running", "worker_id": "w1"},
                   {"status": "relegated", "worker_id": "w1"}):
        job_id = _job(client, keys, settings, **values)
        r = client.post(f"/admin/api/jobs/{job_id}/cancel", headers=H(keys.admin))
        assert r.status_code == 200 and r.json()["cancelled"] is True, (values, r.text)
        found = client.get(f"/admin/api/jobs/{job_id}", headers=H(keys.admin)).json()
        assert found["job"]["status"] == "cancelled", values
        assert found["events"][-1]["detail"] == "cancelled by an admin", values


def test_a_job_failed_by_a_resume_of_its_lost_worker_tells_its_tenant_why(client, keys, settings):
    """An operator resumed a relegated job whose worker had stopped beating, on its last allowed attempt: it failed,
    and its tenant (GET /v1/jobs/{id}) and the dashboard read the sweeper's reason, "the lease of every worker that
    ran it expired", while its lease had not expired: it ended because its worker was lost and an admin gave it
    back. The error now says so, as the job's failed event does."""
    from datetime import timedelta

    from app.db.models import WorkerState
    from app.services.transitions import utcnow

    job_id = _job(client, keys, settings, status="relegated", worker_id="w-gone", attempt=settings.max_attempts,
                  lease_expires_at=utcnow() + timedelta(minutes=10))
    with session_scope(settings.sqlalchemy_url) as s:
        s.add(WorkerState(id="w-gone", model="m", queue="q", device="cpu", heartbeat_at=utcnow() - timedelta(hours=1)))
    r = client.post(f"/admin/api/jobs/{job_id}/resume", headers=H(keys.admin))
    assert r.status_code == 200 and r.json()["status"] == "failed", r.text
    error = client.get(f"/v1/jobs/{job_id}", headers=H(keys.paid)).json()["error"]
    assert "lease" not in error, error
    assert error.startswith(f"gave up after {settings.max_attempts} attempts") and "w-gone" in error, error
    assert "stopped beating" in error and "an admin" in error, error
    history = client.get(f"/admin/api/jobs/{job_id}", headers=H(keys.admin)).json()
    assert history["job"]["error"] == error and history["events"][-1]["detail"] == error
    assert error in r.json()["detail"]
