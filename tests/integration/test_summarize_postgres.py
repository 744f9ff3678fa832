"""The summarization driver's lease and versioned commit on PostgreSQL (READ COMMITTED, row
locks) as well as SQLite: concurrent drivers submit each job once, a held lease keeps others
out, a run reaches its end. Uses the throwaway cluster of conftest's ``pg_url``."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select, update

from app.auth import Principal, create_tenant
from app.db.models import Job, SummarizationDocument, SummarizationRun
from app.db.session import session_scope
from app.services.transitions import utcnow
from app.summarize import driver, lease, service, store
from app.summarize.documents import Document
from app.summarize.driver import Outcome
from tests.conftest import make_settings
from tests.unit.api.test_summarize_driver import LONG, drive_concurrently, finish_jobs
from tests.integration.test_postgres import pytestmark as postgres_marks

pytestmark = postgres_marks

def test_driver_on_postgres(pg_url, tmp_path, tiny_model_dir, monkeypatch):
    from app.db.migrate import upgrade

    monkeypatch.setattr(store, "STAGE_CHUNK", 2)  # the first level's jobs staged a few at a time (a status of 15)
    upgrade(pg_url)
    settings = make_settings(tmp_path, pg_url, None, tiny_model_dir)
    with session_scope(pg_url) as s:
        principal = Principal(key_id="", tenant_id=create_tenant(s, "acme", "paid").id, tier="paid", is_admin=False)
    docs = [Document(f"d{i}", LONG if i % 2 else f"Short document {i}. It ends here.") for i in range(4)]
    run_id = service.start_run(settings, principal, docs, utcnow() + timedelta(hours=1), max_summary_tokens=12,
                               chunk_tokens=120, overlap_tokens=8, tier="paid").id
    finish_jobs(pg_url)
    with session_scope(pg_url) as s:
        run = s.get(SummarizationRun, run_id)
    assert lease.claim(pg_url, run, "dead-api", lease_s=60)
    assert driver.advance(settings, run_id, "w1").outcome == Outcome.BUSY
    with session_scope(pg_url) as s:
        s.execute(update(SummarizationRun).values(lease_expires_at=utcnow() - timedelta(seconds=1)))

    outcomes = drive_concurrently(settings, run_id)
    with session_scope(pg_url) as s:
        run = s.get(SummarizationRun, run_id)
        jobs = s.scalar(select(func.count()).select_from(Job))
        per_doc = s.scalars(select(SummarizationDocument.jobs)).all()
    assert (run.status, run.documents_done, run.lease_owner) == ("completed", 4, None)
    assert jobs == run.jobs_submitted == run.jobs_done == sum(per_doc)
    assert Outcome.STEPPED in outcomes
    assert b'"id": "d0"' in service.view(settings, run_id, with_results=True).results

