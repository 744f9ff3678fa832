"""Fan-in of a batch whose completion window ended (real migrated DB, no worker)."""

from __future__ import annotations

import json
from datetime import timedelta

from sqlalchemy import select

from app.batch import finalize
from app.batch.finalize import maybe_finalize
from app.batch.storage import read_content, save_file
from app.db.models import Batch, File, Job, Tenant, new_id
from app.db.session import session_scope
from app.services.transitions import utcnow


def _batch(s, tmp_path, statuses: list[str], expires_in_s: float) -> str:
    t = Tenant(name=new_id("t"))
    s.add(t)
    s.flush()
    src = save_file(s, tmp_path, t.id, "in.jsonl", "batch", b"{}\n")
    now = utcnow()
    b = Batch(tenant_id=t.id, endpoint="/v1/completions", input_file_id=src.id, completion_window="1h",
              status="in_progress", tier="paid", total=len(statuses), created_at=now - timedelta(hours=1),
              expires_at=now + timedelta(seconds=expires_in_s))
    s.add(b)
    s.flush()
    for i, st in enumerate(statuses):
        s.add(Job(tenant_id=t.id, kind="batch", tier="paid", model="tiny", status=st, prompt="x", sampling={},
                  endpoint="/v1/completions", batch_id=b.id, custom_id=f"c{i}", output_text="ok",
                  finished_at=now if st in ("succeeded", "expired") else None,
                  finish_reason="length" if st == "succeeded" else None))
    s.commit()
    return b.id


def _errors(s, batch: Batch) -> list[dict]:
    return [json.loads(x) for x in read_content(s.get(File, batch.error_file_id)).decode().splitlines()]


def test_window_ended_expires_pending_jobs(db_url, tmp_path):
    with session_scope(db_url) as s:
        batch_id = _batch(s, tmp_path, ["succeeded", "queued", "running"], expires_in_s=-1)
        assert maybe_finalize(s, batch_id, tmp_path, "")
        b = s.get(Batch, batch_id, populate_existing=True)
        assert b.status == "expired" and b.expired_at is not None and b.completed_at is None
        assert (b.completed, b.failed) == (1, 2)
        assert {e["custom_id"]: e["error"]["code"] for e in _errors(s, b)} == {"c1": "batch_expired",
                                                                              "c2": "batch_expired"}
        # the jobs it expired missed their SLO (the Usage API's num_slo_missed, the dashboard, /metrics)
        assert {j.custom_id: j.slo_met for j in s.scalars(select(Job).where(Job.batch_id == batch_id))} == {
            "c0": None, "c1": False, "c2": False}


def test_expired_by_a_concurrent_caller_is_still_expired(db_url, tmp_path):
    # another finalizer already expired the jobs: this call must not call the batch "completed"
    with session_scope(db_url) as s:
        batch_id = _batch(s, tmp_path, ["succeeded", "expired"], expires_in_s=-1)
        assert maybe_finalize(s, batch_id, tmp_path, "")
        assert s.get(Batch, batch_id, populate_existing=True).status == "expired"


def test_all_done_before_the_window_is_completed(db_url, tmp_path):
    with session_scope(db_url) as s:
        batch_id = _batch(s, tmp_path, ["succeeded", "succeeded"], expires_in_s=-1)
        assert maybe_finalize(s, batch_id, tmp_path, "")
        assert s.get(Batch, batch_id, populate_existing=True).status == "completed"
        pending = _batch(s, tmp_path, ["succeeded", "queued"], expires_in_s=3600)
        assert not maybe_finalize(s, pending, tmp_path, "")
        assert s.get(Batch, pending, populate_existing=True).status == "in_progress"


def test_counts_read_before_another_callers_fan_in_do_not_overwrite_it(db_url, tmp_path, monkeypatch):
    """Two callers: this one reads a request still running; before it writes that progress, the request ends and
    another caller fans the batch in. The batch keeps the other's final counts (it showed 2 of 3 completed)."""
    real = finalize._counts
    with session_scope(db_url) as s:
        batch_id = _batch(s, tmp_path, ["succeeded", "succeeded", "running"], expires_in_s=3600)

    def stale_then_fan_in(session, bid):
        counts = real(session, bid)  # what this caller read: one request still running
        monkeypatch.setattr(finalize, "_counts", real)
        with session_scope(db_url) as other:  # meanwhile the request ends and another caller fans the batch in
            job = other.scalars(select(Job).where(Job.batch_id == bid, Job.status == "running")).one()
            job.status, job.finished_at, job.finish_reason = "succeeded", utcnow(), "length"
            other.commit()
            assert maybe_finalize(other, bid, tmp_path, "")
        return counts

    monkeypatch.setattr(finalize, "_counts", stale_then_fan_in)
    with session_scope(db_url) as s:
        assert not maybe_finalize(s, batch_id, tmp_path, "")
        b = s.get(Batch, batch_id, populate_existing=True)
        assert (b.status, b.completed, b.failed) == ("completed", 3, 0)
