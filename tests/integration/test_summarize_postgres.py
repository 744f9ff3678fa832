"""The summarization driver's lease and versioned commit on PostgreSQL (READ COMMITTED, row
locks) as well as SQLite: concurrent drivers submit each job once, a held lease keeps others
out, a run reaches its end. Uses the throwaway cluster of ``test_postgres``."""

from __future__ import annotations

import threading
from datetime import timedelta

from sqlalchemy import func, select, update

from app.auth import Principal, create_tenant
from app.db.models import Job, SummarizationDocument, SummarizationRun
from app.db.session import session_scope
from app.services.transitions import utcnow
from app.summarize import driver, service
from app.summarize.documents import Document
from app.summarize.driver import Outcome
from tests.conftest import make_settings
from tests.integration.test_postgres import pg_server, pg_url  # noqa: F401  (fixtures)
from tests.integration.test_postgres import pytestmark as postgres_marks

pytestmark = postgres_marks

LONG = " ".join(f"Fact number {i} is about the topic of the document." for i in range(60))


def _finish_jobs(url: str) -> int:
    with session_scope(url) as s:
        ids = s.scalars(select(Job.id).where(Job.status.in_(["queued", "dispatched"]))).all()
        for job_id in ids:
            s.execute(update(Job).where(Job.id == job_id).values(status="succeeded", output_text="A summary.",
                                                                 finished_at=utcnow()))
    return len(ids)


def test_driver_on_postgres(pg_url, tmp_path, tiny_model_dir):  # noqa: F811
    from app.db.migrate import upgrade

    upgrade(pg_url)
    settings = make_settings(tmp_path, pg_url, None, tiny_model_dir)
    with session_scope(pg_url) as s:
        principal = Principal(key_id="", tenant_id=create_tenant(s, "acme", "paid").id, tier="paid", is_admin=False)
    docs = [Document(f"d{i}", LONG if i % 2 else f"Short document {i}. It ends here.") for i in range(4)]
    run_id = service.start_run(settings, principal, docs, utcnow() + timedelta(hours=1), max_summary_tokens=12,
                               chunk_tokens=120, overlap_tokens=8, tier="paid").id
    _finish_jobs(pg_url)
    with session_scope(pg_url) as s:
        run = s.get(SummarizationRun, run_id)
    assert driver._claim(pg_url, run, "dead-api", lease_s=60)
    assert driver.advance(settings, run_id, "w1").outcome == Outcome.BUSY
    with session_scope(pg_url) as s:
        s.execute(update(SummarizationRun).values(lease_expires_at=utcnow() - timedelta(seconds=1)))

    stop = threading.Event()
    outcomes: list[Outcome] = []

    def drive(owner: str) -> None:
        while not stop.is_set():
            outcomes.append(driver.advance(settings, run_id, owner).outcome)

    threads = [threading.Thread(target=drive, args=(f"p{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(200):
            _finish_jobs(pg_url)
            with session_scope(pg_url) as s:
                if s.get(SummarizationRun, run_id).status != "running":
                    break
            stop.wait(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    with session_scope(pg_url) as s:
        run = s.get(SummarizationRun, run_id)
        jobs = s.scalar(select(func.count()).select_from(Job))
        per_doc = s.scalars(select(SummarizationDocument.jobs)).all()
    assert (run.status, run.documents_done, run.lease_owner) == ("completed", 4, None)
    assert jobs == run.jobs_submitted == run.jobs_done == sum(per_doc)
    assert Outcome.STEPPED in outcomes
    assert b'"id": "d0"' in service.view(settings, run_id, with_results=True).results

