"""Cancelling a batch while a worker writes to the same SQLite file (WAL): no 'database is locked'."""

from __future__ import annotations

import sqlite3

import pytest

from app.batch import finalize
from app.services import cancel as cancelling
from app.db.models import Batch, File, Job, JobStatus, Tenant
from app.db.session import session_scope
from tests.postgres import TEST_DATABASE

pytestmark = pytest.mark.integration


@pytest.mark.skipif(TEST_DATABASE != "sqlite", reason="SQLite's write lock let go between the chunks "
                    "(PostgreSQL locks rows: stop_job_ids takes no pause there), driven through the SQLite file")
def test_stopping_a_batchs_jobs_survives_a_worker_committing_between_them(db_url, monkeypatch):
    with session_scope(db_url) as s:
        t = Tenant(name="c")
        s.add(t)
        s.flush()
        f = File(tenant_id=t.id, filename="in.jsonl", purpose="batch", bytes=1, path="/dev/null")
        s.add(f)
        s.flush()
        b = Batch(tenant_id=t.id, endpoint="/v1/chat/completions", input_file_id=f.id, completion_window="24h",
                  status="cancelling", tier="paid", total=4)
        s.add(b)
        s.flush()
        jobs = [Job(tenant_id=t.id, kind="batch", tier="paid", model="m", status="running", prompt="x", sampling={},
                    batch_id=b.id) for _ in range(3)]
        other = Job(tenant_id=t.id, kind="batch", tier="paid", model="m", status="running", prompt="y", sampling={})
        s.add_all([*jobs, other])
        s.flush()
        batch_id, other_id = b.id, other.id

    path = db_url.removeprefix("sqlite:///")
    announced = []

    def announce_then_a_worker_writes(redis_url, ended, status):
        # after a chunk's announce a worker (its own connection, another process in production) commits before
        # the next chunk's update
        announced.extend(job_id for job_id, _attempt in ended)
        with sqlite3.connect(path, timeout=15) as worker:
            worker.execute("UPDATE jobs SET completion_tokens = ? WHERE id = ?", (len(announced), other_id))

    pauses = []

    def let_others_write(held_s):  # the lock let go between chunks, as long as the chunk before held it
        assert 0 < held_s and len(pauses) == len(announced) - 1  # after a chunk's commit and its announce
        pauses.append(held_s)

    monkeypatch.setattr(cancelling, "announce_cancels", announce_then_a_worker_writes)
    monkeypatch.setattr(cancelling, "let_others_write", let_others_write)
    monkeypatch.setattr(cancelling, "STOP_CHUNK", 1)  # a transaction per job
    with session_scope(db_url) as s:
        assert finalize.stop_jobs(s, batch_id, JobStatus.CANCELLED, "cancelled with its batch", "redis://unused") == 3
    assert len(pauses) == 2  # between the three chunks, not after the last
    with session_scope(db_url) as s:
        assert sorted(s.get(Job, j.id).status for j in jobs) == ["cancelled"] * 3
        assert s.get(Job, other_id).completion_tokens == 3
