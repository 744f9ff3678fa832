"""What ``POST /v1/summarize`` answers for documents it cannot take: a 422 that points at the document to fix (real
app, migrated SQLite)."""

from __future__ import annotations

import pytest
from sqlalchemy import select, update

from app.db.models import Job, SummarizationDocument, SummarizationRun
from app.db.session import session_scope
from app.summarize.documents import specbench_summarization
from tests.conftest import Keys, wait_for

pytestmark = pytest.mark.integration


def test_repeated_document_ids_are_refused_naming_each_id_and_where_it_repeats(client, keys, settings):
    """The 422 said only "document ids must be unique": a client that sent thousands of documents could not tell which
    ids repeat. Each repeat is an error at its own document, naming the id and the document it repeats."""
    text = "The cat sat. It was warm."
    ids = ["a", "b", "a", "c", "b", "a"]
    r = client.post("/v1/summarize", headers=Keys.header(keys.paid),
                    json={"documents": [{"id": i, "text": text} for i in ids], "deadline": "30m"})
    assert r.status_code == 422, r.text
    errors = r.json()["detail"]
    assert [e["loc"] for e in errors] == [["body", "documents", 2, "id"], ["body", "documents", 4, "id"],
                                          ["body", "documents", 5, "id"]], errors
    assert "'a'" in errors[0]["msg"] and "documents[0]" in errors[0]["msg"], errors
    assert "'b'" in errors[1]["msg"] and "documents[1]" in errors[1]["msg"], errors
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.scalars(select(SummarizationRun)).all() == []


def test_an_overlap_over_a_quarter_of_the_chunk_is_named_as_cut_where_summaries_are_refused(client, keys):
    """The server cuts overlap_tokens to a quarter of chunk_tokens; a refusal of too long summaries then named a
    "64 overlap" the request never gave (it gave 200), and the README said the overlap given is what counts."""
    body = {"documents": [{"id": "a", "text": "The cat sat. It was warm."}], "deadline": "30m",
            "chunk_tokens": 256, "overlap_tokens": 200}  # cut to 64: 192 new tokens a chunk, summaries of 96 at most
    r = client.post("/v1/summarize", headers=Keys.header(keys.paid), json=body | {"max_summary_tokens": 97})
    assert r.status_code == 422, r.text
    error = r.json()["detail"][0]
    assert error["loc"] == ["body", "max_summary_tokens"] and "max_summary_tokens <= 96" in error["msg"], error
    assert "overlap_tokens=200 is cut to 64" in error["msg"], error
    ok = client.post("/v1/summarize", headers=Keys.header(keys.paid), json=body | {"max_summary_tokens": 96})
    assert ok.status_code == 201, ok.text


def test_a_retry_under_the_idempotency_key_counts_the_jobs_ended_as_a_poll_does(client, keys, settings):
    """A retry under the key answered the run's row as its last step wrote it: with a map job ended that no step had
    collected yet (its document waits for the others), the poll said jobs_done 1 and the retry 0."""
    body = {"documents": [{"id": "long", "text": specbench_summarization(limit=1)[0].text}], "deadline": "30m",
            "max_summary_tokens": 12, "chunk_tokens": 160, "overlap_tokens": 16}
    headers = Keys.header(keys.paid) | {"Idempotency-Key": "k-jobs"}
    run_id = client.post("/v1/summarize", headers=headers, json=body).json()["id"]
    poll = lambda: client.get(f"/v1/summarize/{run_id}", headers=Keys.header(keys.paid)).json()  # noqa: E731
    wait_for(lambda: poll()["status"] == "running", 30, "the run's first step")
    with session_scope(settings.sqlalchemy_url) as s:
        pending = s.scalars(select(SummarizationDocument.pending).where(SummarizationDocument.run_id == run_id)).one()
        assert len(pending) > 1
        s.execute(update(Job).where(Job.id == pending[0]).values(status="succeeded", output_text="A part."))
    assert wait_for(lambda: poll()["jobs_done"] == 1 and poll(), 30, "the poll to count the ended job")
    again = client.post("/v1/summarize", headers=headers, json=body)
    assert again.status_code == 200 and again.json()["id"] == run_id, again.text
    assert again.json()["jobs_done"] == 1, again.json()
