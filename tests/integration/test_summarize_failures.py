"""A summarization run whose one document cannot go on fails that document alone (real app and its driver thread,
migrated SQLite, real Redis; the jobs' results written in SQL as a worker writes them)."""

from __future__ import annotations

import json
import re

import pytest
from sqlalchemy import select, update

from app.db.models import Job, JobEvent, SummarizationDocument, SummarizationRun
from app.db.session import session_scope
from app.summarize import driver
from app.summarize.documents import specbench_summarization
from tests.conftest import Keys, wait_for
from tests.postgres import TEST_DATABASE

pytestmark = pytest.mark.integration


def _docs(settings, run_id: str) -> dict[str, SummarizationDocument]:
    with session_scope(settings.sqlalchemy_url) as s:
        rows = s.scalars(select(SummarizationDocument).where(SummarizationDocument.run_id == run_id)).all()
        s.expunge_all()
        return {d.doc_id: d for d in rows}


def _jobs(settings) -> list[str]:
    with session_scope(settings.sqlalchemy_url) as s:
        return s.scalars(select(Job.id)).all()


def _finish(settings, job_ids: list[str], text: str) -> None:
    with session_scope(settings.sqlalchemy_url) as s:
        s.execute(update(Job).where(Job.id.in_(job_ids)).values(status="succeeded", output_text=text,
                                                               completion_tokens=3))


def _started(client, key: str, body: dict, status: str = "running") -> str:
    """Starts a run: the request answers it ``validating``; its first step (the app's driver thread) splits it."""
    r = client.post("/v1/summarize", headers=Keys.header(key), json=body)
    assert r.status_code == 201 and r.json()["status"] == "validating" and r.json()["jobs_submitted"] == 0, r.text
    run_id = r.json()["id"]
    wait_for(lambda: client.get(f"/v1/summarize/{run_id}", headers=Keys.header(key)).json()["status"] != "validating",
             30, "the run's first step")
    run = client.get(f"/v1/summarize/{run_id}", headers=Keys.header(key)).json()
    assert run["status"] == status, run
    return run_id


@pytest.mark.skipif(TEST_DATABASE != "sqlite", reason="its summary with a NUL cannot be stored on PostgreSQL "
                    "(text refuses NUL), so no level is built from one there")
def test_a_document_whose_next_level_cannot_be_built_fails_alone(client, keys, settings):
    body = {"documents": [{"id": "long", "text": specbench_summarization(limit=1)[0].text},
                          {"id": "short", "text": "The cat sat. It was warm."}],
            "deadline": "30m", "max_summary_tokens": 12, "chunk_tokens": 160, "overlap_tokens": 16}
    run_id = _started(client, keys.paid, body)
    docs = _docs(settings, run_id)
    assert len(docs["long"].pending) > 1 and len(docs["short"].pending) == 1
    _finish(settings, docs["long"].pending, "a\x00b")  # a summary its reduce level cannot take (a NUL)
    failed = wait_for(lambda: (d := _docs(settings, run_id)["long"]).error and d, 30, "the long document to fail")
    assert failed.done and "NUL" in failed.error
    short = _docs(settings, run_id)["short"]
    assert not short.done and short.error is None  # its job runs on
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, short.pending[0]).status in ("queued", "dispatched")
        assert s.get(SummarizationRun, run_id).status == "running"
    _finish(settings, short.pending, "A cat in the warmth.")
    run = wait_for(lambda: (r := client.get(f"/v1/summarize/{run_id}", headers=Keys.header(keys.paid)).json())
                   ["status"] != "running" and r, 30, "the run to end")
    assert (run["status"], run["documents_done"], run["documents_failed"]) == ("completed", 2, 1), run


def test_a_run_cancelled_keeps_its_summaries_and_cancels_the_jobs_it_waited_for(client, keys, settings):
    body = {"documents": [{"id": "done", "text": "The cat sat. It was warm."},
                          {"id": "open", "text": "The dog ran. It was cold."}], "deadline": "30m"}
    run_id = _started(client, keys.paid, body)
    docs = _docs(settings, run_id)
    _finish(settings, docs["done"].pending, "A cat in the warmth.")
    wait_for(lambda: _docs(settings, run_id)["done"].done, 30, "the first document's summary")
    assert client.post(f"/v1/summarize/{run_id}/cancel", headers=Keys.header(keys.other)).status_code == 404
    r = client.post(f"/v1/summarize/{run_id}/cancel", headers=Keys.header(keys.paid))
    assert r.status_code == 200 and (r.json()["status"], r.json()["documents_failed"]) == ("cancelled", 1), r.text
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, docs["open"].pending[0]).status == "cancelled"  # its job will not run
    lines = [json.loads(line) for line in client.get(f"/v1/summarize/{run_id}/results",
                                                     headers=Keys.header(keys.paid)).text.splitlines()]
    assert {d["id"]: (d["summary"], d["error"]) for d in lines} == {
        "done": ("A cat in the warmth.", None), "open": (None, "cancelled with its summarization run")}
    again = client.post(f"/v1/summarize/{run_id}/cancel", headers=Keys.header(keys.paid))
    assert again.status_code == 409 and "already ended (cancelled)" in again.json()["detail"]


def test_a_retry_with_the_same_idempotency_key_answers_the_run_it_started(client, keys, settings):
    body = {"documents": [{"id": "a", "text": "The cat sat. It was warm."}], "deadline": "30m"}
    first = client.post("/v1/summarize", headers=Keys.header(keys.paid) | {"Idempotency-Key": "k1"}, json=body)
    again = client.post("/v1/summarize", headers=Keys.header(keys.paid) | {"Idempotency-Key": "k1"}, json=body)
    assert (first.status_code, again.status_code) == (201, 200), again.text
    assert again.json()["id"] == first.json()["id"]
    other = client.post("/v1/summarize", headers=Keys.header(keys.paid) | {"Idempotency-Key": "k1"},
                        json=body | {"deadline": "1h"})
    assert other.status_code == 409 and first.json()["id"] in other.json()["detail"], other.text
    # per tenant: another tenant's key of the same name starts its own run
    theirs = client.post("/v1/summarize", headers=Keys.header(keys.other) | {"Idempotency-Key": "k1"}, json=body)
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"]
    with session_scope(settings.sqlalchemy_url) as s:
        runs = s.scalars(select(SummarizationRun.id)).all()
    assert len(runs) == 2  # the retry made no run
    wait_for(lambda: len(_jobs(settings)) == 2, 30, "the runs' first steps")  # nor a job: one a run


def test_a_tenants_runs_are_listed_newest_first_page_by_page(client, keys):
    body = {"documents": [{"id": "a", "text": "The cat sat. It was warm."}], "deadline": "30m"}
    mine = [client.post("/v1/summarize", headers=Keys.header(keys.paid), json=body).json()["id"] for _ in range(3)]
    theirs = client.post("/v1/summarize", headers=Keys.header(keys.other), json=body).json()["id"]
    page = client.get("/v1/summarize", params={"limit": 2}, headers=Keys.header(keys.paid)).json()
    assert [r["id"] for r in page["data"]] == mine[::-1][:2] and page["has_more"], page
    assert page["data"][0]["status"] in ("validating", "running") and page["data"][0]["deadline_at"].endswith("Z")
    rest = client.get("/v1/summarize", params={"limit": 2, "after": page["last_id"]},
                      headers=Keys.header(keys.paid)).json()
    assert [r["id"] for r in rest["data"]] == mine[:1] and not rest["has_more"]
    assert [r["id"] for r in client.get("/v1/summarize", headers=Keys.header(keys.other)).json()["data"]] == [theirs]
    # another tenant's run as a cursor tells nothing about it: a 422 as for an id never made
    for cursor in (theirs, "run_unknown"):
        r = client.get("/v1/summarize", params={"after": cursor}, headers=Keys.header(keys.paid))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "after"], r.text


def test_summaries_too_long_to_shrink_a_level_are_refused_before_any_job(client, keys, settings):
    body = {"documents": [{"id": "a", "text": "The cat sat. It was warm."}], "deadline": "30m",
            "chunk_tokens": 256, "overlap_tokens": 64}  # 192 new tokens a chunk: summaries of at most 96
    r = client.post("/v1/summarize", headers=Keys.header(keys.paid), json=body | {"max_summary_tokens": 97})
    assert r.status_code == 422, r.text
    error = r.json()["detail"][0]
    assert error["loc"] == ["body", "max_summary_tokens"] and "max_summary_tokens <= 96" in error["msg"], error
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.scalars(select(Job.id)).all() == [] and s.scalars(select(SummarizationRun.id)).all() == []
    ok = client.post("/v1/summarize", headers=Keys.header(keys.paid), json=body | {"max_summary_tokens": 96})
    assert ok.status_code == 201, ok.text


def test_summaries_too_long_for_the_models_context_are_refused_naming_the_summary_length_that_fits(client, keys,
                                                                                                  settings):
    # the tiny model holds 512 tokens: a chunk of 4000 would not fit beside a 300-token summary and its prompt, so
    # no larger chunk_tokens can help (the refusal said so, with a chunk size and an overlap the request never named)
    body = {"documents": [{"id": "a", "text": "The cat sat. It was warm."}], "deadline": "30m",
            "chunk_tokens": 4000, "overlap_tokens": 1000}
    for too_long in (300, 480):
        r = client.post("/v1/summarize", headers=Keys.header(keys.paid), json=body | {"max_summary_tokens": too_long})
        assert r.status_code == 422, r.text
        error = r.json()["detail"][0]
        assert error["loc"] == ["body", "max_summary_tokens"] and "512-token context" in error["msg"], error
        assert "larger chunk_tokens" not in error["msg"], error
        fits = int(re.search(r"max_summary_tokens <= (\d+)", error["msg"]).group(1))
    refused = client.post("/v1/summarize", headers=Keys.header(keys.paid), json=body | {"max_summary_tokens": fits + 1})
    assert refused.status_code == 422, refused.text
    ok = client.post("/v1/summarize", headers=Keys.header(keys.paid), json=body | {"max_summary_tokens": fits})
    assert ok.status_code == 201, ok.text


def test_a_tenant_disabled_by_an_admin_ends_its_runs_as_cancelled_naming_why(client, keys, settings):
    body = {"documents": [{"id": "done", "text": "The cat sat. It was warm."},
                          {"id": "open", "text": "The dog ran. It was cold."}], "deadline": "30m"}
    run_id, theirs = _started(client, keys.paid, body), _started(client, keys.other, body)
    docs = _docs(settings, run_id)
    _finish(settings, docs["done"].pending, "A cat in the warmth.")
    wait_for(lambda: _docs(settings, run_id)["done"].done, 30, "the first document's summary")
    r = client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"disabled": True}, headers=Keys.header(keys.admin))
    assert r.status_code == 200, r.text
    with session_scope(settings.sqlalchemy_url) as s:
        run = s.get(SummarizationRun, run_id)
        assert (run.status, run.reason) == ("cancelled", "cancelled: its tenant was disabled by an admin")
        assert (run.documents_done, run.documents_failed, run.jobs_done) == (2, 1, 2)
        assert s.get(Job, docs["open"].pending[0]).status == "cancelled"
        assert s.get(SummarizationRun, theirs).status == "running"  # another tenant's run goes on
    assert {d.doc_id: (d.summary, d.error) for d in _docs(settings, run_id).values()} == {
        "done": ("A cat in the warmth.", None), "open": (None, "cancelled: its tenant was disabled")}


def test_a_document_too_long_for_the_levels_fails_the_run_at_its_first_step_before_any_job(client, keys, settings):
    """Summaries of up to half a chunk halve a level's chunks only: 50 chunks may need 8 levels, and the document
    failed at the 7th, after all its jobs, where they came out that long; the split is off the request, so the run's
    first step fails it, saying which document and what to change."""
    text = " ".join(f"Fact number {i} is about the topic of the document." for i in range(250))
    body = {"documents": [{"id": "short", "text": "The cat sat."}, {"id": "book", "text": text}], "deadline": "30m",
            "chunk_tokens": 64, "overlap_tokens": 0}
    run_id = _started(client, keys.paid, body | {"max_summary_tokens": 32}, status="failed")
    run = client.get(f"/v1/summarize/{run_id}", headers=Keys.header(keys.paid)).json()
    assert "document 'book' is" in run["reason"] and "more than 6 levels" in run["reason"], run
    assert "smaller max_summary_tokens" in run["reason"] and run["documents_failed"] == 2, run
    lines = client.get(f"/v1/summarize/{run_id}/results", headers=Keys.header(keys.paid)).text.splitlines()
    assert [json.loads(line)["error"] for line in lines] == ["failed with its summarization run (its reason says why)"
                                                            ] * 2
    assert _jobs(settings) == []
    _started(client, keys.paid, body | {"max_summary_tokens": 8})


def test_a_run_of_more_jobs_than_summarize_max_jobs_fails_at_its_first_step_before_any(client, keys, settings,
                                                                                      monkeypatch):
    """The first level's jobs go in in one transaction: past COSERVE_SUMMARIZE_MAX_JOBS the run fails saying how
    many the documents make and what to change, and no job is written (9 jobs, where the request's bound, from their
    words, is 6)."""
    monkeypatch.setattr(settings, "summarize_max_jobs", 6)
    text = " ".join(f"Fact number {i} is about the topic of the document." for i in range(30))
    body = {"documents": [{"id": "a", "text": text}, {"id": "b", "text": "The cat sat."}], "deadline": "30m",
            "chunk_tokens": 64, "overlap_tokens": 0, "max_summary_tokens": 8}
    run_id = _started(client, keys.paid, body, status="failed")
    reason = client.get(f"/v1/summarize/{run_id}", headers=Keys.header(keys.paid)).json()["reason"]
    assert "make 9 chunks" in reason and "a run takes at most 6" in reason and "larger chunk_tokens" in reason, reason
    assert _jobs(settings) == []
    monkeypatch.setattr(settings, "summarize_max_jobs", 10_000)
    _started(client, keys.paid, body)


def test_a_run_whose_words_alone_make_more_jobs_than_summarize_max_jobs_is_refused_in_the_request(client, keys,
                                                                                                 settings, monkeypatch):
    """The max-jobs refusal came only from the run's first step, as a failed run a poll found later: where the
    documents' words alone (a token each at least) make too many chunks, the request is refused at once, naming the
    bound and what to change, and no run is written."""
    monkeypatch.setattr(settings, "summarize_max_jobs", 5)
    text = " ".join(f"Fact number {i} is about the topic of the document." for i in range(30))  # 300 words
    body = {"documents": [{"id": "a", "text": text}, {"id": "b", "text": "The cat sat."}], "deadline": "30m",
            "chunk_tokens": 64, "overlap_tokens": 0, "max_summary_tokens": 8}
    r = client.post("/v1/summarize", headers=Keys.header(keys.paid), json=body)
    assert r.status_code == 422, r.text
    message = json.dumps(r.json())
    assert "6 or more chunks of 64 tokens" in message and "at most 5" in message and "larger chunk_tokens" in message
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.scalars(select(SummarizationRun)).all() == []
    assert _jobs(settings) == []


def _fail_the_pipeline(monkeypatch) -> None:
    """The run's next step cannot build its planner (its model's tokenizer fails to load): the run fails as a whole."""
    def broken(_model):
        raise OSError("the tokenizer files are gone")

    monkeypatch.setattr(driver, "get_tokenizer", broken)


def _run_failing_with_a_job_open(client, keys, settings, monkeypatch) -> tuple[str, str]:
    """A run of two documents whose first document's job ends, and whose step then fails the run; the run's id and
    the job the second document waited for."""
    body = {"documents": [{"id": "done", "text": "The cat sat. It was warm."},
                          {"id": "open", "text": "The dog ran. It was cold."}], "deadline": "30m"}
    run_id = _started(client, keys.paid, body)
    docs = _docs(settings, run_id)
    _fail_the_pipeline(monkeypatch)
    _finish(settings, docs["done"].pending, "A cat in the warmth.")
    wait_for(lambda: client.get(f"/v1/summarize/{run_id}", headers=Keys.header(keys.paid)).json()["status"]
             == "failed", 30, "the run to fail")
    return run_id, docs["open"].pending[0]


def test_a_run_that_fails_as_a_whole_cancels_the_jobs_its_documents_waited_for(client, keys, settings, monkeypatch):
    """A run that failed as a whole left the jobs it had submitted running to their end on the GPU, for nobody: they
    are cancelled as a cancelled run's are, naming the failed run, and its jobs_done reaches jobs_submitted."""
    run_id, open_job = _run_failing_with_a_job_open(client, keys, settings, monkeypatch)
    run = wait_for(lambda: (r := client.get(f"/v1/summarize/{run_id}", headers=Keys.header(keys.paid)).json())
                   ["jobs_done"] == r["jobs_submitted"] and r, 30, "the run's jobs to end")
    assert (run["jobs_submitted"], run["jobs_done"]) == (2, 2), run
    assert run["reason"] == "pipeline error: the tokenizer files are gone", run
    # the answer counts ended jobs live; the failing step writes the run's row after it
    wait_for(lambda: _lease_free(settings, run_id), 30, "the failing step to write its end")
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, open_job).status == "cancelled"
        detail = s.scalars(select(JobEvent.detail).where(JobEvent.job_id == open_job,
                                                         JobEvent.to_status == "cancelled"))
        assert f"summarization {run_id} failed" in detail.one()  # the job's events say why it was cancelled
        row = s.get(SummarizationRun, run_id)
        assert (row.status, row.lease_owner, row.jobs_done) == ("failed", None, 2)
    assert all(d.pending == [] for d in _docs(settings, run_id).values())


def test_the_sweeper_stops_the_jobs_of_a_run_whose_failure_died_before_stopping_them(client, keys, settings,
                                                                                    monkeypatch):
    """A process that fails a run and dies before stopping its jobs leaves it failed with jobs_done short of
    jobs_submitted: a worker's sweeper (``finish_cancels``) stops them."""
    def dies(*_args, **_kwargs):
        raise ConnectionError("the process died here")

    monkeypatch.setattr(driver, "stop_job_ids", dies)
    run_id, open_job = _run_failing_with_a_job_open(client, keys, settings, monkeypatch)
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, open_job).status in ("queued", "dispatched")
    monkeypatch.undo()
    wait_for(lambda: _lease_free(settings, run_id), 30, "the failed step to give its lease back")
    steps = driver.finish_cancels(settings, "a-workers-sweeper")
    assert [(st.outcome, st.status) for st in steps] == [(driver.Outcome.STEPPED, "failed")]
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, open_job).status == "cancelled"
        run = s.get(SummarizationRun, run_id)
        assert (run.status, run.jobs_done, run.jobs_submitted) == ("failed", 2, 2)
    assert driver.finish_cancels(settings, "a-workers-sweeper") == []  # once stopped, the run is not taken again


def _lease_free(settings, run_id: str) -> bool:
    with session_scope(settings.sqlalchemy_url) as s:
        return s.get(SummarizationRun, run_id).lease_owner is None
