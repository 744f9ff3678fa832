"""Dashboard overdue: every running job is judged (TTFT before its first token, TBT while relegated, TTLT)."""

from __future__ import annotations

from datetime import timedelta

from app.api.admin import overdue_s
from app.db.models import Job, JobEvent, Tenant
from app.db.session import session_scope
from app.services.transitions import utcnow
from tests.conftest import Keys


def _job(status="running", **kw):
    return Job(kind=kw.pop("kind", "interactive"), tier="free", model="tiny", status=status, prompt="x", sampling={},
               **kw)


def test_overdue_per_target():
    now = utcnow()
    ago = lambda s: now - timedelta(seconds=s)  # noqa: E731
    # running, no first token, TTFT 1 s, created 3 s ago: 2 s late
    assert overdue_s(_job(created_at=ago(3), ttft_ms=1000), now) == 2.0
    assert overdue_s(_job(created_at=ago(0.5), ttft_ms=1000), now) == 0.0
    # streaming: on its pace as far as SQL knows
    assert overdue_s(_job(created_at=ago(3), ttft_ms=1000, tbt_ms=100, first_token_at=ago(2.5)), now) == 0.0
    # relegated after its first token: the next token was due one TBT after the relegation
    relegated = _job("relegated", created_at=ago(10), ttft_ms=1000, tbt_ms=500, first_token_at=ago(9))
    assert overdue_s(relegated, now, relegated_at=ago(4)) == 3.5
    assert overdue_s(relegated, now) == 8.5  # no event: judged from the first token
    # deadline jobs: TTLT, whatever their first token
    assert overdue_s(_job(kind="batch", created_at=ago(9), deadline_at=ago(2), first_token_at=ago(5)), now) == 2.0
    assert overdue_s(_job(kind="batch", created_at=ago(9), deadline_at=now + timedelta(hours=1)), now) == 0.0


def test_overview_reports_running_interactive_jobs(client, keys, db_url):
    now = utcnow()
    with session_scope(db_url) as s:
        t = s.get(Tenant, keys.tenant_id)
        late = _job(tenant_id=t.id, created_at=now - timedelta(seconds=5), ttft_ms=1000)
        fresh = _job(tenant_id=t.id, created_at=now, ttft_ms=60_000)
        stalled = _job("relegated", tenant_id=t.id, created_at=now - timedelta(seconds=20), ttft_ms=1000,
                       tbt_ms=1000, first_token_at=now - timedelta(seconds=19))
        s.add_all([late, fresh, stalled])
        s.flush()
        s.add(JobEvent(job_id=stalled.id, from_status="running", to_status="relegated",
                       at=now - timedelta(seconds=10)))
        ids = late.id, fresh.id, stalled.id
    jobs = {j["id"]: j for j in client.get("/admin/api/overview", headers=Keys.header(keys.admin)).json()["jobs"]}
    assert jobs[ids[0]]["overdue_s"] >= 4.0 and jobs[ids[0]]["first_token"] is False
    assert jobs[ids[1]]["overdue_s"] == 0.0
    assert 9.0 <= jobs[ids[2]]["overdue_s"] < 12.0 and jobs[ids[2]]["first_token"] is True


def slo_jobs(session, tenant_id: str) -> tuple[int, list[dict]]:
    """Finished jobs around minute boundaries ten minutes ago, and the SLO chart's points they make."""
    from datetime import UTC, datetime

    base = (int(utcnow().timestamp()) // 60 - 10) * 60
    at = lambda s: datetime.fromtimestamp(base + s, UTC)  # noqa: E731
    ends = [("paid", 0, True), ("paid", 59.9, False), ("paid", 60, True), ("free", 30, True), ("free", 31, None),
            ("free", -7200, False)]  # judged nothing; finished before the window
    session.add_all(Job(tenant_id=tenant_id, kind="interactive", tier=tier, model="tiny", status="succeeded",
                        sampling={}, created_at=at(s - 1), finished_at=at(s), slo_met=met) for tier, s, met in ends)
    session.commit()
    return base, [{"t": base, "tier": "free", "met": 1, "violated": 0},
                  {"t": base, "tier": "paid", "met": 1, "violated": 1},
                  {"t": base + 60, "tier": "paid", "met": 1, "violated": 0}]


def test_slo_chart_points_are_counted_in_sql_by_minute_and_tier(db_url):
    """The overview (read every second) gets the chart's counts from a grouped query, not an hour of job rows."""
    from sqlalchemy import event

    from app.observability.slo_chart import slo_series

    with session_scope(db_url) as s:
        s.add(Tenant(id="t1", name="t1", default_tier="paid"))
        s.flush()
        _, expected = slo_jobs(s, "t1")
        statements = []
        engine = s.get_bind()
        listen = lambda conn, cursor, sql, *rest: statements.append(sql)  # noqa: E731
        event.listen(engine, "before_cursor_execute", listen)
        try:
            assert slo_series(s, 60) == expected
        finally:
            event.remove(engine, "before_cursor_execute", listen)
    assert statements and all("GROUP BY" in sql for sql in statements if "FROM jobs" in sql), statements


def test_slo_chart_counts_a_settled_minute_once_and_the_recent_ones_again(db_url, monkeypatch):
    """The overview's chart (every dashboard polls it each second) reads only the minutes not settled yet, at most
    every few seconds: a minute that ended five minutes ago is counted once and kept."""
    from datetime import UTC, datetime

    from app.observability import slo_chart

    chart = slo_chart.SloChart(fresh_s=0)  # counts the recent minutes at each call
    since = []
    counts = slo_chart.slo_counts
    monkeypatch.setattr(slo_chart, "slo_counts", lambda s, at, *a: since.append(at) or counts(s, at, *a))
    with session_scope(db_url) as s:
        s.add(Tenant(id="t1", name="t1", default_tier="paid"))
        s.flush()
        base, expected = slo_jobs(s, "t1")  # jobs ten minutes ago: settled
        assert chart.series(s, 60) == slo_chart.slo_series(s, 60) == expected
        assert chart.series(s, 60) == expected
        # the second call read from the settled edge (five minutes ago, to the minute) on, not the hour
        settled = (int(utcnow().timestamp()) - 300) // 60 * 60
        assert len(since) == 3 and since[2] >= datetime.fromtimestamp(settled - 60, UTC) > since[0], since
        # a job that finishes now shows at the next poll; one written late into a settled minute does not
        s.add_all([Job(tenant_id="t1", kind="interactive", tier="paid", model="tiny", status="succeeded", sampling={},
                       finished_at=at, slo_met=False) for at in (utcnow(), datetime.fromtimestamp(base, UTC))])
        s.commit()
        now_bucket = int(utcnow().timestamp()) // 60 * 60
        points = chart.series(s, 60)
        assert points[:len(expected)] == expected and points[-1] == {
            "t": now_bucket, "tier": "paid", "met": 0, "violated": 1}
        fresh = slo_chart.SloChart().series(s, 60)  # another process counts it afresh
        assert [p["violated"] for p in fresh if (p["t"], p["tier"]) == (base, "paid")] == [2]
    still = utcnow()
    monkeypatch.setattr(slo_chart, "utcnow", lambda: still)  # the clock stands: the next poll is within SLO_FRESH_S
    with session_scope(db_url) as s:  # a poll reads no job at all then
        lazy = slo_chart.SloChart()
        lazy.series(s, 60)
        calls = len(since)
        assert lazy.series(s, 60) == fresh and len(since) == calls
