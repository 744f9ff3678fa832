"""A summarization run is deadline work, as a batch is, and counts against its tenant's batch queue limit (real app
and its driver thread, SQLite migrated by Alembic, real Redis; no worker, so jobs stay queued): a run whose first
level would pass the limit fails at its first step naming it, no job written; a run let in holds its room, and a
batch that would pass the limit beside it fails validation with token_limit_exceeded."""

from __future__ import annotations

import json

import openai
import pytest
from sqlalchemy import func, select

from app.db.models import Job
from app.db.session import session_scope
from tests.conftest import Keys, wait_for

pytestmark = pytest.mark.integration

BODY = {"documents": [{"id": f"d{i}", "text": f"The river {i} runs to the sea. It is wide and slow. " * 30}
                      for i in range(4)], "deadline": "30m", "max_summary_tokens": 12, "chunk_tokens": 160,
        "overlap_tokens": 16}
LINES = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                            "body": {"model": "tiny", "prompt": "Tell me about the sea " * 4, "max_tokens": 2}}) + "\n"
                for i in range(3)).encode()


def set_limit(client, keys, tokens: int | None) -> None:
    r = client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"batch_queue_tokens": tokens},
                     headers=keys.header(keys.admin))
    assert r.status_code == 200, r.text


def run_to_first_step(client, key: str) -> dict:
    r = client.post("/v1/summarize", headers=Keys.header(key), json=BODY)
    assert r.status_code == 201 and r.json()["status"] == "validating", r.text
    run_id = r.json()["id"]
    return wait_for(lambda: (run := client.get(f"/v1/summarize/{run_id}", headers=Keys.header(key)).json())
                    ["status"] != "validating" and run, 30, "the run's first step")


def run_tokens(db_url: str, run_id: str) -> int:
    with session_scope(db_url) as s:
        return s.scalar(select(func.coalesce(func.sum(Job.prompt_tokens), 0)).where(
            Job.summarization_run_id == run_id))


def test_a_run_past_the_queue_limit_fails_naming_it_and_a_run_let_in_holds_its_room(client, keys, db_url):
    admitted = run_to_first_step(client, keys.paid)  # no limit: any size runs
    assert admitted["status"] == "running", admitted
    tokens = run_tokens(db_url, admitted["id"])
    set_limit(client, keys, tokens + tokens // 2)

    refused = run_to_first_step(client, keys.paid)  # the same documents again: with the first's, past the limit
    assert refused["status"] == "failed" and refused["jobs_submitted"] == 0, refused
    reason = refused["reason"]
    assert "token_limit_exceeded" in reason and f"{tokens} prompt tokens" in reason, reason
    assert f"limit of {tokens + tokens // 2}" in reason and "smaller runs" in reason, reason
    assert run_tokens(db_url, refused["id"]) == 0  # no job of it was written
    # the limit's message once, in the run's reason: each document (4 here, 10,000 at most) points to it
    lines = client.get(f"/v1/summarize/{refused['id']}/results", headers=Keys.header(keys.paid)).text.splitlines()
    assert [json.loads(line)["error"] for line in lines] == ["failed with its summarization run (its reason says why)"
                                                            ] * 4, lines
    assert run_to_first_step(client, keys.other)["status"] == "running"  # another tenant's queue is its own

    set_limit(client, keys, tokens + 1)  # the running run's jobs leave room for no batch
    oai = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=keys.paid, http_client=client, max_retries=0)
    src = oai.files.create(file=("in.jsonl", LINES), purpose="batch")
    batch = oai.batches.retrieve(oai.batches.create(input_file_id=src.id, endpoint="/v1/completions",
                                                    completion_window="24h").id)
    assert batch.status == "failed", batch
    (error,) = batch.errors.data
    assert error.code == "token_limit_exceeded" and f"the {tokens} already queued" in error.message, error

    r = client.post(f"/v1/summarize/{admitted['id']}/cancel", headers=Keys.header(keys.paid))
    assert r.status_code == 200, r.text
    assert run_to_first_step(client, keys.paid)["status"] == "running"  # its jobs ended: there is room again
