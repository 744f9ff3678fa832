"""The API's group-commit writer and its sender (real migrated SQLite, real Redis): a failure in one batch fails
that batch's submissions or sends alone, and the threads go on for every later one."""

from __future__ import annotations

import pytest
import redis

from app.auth import Principal
from app.db.models import Job
from app.db.session import session_scope
from app.schemas import JobCreate
from app.services import job_writer, routing
from app.services.jobs import build_job, rate_charge
from app.services.rate_limits import Limits
from tests.conftest import wait_for
from tests.postgres import TEST_DATABASE

pytestmark = pytest.mark.integration


def _job(settings, keys, limits: Limits | None = None) -> tuple[Principal, Job]:
    principal = Principal("k", keys.tenant_id, "paid", False, limits or Limits())
    return principal, build_job(settings, principal, JobCreate(prompt="hi", max_tokens=2))


def test_a_send_that_fails_puts_its_jobs_back_for_the_sweeper_and_later_jobs_are_sent(settings, keys, monkeypatch):
    real, calls = routing.job_queue, []

    def job_queue(*args):  # routing reads SQL (live workers, runtime adapters): one read fails
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("could not connect to server")
        return real(*args)

    monkeypatch.setattr(routing, "job_queue", job_queue)
    writer = job_writer.JobWriter(settings)
    try:
        first = writer.write(_job(settings, keys)[1], "test").job.id
        wait_for(lambda: _status(settings, first) == "queued", 10, "the unsent job to go back to the queue")
        later = writer.write(_job(settings, keys)[1], "test").job.id
        queue = redis.Redis.from_url(settings.redis_url)
        wait_for(lambda: later.encode() in b"".join(queue.lrange("coserve.tiny", 0, -1)), 10, "the later send")
    finally:
        writer.close()


def test_a_batch_whose_write_fails_fails_its_submissions_and_later_ones_are_written(settings, keys, monkeypatch):
    writer = job_writer.JobWriter(settings)
    try:
        principal, job = _job(settings, keys, Limits(requests_per_minute=100))
        monkeypatch.setattr(writer.limiter, "take_many", lambda charges: 1 / 0)  # the limits' Redis call fails
        with pytest.raises(ZeroDivisionError):
            writer.write(job, "test", rate_charge(principal, job), timeout=10)
        monkeypatch.undo()
        written = writer.write(_job(settings, keys)[1], "test", timeout=10)
        assert _status(settings, written.job.id) in ("queued", "dispatched")
    finally:
        writer.close()


def _status(settings, job_id: str) -> str | None:
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, job_id)
        return job.status if job is not None else None


def test_job_rows_hold_what_each_jobs_attributes_read(settings, keys):
    """JobRows reads a job's instance state instead of its 61 attributes: the same values, set or not."""
    principal = Principal("k", keys.tenant_id, "paid", False, Limits())
    specs = [JobCreate(prompt="hi", max_tokens=2),
             JobCreate(kind="batch", deadline_window_s=60, prompt="hi", seed=3, stop=["x"], user="u", app_id="a"),
             JobCreate(messages=[{"role": "user", "content": "hi"}], max_tokens=3, tool_choice="none",
                       tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                       chat_template_kwargs={"enable_thinking": False}, ttft_ms=500)]
    jobs = [build_job(settings, principal, spec, response={"instructions": "be brief"} if i else None)
            for i, spec in enumerate(specs)]
    now = jobs[0].created_at
    for dispatched_at in (None, now):
        rows = job_writer.JobRows.of([(job, "test") for job in jobs], dispatched_at)
        for job, row in zip(jobs, rows.jobs, strict=True):
            read = {k: getattr(job, k) for k in job_writer.JOB_COLUMNS}
            if dispatched_at is not None:
                read |= {"status": "dispatched", "dispatched_at": now}
            assert row == read
            assert any(v is None for v in row.values()) and row["sampling"] and row["prompt_tokens"]


@pytest.mark.skipif(TEST_DATABASE != "sqlite", reason="rows are bound before SQLite's write lock only "
                    "(JobRows.bind leaves them to the insert on PostgreSQL, which takes no such lock)")
def test_rows_bound_before_the_lock_are_stored_as_the_insert_would_bind_them(settings, keys):
    """A batch's chunks are bound (JSON serialized, datetimes as text) before SQLite's write lock: the database holds
    the very same values as when the insert binds them."""
    from sqlalchemy import text

    from app.db.session import get_engine

    principal = Principal("k", keys.tenant_id, "paid", False, Limits())
    jobs = [build_job(settings, principal, JobCreate(prompt="hi", max_tokens=2, stop=["x"], seed=5)),
            build_job(settings, principal, JobCreate(messages=[{"role": "user", "content": "h\u00e9"}], max_tokens=2),
                      response={"instructions": "be brief"}),
            build_job(settings, principal, JobCreate(kind="batch", deadline_window_s=60, prompt="hi"))]
    rows = job_writer.JobRows.of([(job, "test") for job in jobs], jobs[0].created_at)
    twin = job_writer.JobRows([{**r, "id": r["id"] + "-b"} for r in rows.jobs],
                              [{**e, "job_id": e["job_id"] + "-b"} for e in rows.events])
    bound = twin.bind(get_engine(settings.sqlalchemy_url).dialect)
    assert bound.bound and twin.jobs[0]["sampling"] == rows.jobs[0]["sampling"]  # the original rows stay as they were
    with session_scope(settings.sqlalchemy_url) as s:
        rows.insert(s, status="staged-x")
        bound.insert(s, status="staged-x")
    with session_scope(settings.sqlalchemy_url) as s:
        for job in jobs:
            stored = [s.execute(text("SELECT * FROM jobs WHERE id = :i"), {"i": i}).mappings().one()
                      for i in (job.id, job.id + "-b")]
            assert {**stored[1], "id": job.id} == dict(stored[0])
            assert stored[0]["sampling"] and stored[0]["created_at"]
            events = [[dict(e, id=None, job_id=None) for e in s.execute(
                text("SELECT * FROM job_events WHERE job_id = :i ORDER BY id"), {"i": i}).mappings()]
                for i in (job.id, job.id + "-b")]
            assert events[0] == events[1] and len(events[0]) == 2


def test_job_rows_of_a_jobs_values_are_those_of_its_orm_job(settings, keys):
    """The batch fan-out hands JobRows each job's column values (jobs.job_values), not a Job: the same rows."""
    from app.services.jobs import job_values

    principal = Principal("k", keys.tenant_id, "paid", False, Limits())
    specs = [JobCreate(prompt="hi", max_tokens=2, seed=1),
             JobCreate(kind="batch", deadline_window_s=60, prompt="hi", seed=3, stop=["x"], user="u", app_id="a"),
             JobCreate(messages=[{"role": "user", "content": "hi"}], max_tokens=3, tool_choice="none", seed=2,
                       tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                       chat_template_kwargs={"enable_thinking": False}, ttft_ms=500)]
    values = [job_values(settings, principal, spec, batch_id="b", custom_id=f"c{i}") for i, spec in enumerate(specs)]
    now = values[0]["created_at"]
    for dispatched_at in (None, now):
        of_values = job_writer.JobRows.of([(v, "test") for v in values], dispatched_at)
        of_jobs = job_writer.JobRows.of([(Job(**v), "test") for v in values], dispatched_at)
        assert of_values == of_jobs and len(of_values.events) == (3 if dispatched_at is None else 6)


def test_a_columns_none_is_bound_once_not_a_row_at_a_time():
    calls = []

    def proc(value):
        calls.append(value)
        return "null" if value is None else f"<{value}>"

    rows = job_writer._bound_rows([{"a": None}, {"a": 1}, {"a": None}, {"a": None}], [("a", proc)])
    assert rows == [{"a": "null"}, {"a": "<1>"}, {"a": "null"}, {"a": "null"}]
    assert calls == [None, 1]  # a None's binding once; each other value its own
