"""The Batch API's queue limit through the real app (SQLite migrated by Alembic; no worker, so a batch's jobs stay
queued until the test finishes them in SQL): a batch that would pass the tenant's enqueued tokens fails validation
with token_limit_exceeded, the queued ones are kept, and room comes back as jobs end."""

from __future__ import annotations

import json

import openai
import pytest
from sqlalchemy import func, select, update

from app.db.models import Job
from app.db.session import session_scope

pytestmark = pytest.mark.integration

LINES = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                            "body": {"model": "tiny", "prompt": "Tell me about the sea " * 4, "max_tokens": 2}}) + "\n"
                for i in range(3)).encode()


@pytest.fixture
def oai(client, keys) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=keys.paid, http_client=client, max_retries=0)


def submit(oai: openai.OpenAI):
    src = oai.files.create(file=("in.jsonl", LINES), purpose="batch")
    batch = oai.batches.create(input_file_id=src.id, endpoint="/v1/completions", completion_window="24h")
    return oai.batches.retrieve(batch.id)  # validated: the test client ran the background task


def queued_tokens(db_url: str, batch_id: str) -> int:
    with session_scope(db_url) as s:
        return s.scalar(select(func.sum(Job.prompt_tokens)).where(Job.batch_id == batch_id))


def set_limit(client, keys, tenant_id: str, tokens: int | None) -> dict:
    r = client.patch(f"/v1/admin/tenants/{tenant_id}", json={"batch_queue_tokens": tokens},
                     headers=keys.header(keys.admin))
    assert r.status_code == 200, r.text
    return r.json()


def test_a_batch_past_the_queue_limit_fails_and_the_queued_ones_run_on(oai, client, keys, db_url):
    first = submit(oai)
    assert first.status == "in_progress" and first.usage.total_tokens == 0  # nothing ran yet
    tokens = queued_tokens(db_url, first.id)
    assert set_limit(client, keys, keys.tenant_id, tokens + tokens // 2)["batch_queue_tokens"] == tokens + tokens // 2

    second = submit(oai)  # the same lines again: the first's tokens and these pass the limit
    assert second.status == "failed" and second.failed_at is not None
    (error,) = second.errors.data
    assert error.code == "token_limit_exceeded"
    assert f"{tokens} prompt tokens" in error.message and f"limit of {tokens + tokens // 2}" in error.message
    assert oai.batches.retrieve(first.id).status == "in_progress"  # nothing queued is lost
    assert queued_tokens(db_url, second.id) is None  # no job of it was written

    other = openai.OpenAI(base_url=oai.base_url, api_key=keys.other, http_client=oai._client, max_retries=0)
    assert submit(other).status == "in_progress"  # another tenant's queue is its own

    with session_scope(db_url) as s:  # the first batch's jobs end (a worker's write)
        s.execute(update(Job).where(Job.batch_id == first.id).values(status="succeeded", completion_tokens=2))
        s.commit()
    usage = oai.batches.retrieve(first.id).usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (tokens, 6, tokens + 6)
    assert submit(oai).status == "in_progress"  # there is room again

    set_limit(client, keys, keys.tenant_id, None)
    assert submit(oai).status == "in_progress"  # no limit: any size queues


def test_the_queue_limit_is_refused_when_out_of_range(client, keys):
    r = client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"batch_queue_tokens": 0},
                     headers=keys.header(keys.admin))
    assert r.status_code == 422 and "batch_queue_tokens" in r.text, r.text
    r = client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"batch_queue_tokens": 10},
                     headers=keys.header(keys.paid))
    assert r.status_code == 403, r.text


def test_an_unknown_list_cursor_is_a_400_naming_it_and_another_tenants_reads_as_unknown(oai, keys, client):
    """A cursor naming nothing of the tenant's is a client's mistake: a 400 naming the parameter (an empty page would
    end an SDK's iteration as if the list were done), the same for another tenant's id, so the listing tells a
    tenant nothing of another's batch."""
    theirs = submit(oai)
    other = openai.OpenAI(base_url=oai.base_url, api_key=keys.other, http_client=oai._client, max_retries=0)
    own = submit(other)
    assert [b.id for b in other.batches.list()] == [own.id]
    answers = []
    for cursor in (theirs.id, "batch_unknown"):
        with pytest.raises(openai.BadRequestError) as exc:
            other.batches.list(after=cursor)
        assert exc.value.body["param"] == "after" and cursor in exc.value.body["message"], exc.value.body
        answers.append(exc.value.body["message"].replace(cursor, "<id>"))
    assert answers[0] == answers[1]  # another tenant's id reads as one never made
    with pytest.raises(openai.BadRequestError) as exc:
        other.files.list(after=theirs.input_file_id)
    assert exc.value.body["param"] == "after", exc.value.body
    claude = {"x-api-key": keys.other, "anthropic-version": "2023-06-01"}
    for param in ("after_id", "before_id"):
        r = client.get("/v1/messages/batches", params={param: "msgbatch_unknown"}, headers=claude)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert param in r.json()["error"]["message"], r.text
    assert [b.id for b in oai.batches.list(after=submit(oai).id)] == [theirs.id]  # a tenant's own cursor pages
