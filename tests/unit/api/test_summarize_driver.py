"""The durable summarization step (``app.summarize.driver.advance``) on a real migrated SQLite
DB, with no worker: the tests end jobs in SQL themselves. A step commits once or not at all,
never submits a job twice, and any process can take it over when its holder stops."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from itertools import count

import pytest
from sqlalchemy import delete, func, select, update

from app.auth import Principal, create_tenant
from app.db.models import Job, JobEvent, SummarizationDocument, SummarizationRun
from app.db.session import session_scope, write_guard
from app.services import job_writer
from app.services.transitions import as_utc, utcnow
from app.summarize import driver, lease, service, store
from app.summarize.documents import Document
from app.summarize.driver import Outcome
from tests.conftest import load_runtime_adapter, make_settings
from tests.sql_statements import query_plan

LONG = " ".join(f"Fact number {i} is about the topic of the document." for i in range(60))


@pytest.fixture
def settings(tmp_path, db_url, tiny_model_dir):
    return make_settings(tmp_path, db_url, None, tiny_model_dir)  # no broker: new jobs stay queued


@pytest.fixture
def principal(db_url) -> Principal:
    with session_scope(db_url) as s:
        tenant = create_tenant(s, "acme", "paid")
        return Principal(key_id="", tenant_id=tenant.id, tier="paid", is_admin=False)


def start(settings, principal, docs=None) -> str:
    docs = docs or [Document("long", LONG), Document("short", "The cat sat on the mat. It was warm.")]
    progress = service.start_run(settings, principal, docs, utcnow() + timedelta(hours=1), max_summary_tokens=12,
                                 chunk_tokens=120, overlap_tokens=8, tier="paid")
    return progress.id


def finish_jobs(url: str, status: str = "succeeded") -> int:
    """What the workers would do: every pending job of the run ends with a short text."""
    with session_scope(url, immediate=True) as s, write_guard(s):  # reads, then writes: as the worker does
        ids = s.scalars(select(Job.id).where(Job.status.in_(["queued", "dispatched"]))).all()
        for job_id in ids:
            s.execute(update(Job).where(Job.id == job_id).values(status=status, output_text=f"Summary {job_id[-4:]}.",
                                                                 finished_at=utcnow()))
    return len(ids)


def drive_concurrently(settings, run_id: str, drivers: int = 3) -> list[Outcome]:
    """``drivers`` threads step the run at once while the "workers" finish its jobs, until it ends."""
    url = settings.sqlalchemy_url
    stop = threading.Event()
    outcomes: list[Outcome] = []

    def drive(owner: str) -> None:
        while not stop.is_set():
            outcomes.append(driver.advance(settings, run_id, owner).outcome)

    threads = [threading.Thread(target=drive, args=(f"p{i}",)) for i in range(drivers)]
    for t in threads:
        t.start()
    try:
        for _ in range(200):
            finish_jobs(url)
            if run_row(url, run_id).status != "running":
                break
            stop.wait(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    return outcomes


def run_row(url: str, run_id: str) -> SummarizationRun:
    with session_scope(url) as s:
        return s.get(SummarizationRun, run_id)


def job_count(url: str) -> int:
    with session_scope(url) as s:
        return s.scalar(select(func.count()).select_from(Job))


def test_start_writes_the_run_its_documents_and_first_level_together(settings, principal):
    url = settings.sqlalchemy_url
    run_id = start(settings, principal)
    run = run_row(url, run_id)
    assert (run.status, run.documents, run.version, run.lease_owner) == ("running", 2, 1, None)  # its first step
    with session_scope(url) as s:
        docs = s.scalars(select(SummarizationDocument).order_by(SummarizationDocument.position)).all()
        jobs = s.scalars(select(Job)).all()
        events = s.scalar(select(func.count()).select_from(JobEvent))
    assert [d.doc_id for d in docs] == ["long", "short"]
    assert docs[0].chunks > 1 and not docs[0].final and docs[1].final and docs[1].chunks == 1
    assert sorted(j.id for j in jobs) == sorted(docs[0].pending + docs[1].pending)
    assert run.jobs_submitted == len(jobs) and events == len(jobs)
    assert {j.status for j in jobs} == {"queued"} and {j.endpoint for j in jobs} == {"/v1/summarize"}
    assert {j.app_id for j in jobs} == {"summarize-map", "summarize-final"}
    # nothing ended yet: a step has nothing to do and writes nothing
    assert driver.advance(settings, run_id, "p1") == driver.Step(Outcome.IDLE, "running")
    assert run_row(url, run_id).version == 1  # its first step's


def test_the_start_writes_the_run_validating_and_its_first_step_splits_it_or_fails_it_whole(settings, principal):
    """The request writes the run and its documents, unsplit (no tokenizer, no job); the split and the checks that
    need it happen in the run's first step, which writes the first level's jobs, or none and fails the run."""
    url, deadline = settings.sqlalchemy_url, utcnow() + timedelta(hours=1)
    docs = [Document("long", LONG), Document("short", "The cat sat on the mat. It was warm.")]
    options = {"max_summary_tokens": 12, "chunk_tokens": 120, "overlap_tokens": 8, "tier": "paid"}
    progress = service.create_run(settings, principal, docs, deadline, **options)
    assert (progress.status, progress.jobs_submitted) == ("validating", 0)
    with session_scope(url) as s:
        rows = s.scalars(select(SummarizationDocument).order_by(SummarizationDocument.position)).all()
        assert [(r.doc_id, r.text, r.pending, r.chunks, r.done) for r in rows] == [
            ("long", LONG, [], 0, False), ("short", docs[1].text, [], 0, False)]
    assert job_count(url) == 0
    step = driver.advance(settings, progress.id, "api")
    assert (step.outcome, step.status) == (Outcome.STEPPED, "running") and job_count(url) == len(step.submitted) > 2
    assert run_row(url, progress.id).jobs_submitted == len(step.submitted)

    big = service.create_run(settings, principal, docs, deadline, **options).id
    settings.summarize_max_jobs = 2  # the first step's exact count (the request's bound from words let it by)
    assert driver.advance(settings, big, "api") == driver.Step(Outcome.STEPPED, "failed")
    run = run_row(url, big)
    assert "a run takes at most 2" in run.reason and (run.documents_done, run.documents_failed) == (2, 2)
    assert job_count(url) == len(step.submitted)  # none of the refused run's
    with session_scope(url) as s:
        errors = s.scalars(select(SummarizationDocument.error).where(SummarizationDocument.run_id == big)).all()
    assert errors == [driver.RUN_FAILED] * 2  # the reason once, in the run


def test_a_cancel_while_the_first_step_splits_ends_the_run_and_that_step_writes_nothing(settings, principal):
    url = settings.sqlalchemy_url
    run_id = service.create_run(settings, principal, [Document("long", LONG)], utcnow() + timedelta(hours=1),
                                max_summary_tokens=12, chunk_tokens=120, overlap_tokens=8, tier="paid").id
    look = driver._look(url, run_id)
    assert lease.claim(url, look.run, "splitter", lease_s=600)  # the first step is splitting (a large run)
    assert service.cancel(settings, run_id)  # not a RunBusy while the split goes on
    run = run_row(url, run_id)
    assert (run.status, run.reason, run.documents_failed, run.lease_owner) == (
        "cancelled", "cancelled by request", 1, None)
    step = driver._step(settings, look.run, look.ready, look.waiting, "splitter")  # the split ends
    assert step.outcome == Outcome.LOST and job_count(url) == 0
    assert run_row(url, run_id).status == "cancelled"


def test_the_first_step_holds_a_short_lease_renewed_as_it_splits_and_stops_once_it_is_taken_over(settings, principal,
                                                                                                   monkeypatch):
    """The first step held a 600 s lease while it split, so a run whose splitter died stayed validating ten minutes:
    it holds lease_seconds, renewed as the split goes on, and the renewal that finds the lease taken over stops the
    split at once, writing nothing."""
    from app.summarize import split
    from app.summarize.split import TokenSplitter

    url = settings.sqlalchemy_url
    run_id = service.create_run(settings, principal, [Document("long", LONG)], utcnow() + timedelta(hours=1),
                                max_summary_tokens=12, chunk_tokens=120, overlap_tokens=8, tier="paid").id
    clock = [0.0]
    monkeypatch.setattr(lease.LeaseKeeper, "clock", staticmethod(lambda: clock[0]))
    monkeypatch.setattr(split, "COUNT_BATCH", 1)  # a tokenizer call a sentence
    expiries, real_init = [], TokenSplitter.__init__

    def measuring(tokenizer):
        def measure(*args, **kwargs):  # each tokenizer call takes a third of the lease
            expiries.append(as_utc(run_row(url, run_id).lease_expires_at))
            clock[0] += settings.lease_seconds / 3
            if len(expiries) == 5:  # the step seems dead: a cancel or a sweeper takes its lease over
                assert lease.take_over(url, run_row(url, run_id), "other", settings.lease_seconds)
            return tokenizer(*args, **kwargs)
        return measure

    monkeypatch.setattr(TokenSplitter, "__init__",
                        lambda self, tok, *a, **kw: real_init(self, measuring(tok), *a, **kw))
    claimed_at = utcnow()
    assert driver.advance(settings, run_id, "splitter") == driver.Step(Outcome.LOST, "running")
    assert expiries[0] <= claimed_at + timedelta(seconds=settings.lease_seconds + 5)  # not 600 s
    assert expiries[0] < expiries[1] < expiries[2] < expiries[3]  # renewed as the split went on
    assert len(expiries) == 5  # it stopped at the renewal after the take-over: not the 60 sentences
    run = run_row(url, run_id)
    assert (run.status, run.version, run.lease_owner, job_count(url)) == ("validating", 0, "other", 0)


def test_a_step_renews_its_lease_between_the_jobs_it_builds_and_stops_once_it_is_taken_over(settings, principal,
                                                                                              monkeypatch):
    """A document of thousands of chunks builds a job each (its prompt templated and counted) after its split: the
    lease is renewed there too, and the step stops at the renewal after a take-over, not after the last job."""
    url = settings.sqlalchemy_url
    run_id = service.create_run(settings, principal, [Document("long", LONG)], utcnow() + timedelta(hours=1),
                                max_summary_tokens=12, chunk_tokens=120, overlap_tokens=8, tier="paid").id
    clock, built, real_values = [0.0], [], driver.job_values
    monkeypatch.setattr(lease.LeaseKeeper, "clock", staticmethod(lambda: clock[0]))

    def job_values(*args, **kwargs):  # each job built takes a third of the lease
        built.append(1)
        clock[0] += settings.lease_seconds / 3
        if len(built) == 2:
            assert lease.take_over(url, run_row(url, run_id), "other", settings.lease_seconds)
        return real_values(*args, **kwargs)

    monkeypatch.setattr(driver, "job_values", job_values)
    assert driver.advance(settings, run_id, "splitter") == driver.Step(Outcome.LOST, "running")
    assert len(built) == 2 and job_count(url) == 0  # LONG makes more than 3 chunks: it stopped at the third


def test_a_step_happens_once_however_often_it_is_asked(settings, principal):
    url = settings.sqlalchemy_url
    run_id = start(settings, principal)
    first_level = job_count(url)
    finish_jobs(url)
    step = driver.advance(settings, run_id, "p1")
    assert step.outcome == Outcome.STEPPED and len(step.submitted) >= 1
    after = job_count(url)
    assert after == first_level + len(step.submitted)
    for owner in ("p1", "p2", "p1"):  # the same results again: nothing new to do
        assert driver.advance(settings, run_id, owner).outcome == Outcome.IDLE
    assert job_count(url) == after
    run = run_row(url, run_id)
    assert run.version == 2 and run.lease_owner is None and run.documents_done == 1  # "short" is summarized
    while finish_jobs(url):
        driver.advance(settings, run_id, "p2")
    run = run_row(url, run_id)
    assert (run.status, run.documents_done, run.documents_failed) == ("completed", 2, 0)
    assert run.jobs_submitted == run.jobs_done == job_count(url) and run.finished_at is not None
    view = service.view(settings, run_id, with_results=True)
    lines = view.results.decode().splitlines()
    assert [line.split('"id": ')[1].split(",")[0] for line in lines] == ['"long"', '"short"']
    assert view.progress.as_dict()["status"] == "completed"


def test_a_held_lease_keeps_others_out_until_it_expires(settings, principal):
    url = settings.sqlalchemy_url
    run_id = start(settings, principal)
    finish_jobs(url)
    run = run_row(url, run_id)
    assert lease.claim(url, run, "dead-api", lease_s=0.3)  # a process claimed the step, then was killed
    assert driver.advance(settings, run_id, "worker").outcome == Outcome.BUSY
    assert driver.advance_open_runs(settings, "worker") == []  # the sweeper does not even look
    with session_scope(url) as s:  # its lease runs out
        s.execute(update(SummarizationRun).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    step = driver.advance(settings, run_id, "worker")
    assert step.outcome == Outcome.STEPPED and step.submitted
    assert run_row(url, run_id).lease_owner is None


def test_a_step_whose_lease_was_taken_over_commits_nothing(settings, principal, monkeypatch):
    url = settings.sqlalchemy_url
    run_id = start(settings, principal)
    finish_jobs(url)
    before = job_count(url)
    real = driver.planner_for

    def slow_planner(settings_, run, backend, *deadline):
        # mid-step, the lease expires and another process takes it over
        with session_scope(url) as s:
            s.execute(update(SummarizationRun).values(lease_owner="other", lease_expires_at=utcnow()))
        return real(settings_, run, backend, *deadline)

    monkeypatch.setattr(driver, "planner_for", slow_planner)
    assert driver.advance(settings, run_id, "p1") == driver.Step(Outcome.LOST, "running")
    monkeypatch.setattr(driver, "planner_for", real)
    assert job_count(url) == before  # the jobs it built were never written
    assert run_row(url, run_id).version == 1  # its first step's
    step = driver.advance(settings, run_id, "p2")  # the lease of "other" has expired: p2 redoes the step
    assert step.outcome == Outcome.STEPPED and job_count(url) == before + len(step.submitted)


def test_concurrent_drivers_submit_each_job_once(settings, principal):
    url = settings.sqlalchemy_url
    docs = [Document(f"d{i}", LONG if i % 2 else f"Short document {i}. It ends here.") for i in range(6)]
    run_id = start(settings, principal, docs)
    outcomes = drive_concurrently(settings, run_id)
    run = run_row(url, run_id)
    assert run.status == "completed" and run.documents_done == 6, outcomes[-5:]
    with session_scope(url) as s:
        per_doc = s.scalars(select(SummarizationDocument.jobs)).all()
    assert job_count(url) == run.jobs_submitted == run.jobs_done == sum(per_doc)
    assert Outcome.STEPPED in outcomes


def test_failed_jobs_fail_their_document_and_a_pipeline_error_fails_the_run(settings, principal, monkeypatch):
    url = settings.sqlalchemy_url
    settings.summarize_job_retries = 0
    run_id = start(settings, principal, [Document("a", "One short document.")])
    finish_jobs(url, status="failed")
    assert driver.advance(settings, run_id, "p1").status == "failed"  # no document has a summary
    assert run_row(url, run_id).documents_failed == 1
    assert run_row(url, run_id).reason == "no document was summarized: each result line's error says why"
    assert "1 job(s) failed" in service.view(settings, run_id, with_results=True).results.decode()
    assert "not retried: retries are off" in service.view(settings, run_id, with_results=True).results.decode()

    run_id = start(settings, principal)
    finish_jobs(url)

    def broken(*_a, **_kw):
        raise ValueError("no tokenizer today")

    monkeypatch.setattr(driver, "planner_for", broken)
    assert driver.advance(settings, run_id, "p1") == driver.Step(Outcome.STEPPED, "failed")
    run = run_row(url, run_id)
    assert (run.documents_done, run.documents_failed, run.lease_owner) == (2, 2, None)
    assert run.reason == "pipeline error: no tokenizer today"
    lines = service.view(settings, run_id, with_results=True).results.decode().splitlines()
    assert {json.loads(line)["error"] for line in lines} == {driver.RUN_FAILED}  # it points to the reason


def test_a_cancel_that_dies_partway_leaves_its_jobs_to_the_sweeper(settings, principal, monkeypatch):
    url = settings.sqlalchemy_url
    run_id = start(settings, principal, [Document(f"d{i}", LONG) for i in range(3)])
    real_stop = driver.stop_job_ids

    def stop_two_then_die(session, ids, *args):
        real_stop(session, ids[:2], *args)
        raise ConnectionError("the API went away mid-cancel")

    monkeypatch.setattr(driver, "stop_job_ids", stop_two_then_die)
    with pytest.raises(ConnectionError):
        driver.cancel(settings, run_id, "api")
    run = run_row(url, run_id)
    assert (run.status, run.documents_failed) == ("cancelling", 3)  # still naming the jobs left to stop
    with session_scope(url) as s:
        assert s.scalar(select(func.count()).select_from(Job).where(Job.status == "queued")) > 0
    monkeypatch.setattr(driver, "stop_job_ids", real_stop)
    driver.advance_open_runs(settings, "worker")
    with session_scope(url) as s:
        statuses = set(s.scalars(select(Job.status)).all())
        pending = s.scalars(select(SummarizationDocument.pending)).all()
    assert statuses == {"cancelled"} and all(p == [] for p in pending)
    assert (run_row(url, run_id).status, run_row(url, run_id).lease_owner) == ("cancelled", None)
    assert not driver.cancel(settings, run_id, "api")  # it had ended


def test_a_later_level_past_the_runs_deadline_gets_a_fresh_window_not_an_expired_one(settings, principal):
    url = settings.sqlalchemy_url
    run_id = start(settings, principal)
    with session_scope(url) as s:
        deadline = s.get(SummarizationRun, run_id).deadline_at
        assert set(s.scalars(select(Job.deadline_at)).all()) == {deadline}  # the first level: the run's deadline
        s.execute(update(SummarizationRun).values(deadline_at=utcnow() - timedelta(minutes=5)))  # the run overran
    finish_jobs(url)
    step = driver.advance(settings, run_id, "p1")
    assert step.outcome == Outcome.STEPPED and step.submitted
    with session_scope(url) as s:
        later = s.scalars(select(Job.deadline_at).where(Job.id.in_(step.submitted))).all()
    fresh = utcnow() + timedelta(seconds=settings.default_batch_window_s)
    assert all(abs((as_utc(d) - fresh).total_seconds()) < 120 for d in later), (later, fresh)


def test_a_run_started_under_a_minute_from_its_deadline_gives_its_first_level_that_deadline(settings, principal):
    # a deadline of 30 s is the user's to give: the fresh window is for levels begun after the run overran it
    progress = service.start_run(settings, principal, [Document("short", "The cat sat on the mat. It was warm.")],
                                 utcnow() + timedelta(seconds=30), max_summary_tokens=12, chunk_tokens=120,
                                 overlap_tokens=8, tier="paid")
    assert progress.status == "running" and progress.jobs_submitted == 1
    with session_scope(settings.sqlalchemy_url) as s:
        deadline = s.get(SummarizationRun, progress.id).deadline_at
        assert s.scalars(select(Job.deadline_at)).all() == [deadline]


def test_the_sweeper_steps_only_its_models_runs(settings, principal):
    url = settings.sqlalchemy_url
    run_id = start(settings, principal)
    finish_jobs(url)
    other = settings.model_copy(update={"model_name": "another-model"})
    assert driver.advance_open_runs(other, "w-other") == []
    steps = driver.advance_open_runs(settings, "w1")
    assert [s.outcome for s in steps] == [Outcome.STEPPED]
    assert run_row(url, run_id).version == 2


def test_the_sweeper_reaches_a_newer_run_while_more_older_ones_wait_than_one_sweep_takes(settings, principal):
    url = settings.sqlalchemy_url
    waiting = [start(settings, principal, [Document(f"d{i}", "The cat sat.")]) for i in range(3)]
    newest = start(settings, principal, [Document("new", "The dog ran.")])
    with session_scope(url, immediate=True) as s, write_guard(s):  # only the newest run's job ended
        last = s.scalar(select(Job.id).order_by(Job.created_at.desc()).limit(1))
        s.execute(update(Job).where(Job.id == last).values(status="succeeded", output_text="A dog.",
                                                           finished_at=utcnow()))
    for _ in range(60):  # a sweep of one run at a time: before, always the oldest, which waits on its job
        if any(step.outcome is Outcome.STEPPED for step in driver.advance_open_runs(settings, "w1", limit=1)):
            break
    assert run_row(url, newest).status == "completed"
    assert {run_row(url, r).status for r in waiting} == {"running"}


def test_a_run_on_a_lora_adapter_names_it_in_every_job_and_its_models_workers_step_it(settings, principal):
    url = settings.sqlalchemy_url
    settings.lora_modules = {"summary-lora": "/adapters/summary"}
    progress = service.start_run(settings, principal, [Document("long", LONG)], utcnow() + timedelta(hours=1),
                                 max_summary_tokens=12, chunk_tokens=120, overlap_tokens=8, tier="paid",
                                 model="summary-lora")
    assert progress.as_dict()["model"] == "summary-lora"
    with session_scope(url) as s:
        assert set(s.scalars(select(Job.model))) == {"summary-lora"}
    finish_jobs(url)
    assert [s.outcome for s in driver.advance_open_runs(settings, "w1")] == [Outcome.STEPPED]
    with session_scope(url) as s:  # the next level's jobs too
        assert set(s.scalars(select(Job.model))) == {"summary-lora"} and s.scalar(select(func.count(Job.id))) > 1


def test_a_run_on_a_runtime_adapter_unloaded_since_still_ends(settings, principal, tmp_path):
    """An admin unloads the runtime adapter a run names: the workers fail its jobs, and the sweeper still steps
    the run (its jobs cannot be built again), so it ends instead of running for good."""
    from app.services import lora_adapters

    url = settings.sqlalchemy_url
    load_runtime_adapter(settings, tmp_path)
    progress = service.start_run(settings, principal, [Document("long", LONG)], utcnow() + timedelta(hours=1),
                                 max_summary_tokens=12, chunk_tokens=120, overlap_tokens=8, tier="paid",
                                 model="rt-lora")
    lora_adapters.unload(settings, "rt-lora")
    finish_jobs(url, "failed")  # as a worker does: the adapter was unloaded before they began
    settings.summarize_retry_backoff_s = 0  # their retries go at once: they cannot be built either
    assert [s.outcome for s in driver.advance_open_runs(settings, "w1")] == [Outcome.STEPPED]
    assert run_row(url, progress.id).status == "failed"


def end_jobs(url: str, ids, status: str, error: str | None = None, code: str | None = None) -> None:
    with session_scope(url, immediate=True) as s, write_guard(s):
        s.execute(update(Job).where(Job.id.in_(list(ids))).values(
            status=status, error=error, error_code=code, output_text="Summary." if status == "succeeded" else None,
            finished_at=utcnow()))


def doc_row(url: str, run_id: str, position: int = 0) -> SummarizationDocument:
    with session_scope(url) as s:
        return s.get(SummarizationDocument, (run_id, position))


def test_a_failed_map_job_is_submitted_again_after_its_backoff_and_its_document_goes_on(settings, principal):
    url = settings.sqlalchemy_url
    settings.summarize_retry_backoff_s = 3600.0  # the test moves the backoff's end itself
    run_id = start(settings, principal, [Document("long", LONG)])
    first = doc_row(url, run_id).pending
    assert len(first) > 2
    end_jobs(url, first[1:], "succeeded")
    end_jobs(url, first[:1], "failed", "engine error (gave up after 5 attempts)")
    assert driver.advance(settings, run_id, "p1") == driver.Step(Outcome.STEPPED, "running")  # backoff set
    doc = doc_row(url, run_id)
    assert doc.pending == first and not doc.done and doc.retry_at is not None
    assert driver.advance(settings, run_id, "p1").outcome == Outcome.IDLE  # waiting: no step, no write
    version = run_row(url, run_id).version
    with session_scope(url) as s:
        s.execute(update(SummarizationDocument).values(retry_at=utcnow() - timedelta(seconds=1)))
    step = driver.advance(settings, run_id, "p2")
    assert step.outcome == Outcome.STEPPED and len(step.submitted) == 1 and run_row(url, run_id).version == version + 1
    doc = doc_row(url, run_id)
    assert doc.pending == [step.submitted[0], *first[1:]] and doc.attempts == [1] + [0] * (len(first) - 1)
    assert (doc.retries, doc.retry_at, doc.jobs) == (1, None, len(first) + 1)
    assert doc.retry_errors == ["level 1 chunk 1: failed: engine error (gave up after 5 attempts)"]
    with session_scope(url) as s:  # the same chunk's prompt again
        jobs = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_([first[0], step.submitted[0]])))}
    assert jobs[step.submitted[0]].messages == jobs[first[0]].messages
    end_jobs(url, step.submitted, "succeeded")
    while finish_jobs(url) or driver.advance(settings, run_id, "p1").outcome == Outcome.STEPPED:
        pass
    run = run_row(url, run_id)
    assert (run.status, run.documents_failed) == ("completed", 0) and run.jobs_submitted == job_count(url)
    line = json.loads(service.view(settings, run_id, with_results=True).results)
    assert line["summary"] and line["retries"] == 1 and line["retry_errors"] == doc.retry_errors


def test_jobs_done_counts_each_ended_job_while_its_level_goes_on(settings, principal):
    url = settings.sqlalchemy_url
    run_id = start(settings, principal, [Document("long", LONG)])
    pending = doc_row(url, run_id).pending
    assert service.view(settings, run_id).progress.jobs_done == 0
    end_jobs(url, pending[:2], "succeeded")
    progress = service.view(settings, run_id).progress
    assert (progress.jobs_submitted, progress.jobs_done) == (len(pending), 2)  # was 0 until the whole level ended
    assert driver.advance(settings, run_id, "p1").outcome == Outcome.IDLE
    end_jobs(url, pending[2:], "succeeded")
    step = driver.advance(settings, run_id, "p1")
    run = run_row(url, run_id)
    assert run.jobs_done == len(pending) and run.jobs_submitted == len(pending) + len(step.submitted)


class JobReads:
    """The job ids this thread's SQL statements bind while it is open (each a job whose row a statement reads)."""

    def __enter__(self) -> list[str]:
        from sqlalchemy import event
        from sqlalchemy.engine import Engine

        self.ids: list[str] = []
        me = threading.get_ident()

        def count(conn, cursor, statement, parameters, context, executemany):
            if threading.get_ident() == me and "FROM jobs" in statement:
                values = parameters.values() if isinstance(parameters, dict) else parameters or ()
                self.ids += [v for v in values if isinstance(v, str) and v.startswith("job_")]

        self.listener, self.engine_cls = count, Engine
        event.listen(Engine, "before_cursor_execute", count)
        return self.ids

    def __exit__(self, *exc) -> None:
        from sqlalchemy import event

        event.remove(self.engine_cls, "before_cursor_execute", self.listener)


def test_a_look_reads_one_job_of_a_waiting_document_and_no_job_twice_once_ended(settings, principal):
    """A document is ready once all its jobs ended: while its first one runs, the others need not be read (a look
    read every pending job's status, each time)."""
    url = settings.sqlalchemy_url
    run_id = start(settings, principal, [Document("long", LONG), Document("short", "The cat sat. It was warm.")])
    long, short = doc_row(url, run_id, 0).pending, doc_row(url, run_id, 1).pending
    assert len(long) >= 3
    with JobReads() as read:
        assert driver.advance(settings, run_id, "p1").outcome == Outcome.IDLE
    assert sorted(read) == sorted([long[0], *short])
    memo = driver.LookMemo()  # a driver that keeps looking (the API's thread) remembers what it read
    end_jobs(url, long[:2], "succeeded")
    with JobReads() as read:
        assert driver.advance(settings, run_id, "p1", memo=memo).outcome == Outcome.IDLE
    assert sorted(read) == sorted([long[0], *short, *long[1:]])  # its first ended: the rest of it once
    with JobReads() as read:
        assert driver.advance(settings, run_id, "p1", memo=memo).outcome == Outcome.IDLE
    assert sorted(read) == sorted([long[2], *short])  # the first it has not seen ended, each
    end_jobs(url, [*long[2:], *short], "succeeded")
    step = driver.advance(settings, run_id, "p1", memo=memo)
    assert step.outcome == Outcome.STEPPED and step.submitted
    assert run_row(url, run_id).documents_done == 1  # "short"; "long" goes on to its next level
    with JobReads() as read:  # a new version: the documents are read again, and the new level's first job
        assert driver.advance(settings, run_id, "p1", memo=memo).outcome == Outcome.IDLE
    assert read == [doc_row(url, run_id, 0).pending[0]]


class Statements:
    """This thread's SQL statements while it is open, and the job ids they bind."""

    def __enter__(self):
        from sqlalchemy import event
        from sqlalchemy.engine import Engine

        self.sql, self.params, self.job_ids, me = [], [], [], threading.get_ident()

        def count(conn, cursor, statement, parameters, context, executemany):
            if threading.get_ident() == me:
                self.sql.append(statement)
                self.params.append(parameters)
                values = parameters.values() if isinstance(parameters, dict) else parameters or ()
                self.job_ids += [v for v in values if isinstance(v, str) and v.startswith("job_")]

        self.listener, self.engine_cls = count, Engine
        event.listen(Engine, "before_cursor_execute", count)
        return self

    def __exit__(self, *exc) -> None:
        from sqlalchemy import event

        event.remove(self.engine_cls, "before_cursor_execute", self.listener)


def test_a_poll_counts_the_runs_open_jobs_in_one_statement_whatever_its_size(settings, principal):
    """A poll (GET /v1/summarize/{id}, the runs listing) read the status of every job the run's documents waited
    for, in IN lists of 500: one count on the jobs' run index now, right as the jobs end and once the run ended."""
    url = settings.sqlalchemy_url
    run_id = start(settings, principal, [Document(f"d{i}", LONG) for i in range(4)])
    pending = [j for p in range(4) for j in doc_row(url, run_id, p).pending]
    assert len(pending) >= 12
    end_jobs(url, pending[:5], "succeeded")
    end_jobs(url, pending[5:6], "cancelled")  # not retried: its document fails
    with Statements() as polled:
        progress = service.view(settings, run_id).progress
    assert (progress.status, progress.jobs_submitted, progress.jobs_done) == ("running", len(pending), 6)
    selects = [(q, p) for q, p in zip(polled.sql, polled.params) if q != "BEGIN"]
    assert polled.job_ids == [] and len(selects) == 2  # the run, then one count of its jobs, on their index:
    with session_scope(url) as s:
        plan = query_plan(s.connection(), *selects[1])
    assert "ix_jobs_summarization_run_status" in plan, plan
    with session_scope(url) as s, Statements() as listed:  # the runs listing: a count per run on the page
        run = s.get(SummarizationRun, run_id)
        assert store.progress_of(run, s).jobs_done == 6
    assert listed.job_ids == [] and sum("FROM jobs" in q for q in listed.sql) == 1
    while finish_jobs(url):
        driver.advance(settings, run_id, "p1")
    with Statements() as polled:
        progress = service.view(settings, run_id).progress
    run = run_row(url, run_id)
    assert (progress.status, progress.jobs_done, run.documents_failed) == (run.status, run.jobs_submitted, 1)
    assert run.status not in store.OPEN
    assert not any("FROM jobs" in q for q in polled.sql)  # an ended run counts none


def test_a_disabled_tenants_run_ends_cancelled_naming_why(settings, principal):
    from app.db.models import Tenant

    url = settings.sqlalchemy_url
    swept, disabled = start(settings, principal), start(settings, principal, [Document("a", "The cat sat.")])
    with session_scope(url) as s:
        s.execute(update(Tenant).where(Tenant.id == principal.tenant_id).values(disabled=True))
    assert service.cancel_tenant_runs(settings, principal.tenant_id) == 2
    for run_id in (swept, disabled):
        progress = service.view(settings, run_id).progress.as_dict()
        assert (progress["status"], progress["reason"]) == ("cancelled", "cancelled: its tenant was disabled by an "
                                                                          "admin"), progress
        assert progress["jobs_done"] == progress["jobs_submitted"]
    with session_scope(url) as s:
        assert set(s.scalars(select(Job.status))) == {"cancelled"}
        assert set(s.scalars(select(SummarizationDocument.error))) == {"cancelled: its tenant was disabled"}
    # one the disable missed (it was being stepped): the next step finds the tenant disabled and cancels it
    missed = service.create_run(settings, principal, [Document("a", "The cat sat.")], utcnow() + timedelta(hours=1),
                                max_summary_tokens=12, chunk_tokens=120, overlap_tokens=8, tier="paid").id
    assert driver.advance(settings, missed, "worker") == driver.Step(Outcome.STEPPED, "cancelled")
    assert run_row(url, missed).reason == "cancelled: its tenant was disabled by an admin"


def test_runs_an_older_version_kept_in_files_are_still_read(settings):
    folder = settings.data_dir / "summaries"
    folder.mkdir()
    state = {"tenant_id": "ten_1", "id": "sum_old", "object": "summarization", "status": "completed",
             "deadline_at": "2030-01-01T00:00:00+00:00", "documents": 1, "documents_done": 1, "documents_failed": 0,
             "jobs_submitted": 1, "jobs_done": 1}
    (folder / "sum_old.json").write_text(json.dumps(state))
    (folder / "sum_old.jsonl").write_text('{"id": "a", "summary": "S."}\n')
    view = service.view(settings, "sum_old", with_results=True)
    kept = {k: v for k, v in state.items() if k != "tenant_id"}
    assert view.tenant_id == "ten_1" and view.progress.as_dict() == {**kept, "model": None, "reason": None,
                                                                     "deadline_at": "2030-01-01T00:00:00Z"}
    assert view.results == b'{"id": "a", "summary": "S."}\n'
    assert service.view(settings, "sum_nope") is None


def test_a_sentence_cut_by_tokens_keeps_every_character_whole(settings):
    """Chinese has no '. ' to cut at, and a character spans several byte-level tokens: each window is cut where its
    first token starts in the text (decoding each window alone garbled the characters at the cuts)."""
    from app.services.model_info import get_tokenizer
    from app.summarize.split import TokenSplitter

    text = "这是一个关于猫的故事它很温暖" * 40
    split = TokenSplitter(get_tokenizer(settings.model), 100, 8)
    chunks = split(text)
    assert len(chunks) > 5 and all(split.count(c) <= 100 for c in chunks)
    assert all(c in text and "\ufffd" not in c for c in chunks)
    assert text.startswith(chunks[0]) and text.endswith(chunks[-1])


def statuses(url: str) -> dict[str, int]:
    with session_scope(url) as s:
        return dict(s.execute(select(Job.status, func.count()).group_by(Job.status)).all())


def after_each_chunk(monkeypatch, hook: Callable[[], None]) -> None:
    """``hook()`` after each chunk of staged jobs is committed (``job_writer.write_staged``), on SQLite before the
    write lock is let go, on PostgreSQL (which lets none go) before the next chunk."""
    real = job_writer.read_then_write

    @contextmanager
    def chunk_then_hook(url: str):
        with real(url) as s:
            yield s
        hook()

    monkeypatch.setattr(job_writer, "read_then_write", chunk_then_hook)


def test_a_step_of_many_jobs_writes_them_in_chunks_others_writing_in_between_and_starts_them_at_once(
        settings, principal, monkeypatch):
    """The first step wrote all its jobs and their events in one transaction (2,400 jobs of an 8 MB run held
    SQLite's write lock 1-2 s): it stages them a chunk a transaction, lets go of the lock between chunks, and its
    commit makes them all runnable together."""
    url = settings.sqlalchemy_url
    monkeypatch.setattr(store, "STAGE_CHUNK", 2)
    run_id = service.create_run(settings, principal, [Document("long", LONG)], utcnow() + timedelta(hours=1),
                                max_summary_tokens=12, chunk_tokens=120, overlap_tokens=8, tier="paid").id
    seen = []

    def others_write():  # between two chunks another writer commits, and nothing staged is runnable yet
        with session_scope(url, immediate=True) as s, write_guard(s):
            s.execute(update(SummarizationRun).where(SummarizationRun.id != run_id).values(reason="x"))
        seen.append(statuses(url))

    after_each_chunk(monkeypatch, others_write)
    step = driver.advance(settings, run_id, "api")
    assert (step.outcome, step.status) == (Outcome.STEPPED, "running") and len(step.submitted) > 4
    assert len(seen) == (len(step.submitted) - 1) // 2  # every chunk but the last (written with the commit)
    assert all(set(s) == {next(iter(s))} and next(iter(s)).startswith("staged-") for s in seen), seen
    assert [sum(s.values()) for s in seen] == [2 * (i + 1) for i in range(len(seen))]
    assert statuses(url) == {"queued": len(step.submitted)}
    with session_scope(url) as s:
        assert s.scalar(select(func.count()).select_from(JobEvent)) == len(step.submitted)
    assert run_row(url, run_id).jobs_submitted == len(step.submitted)


class Killed(BaseException):
    """The process died (not an error the step handles)."""


def test_a_first_step_that_dies_midway_through_its_chunks_is_redone_whole_by_the_next_holder(settings, principal,
                                                                                             monkeypatch, redis_url):
    """A step that dies after writing some chunks leaves them staged (no worker or sweeper takes them), the run as
    it was; the process that takes the lease over once it lapses writes the level again and deletes them, so each
    chunk has one job; a cancel of a run left so deletes them too."""
    from workers.sweeper import sweep

    url = settings.sqlalchemy_url
    monkeypatch.setattr(store, "STAGE_CHUNK", 2)
    real_chunk = job_writer.read_then_write
    chunks = count(1)

    def die_after_two_chunks():  # each run's step dies after its second chunk
        if next(chunks) % 2 == 0:
            raise Killed

    after_each_chunk(monkeypatch, die_after_two_chunks)
    docs = [Document("long", LONG), Document("other", LONG.replace("Fact", "Claim"))]
    options = {"max_summary_tokens": 12, "chunk_tokens": 120, "overlap_tokens": 8, "tier": "paid"}
    runs = [service.create_run(settings, principal, docs, utcnow() + timedelta(hours=1), **options).id
            for _ in range(2)]
    for run_id in runs:
        with pytest.raises(Killed):
            driver.advance(settings, run_id, "dead-api")
        with session_scope(url) as s:  # its lease lapses (a killed process gives nothing back)
            s.execute(update(SummarizationRun).where(SummarizationRun.id == run_id)
                      .values(lease_owner="dead-api", lease_expires_at=utcnow() - timedelta(seconds=1)))
        run = run_row(url, run_id)
        assert (run.status, run.version, run.jobs_submitted) == ("validating", 0, 0)
    left = statuses(url)
    assert sum(left.values()) == 8 and all(s.startswith("staged-") for s in left), left  # two chunks each
    with session_scope(url) as s:
        assert sweep(s, redis_url, queued_grace_s=0).dispatched == 0  # nothing staged is sent to a worker
    monkeypatch.setattr(job_writer, "read_then_write", real_chunk)

    step = driver.advance(settings, runs[0], "worker")  # the sweeper's take-over
    assert (step.outcome, step.status) == (Outcome.STEPPED, "running")
    with session_scope(url) as s:
        named = [j for p in s.scalars(select(SummarizationDocument.pending).where(
            SummarizationDocument.run_id == runs[0])) for j in p]
        mine = s.scalars(select(Job.id).where(Job.summarization_run_id == runs[0])).all()
        events = s.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.job_id.in_(mine)))
    assert sorted(mine) == sorted(named) == sorted(step.submitted) and events == len(mine)
    assert run_row(url, runs[0]).jobs_submitted == len(mine)
    now = statuses(url)
    assert now.pop("queued") == len(mine) and sum(now.values()) == 4  # the other run's are still staged

    assert service.cancel(settings, runs[1])  # cancelled while validating: its dead step's rows go too
    assert run_row(url, runs[1]).status == "cancelled"
    assert statuses(url) == {"queued": len(mine)}


def test_a_failed_documents_jobs_are_not_counted_open_while_the_others_go_on(settings, principal):
    """``open_job_count`` (what a poll's ``jobs_done`` is counted from) counts the jobs the documents still wait for:
    a document fails only once every job of its level ended, so none of a failed document's jobs is among them."""
    url = settings.sqlalchemy_url
    settings.summarize_job_retries = 0
    run_id = start(settings, principal, [Document("long", LONG), Document("bad", "A short one. It fails.")])
    long_jobs, bad_jobs = doc_row(url, run_id, 0).pending, doc_row(url, run_id, 1).pending
    end_jobs(url, bad_jobs, "failed", error="engine error")
    end_jobs(url, long_jobs[:1], "succeeded")
    assert driver.advance(settings, run_id, "p1").outcome == Outcome.STEPPED
    assert doc_row(url, run_id, 1).error is not None and doc_row(url, run_id, 0).error is None
    with session_scope(url) as s:
        run = s.get(SummarizationRun, run_id)
        assert store.open_job_count(s, run) == len(long_jobs) - 1
    progress = service.view(settings, run_id).progress
    assert (progress.documents_done, progress.documents_failed) == (1, 1)
    assert progress.jobs_done == progress.jobs_submitted - (len(long_jobs) - 1) == 2


def job_prompts(url: str, ids) -> list[tuple[list, int]]:
    with session_scope(url) as s:
        return [(j.messages, j.prompt_tokens) for j in s.scalars(select(Job).where(Job.id.in_(list(ids))))]


def test_a_levels_prompts_are_counted_together_each_as_build_job_counts_it_alone(settings, principal, monkeypatch):
    """build_job tokenized each job's prompt alone through the chat template (2,400 tokenizer calls for an 8 MB
    run's first level, over half its first step): a level's prompts are counted in one call now, and each job row's
    ``prompt_tokens`` is what counting its prompt alone gives."""
    from app.services import jobs as job_service
    from app.services.model_info import encode_input

    url, alone = settings.sqlalchemy_url, []
    real_fed = job_service.fed_prompt
    monkeypatch.setattr(job_service, "fed_prompt", lambda *a, **kw: alone.append(1) or real_fed(*a, **kw))
    odd = " ".join(f"Fait {i}: 猫は温かい 🐈 — \"quoted\"  spaced\ttab ok." for i in range(40))
    run_id = start(settings, principal, [Document("long", LONG), Document("odd", odd), Document("short", "Hi.")])
    first = [j for p in range(3) for j in doc_row(url, run_id, p).pending]
    assert len(first) > 6 and alone == []
    finish_jobs(url)
    later = driver.advance(settings, run_id, "p1").submitted  # the reduce level's prompts: summaries joined
    assert later and alone == []
    for messages, prompt_tokens in job_prompts(url, first + list(later)):
        assert prompt_tokens == len(encode_input(settings.model, None, messages))


def test_token_counts_are_the_tokenizers_own_counts(settings):
    from app.services.model_info import count_inputs, encode_input, get_tokenizer, token_counts

    tok = get_tokenizer(settings.model)
    texts = ["", " leading space", "trailing  ", "猫は温かい 🐈", "a\n\nb", "<|im_end|> special"]
    assert token_counts(tok, texts) == [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    conversations = [[{"role": "user", "content": t}] for t in texts]
    assert count_inputs(settings.model, conversations) == [len(encode_input(settings.model, None, c))
                                                           for c in conversations]


def test_a_run_failed_at_a_later_level_stops_the_jobs_it_left_and_counts_them_done(settings, principal,
                                                                                     monkeypatch):
    """A run failed as a whole (a pipeline error) left its running jobs to finish on the GPU for nobody, its
    ``jobs_done`` short of ``jobs_submitted`` until they did: they are cancelled as the run fails, and its
    ``jobs_done`` is ``jobs_submitted`` at once; the jobs that had ended keep their results."""
    url = settings.sqlalchemy_url
    run_id = start(settings, principal, [Document("long", LONG), Document("other", LONG)])
    done_first, still = doc_row(url, run_id, 0).pending, doc_row(url, run_id, 1).pending
    end_jobs(url, done_first, "succeeded")
    monkeypatch.setattr(driver, "planner_for", lambda *_a, **_kw: (_ for _ in ()).throw(ValueError("no tokenizer")))
    assert driver.advance(settings, run_id, "p1") == driver.Step(Outcome.STEPPED, "failed")
    progress = service.view(settings, run_id).progress
    assert (progress.status, progress.jobs_submitted) == ("failed", len(done_first) + len(still))
    assert progress.jobs_done == progress.jobs_submitted
    with session_scope(url) as s:  # the runs listing and the admin dashboard count alike
        assert store.progress_of(s.get(SummarizationRun, run_id), s).jobs_done == progress.jobs_submitted
        assert {s.get(Job, j).status for j in still} == {"cancelled"}
        assert {s.get(Job, j).status for j in done_first} == {"succeeded"}
        assert s.get(SummarizationRun, run_id).lease_owner is None
    assert driver.finish_cancels(settings, "sweeper") == []  # nothing left for a worker's sweeper to stop


def test_token_counts_of_a_tokenizer_that_truncates_by_itself_are_whole(settings):
    """A tokenizer file may set truncation, which ``tok(texts)`` turns off: the fast path, which calls the Rust
    tokenizer directly, is not taken then, so no count is cut."""
    import copy

    from app.services.model_info import get_tokenizer, token_counts

    tok = copy.deepcopy(get_tokenizer(settings.model))
    text = "Fact number one is about the topic of the document. " * 4
    whole = token_counts(tok, [text])
    tok.backend_tokenizer.enable_truncation(max_length=3)
    assert whole[0] > 3 and token_counts(tok, [text]) == whole


def written_rows(url: str) -> tuple[list[dict], list[dict]]:
    """Every job row and job event row, as the database holds them (events without their own serial id)."""
    with session_scope(url) as s:
        jobs = [dict(r) for r in s.execute(select(Job.__table__).order_by(Job.id)).mappings()]
        events = [{k: v for k, v in r.items() if k != "id"} for r in s.execute(
            select(JobEvent.__table__).order_by(JobEvent.job_id, JobEvent.id)).mappings()]
    return jobs, events


def test_a_step_builds_no_orm_job_for_each_of_its_jobs(settings, principal):
    from sqlalchemy import event

    built = []
    listener = lambda target, args, kwargs: built.append(target)  # noqa: E731 - an ORM Job constructed
    run_id = service.create_run(settings, principal, [Document("long", LONG)], utcnow() + timedelta(hours=1),
                                max_summary_tokens=12, chunk_tokens=120, overlap_tokens=8, tier="paid").id
    event.listen(Job, "init", listener)
    try:
        step = driver.advance(settings, run_id, "api")
    finally:
        event.remove(Job, "init", listener)
    assert step.outcome == Outcome.STEPPED and statuses(settings.sqlalchemy_url) == {"queued": len(step.submitted)}
    assert len(step.submitted) > 2 and built == []  # its rows are the jobs' column values (jobs.job_values)


def test_a_steps_jobs_are_written_as_the_orm_jobs_build_job_made_of_them_were(settings, principal, monkeypatch):
    """A step's rows are those the ``Job`` that ``build_job`` made of the same request wrote (job and events)."""
    from app.services import jobs as job_service

    at = utcnow()
    monkeypatch.setattr(job_service, "utcnow", lambda: at)  # the jobs' created_at: the same for both builds
    calls, real_values = [], job_service.job_values

    def recorded(*a, **kw):
        calls.append((a, kw))
        return real_values(*a, **kw)

    monkeypatch.setattr(driver, "job_values", recorded, raising=False)
    monkeypatch.setattr(job_service, "job_values", recorded)  # where build_job reads it
    run_id = service.create_run(settings, principal, [Document("long", LONG), Document("short", "Hi there.")],
                                utcnow() + timedelta(hours=1), max_summary_tokens=12, chunk_tokens=120,
                                overlap_tokens=8, tier="paid").id
    step = driver.advance(settings, run_id, "api")
    assert step.outcome == Outcome.STEPPED and len(step.submitted) == len(calls) > 2
    new_rows = written_rows(settings.sqlalchemy_url)
    monkeypatch.setattr(job_service, "job_values", real_values)
    # the same requests built as ORM Jobs (build_job) with their run, written in their place as the step wrote them
    old_jobs = []
    for (a, kw), job_id in zip(calls, step.submitted, strict=True):
        job = job_service.build_job(*a, **kw, job_id=job_id)
        job.summarization_run_id = run_id
        old_jobs.append((job, f"summarization {run_id}"))
    with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
        s.execute(delete(JobEvent))
        s.execute(delete(Job))
        job_writer.JobRows.of(old_jobs, None).insert(s)
    assert written_rows(settings.sqlalchemy_url) == new_rows
    assert len(new_rows[1]) == len(new_rows[0]) and {j["summarization_run_id"] for j in new_rows[0]} == {run_id}


def test_a_page_of_runs_counts_their_open_jobs_in_one_statement(settings, principal):
    """The tenant's runs listing (GET /v1/summarize) and the dashboard's count every live run's open jobs in one
    grouped statement for the page (they ran one a run), with each run's jobs_done as its own poll says."""
    from app.api.admin import summarizations
    from app.api.summarize import list_runs

    url = settings.sqlalchemy_url
    runs = [start(settings, principal, [Document(f"d{i}", LONG)]) for i in range(3)]
    for done, run_id in enumerate(runs):  # 0, 1 and 2 of each run's jobs ended
        end_jobs(url, doc_row(url, run_id, 0).pending[:done], "succeeded")
    polled = {run_id: service.view(settings, run_id).progress.jobs_done for run_id in runs}
    assert sorted(polled.values()) == [0, 1, 2]
    for listing in (lambda s: list_runs(s, principal, limit=20), lambda s: summarizations(s, None, limit=20)):
        with session_scope(url) as s, Statements() as listed:
            page = listing(s)
        assert {r["id"]: r["jobs_done"] for r in page["data"]} == polled
        assert sum("FROM jobs" in q for q in listed.sql) == 1, listed.sql
