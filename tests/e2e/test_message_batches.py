"""Anthropic's Message Batches API with the official ``anthropic`` client against the real app (HTTP), Redis, Celery
worker and DB: create (a bad request errored alone), retrieve until ended, results, list, cancel, delete, and
another tenant's batch being none of a tenant's business."""

from __future__ import annotations

from datetime import timedelta

import anthropic
import httpx
import pytest

from app.db.models import Job
from app.db.session import session_scope
from tests.conftest import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def params(content: str, max_tokens: int = 4, **extra) -> dict:
    return {"model": "tiny", "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}],
            "temperature": 0, "ignore_eos": True, **extra}


@pytest.fixture
def claude(stack) -> anthropic.Anthropic:
    """The paid key's client of the module's shared stack (its plain worker ``w1``)."""
    return anthropic.Anthropic(base_url=stack.url, api_key=stack.keys.paid, max_retries=0, timeout=120)


def ended(claude, batch_id: str):
    return wait_for(lambda: (b := claude.messages.batches.retrieve(batch_id)).processing_status == "ended" and b,
                    120, f"message batch {batch_id} to end", interval=0.3)


def prompt(usage) -> int:
    """A Message's prompt tokens: Anthropic's input counts those of the prefix cache apart."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def test_message_batch_round_trip(claude, stack):
    with pytest.raises(anthropic.BadRequestError, match="unique custom_id") as bad:  # a malformed body: a 400
        claude.messages.batches.create(requests=[{"custom_id": "x", "params": params("Hi")},
                                                 {"custom_id": "x", "params": params("Bye")}])
    assert bad.value.status_code == 400 and bad.value.body["error"]["type"] == "invalid_request_error"
    assert bad.value.response.headers["request-id"] == bad.value.body["request_id"]

    first = claude.messages.batches.create(requests=[{"custom_id": "only", "params": params("Hi", max_tokens=1)}])
    raw = claude.messages.batches.with_raw_response.create(requests=[
        {"custom_id": "a", "params": params("Hello")},
        {"custom_id": "b", "params": params("Tell me a joke", max_tokens=6, system="Be brief")},
        {"custom_id": "c", "params": params("Count", stop_sequences=["\u2603"])}])
    assert raw.headers["request-id"]
    batch = raw.parse()
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress" and batch.results_url is None and batch.ended_at is None
    assert batch.request_counts.processing == 3 and batch.request_counts.succeeded == 0
    assert batch.expires_at - batch.created_at == timedelta(hours=24)

    done = ended(claude, batch.id)
    assert done.ended_at is not None and done.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")
    assert done.request_counts.model_dump() == {"processing": 0, "succeeded": 3, "errored": 0, "canceled": 0,
                                                "expired": 0}
    results = list(claude.messages.batches.results(batch.id))
    assert [r.custom_id for r in results] == ["a", "b", "c"]
    assert {r.result.type for r in results} == {"succeeded"}
    b = results[1].result.message
    assert b.type == "message" and b.role == "assistant" and b.id.startswith("msg_")
    assert b.stop_reason == "max_tokens" and b.usage.output_tokens == 6 and b.content[0].type == "text"
    online = claude.messages.create(model="tiny", max_tokens=6, system="Be brief",  # what /v1/messages answers
                                    messages=[{"role": "user", "content": "Tell me a joke"}],
                                    extra_body={"ignore_eos": True, "temperature": 0})
    assert (b.model, b.stop_reason, prompt(b.usage)) == (online.model, online.stop_reason, prompt(online.usage))

    page = claude.messages.batches.list(limit=1)  # newest first, paged by the ids
    assert [x.id for x in page.data] == [batch.id] and page.has_more and page.first_id == page.last_id == batch.id
    older = claude.messages.batches.list(limit=1, after_id=batch.id)
    assert [x.id for x in older.data] == [first.id] and not older.has_more
    back = claude.messages.batches.list(limit=1, before_id=first.id)
    assert [x.id for x in back.data] == [batch.id] and not back.has_more
    # iterating follows the pages: after_id the last of each (older), before_id the first of each (newer)
    assert [x.id for x in claude.messages.batches.list(limit=1)] == [batch.id, first.id]
    assert [x.id for x in claude.messages.batches.list(limit=1, after_id=batch.id)] == [first.id]
    assert [x.id for x in claude.messages.batches.list(limit=1, before_id=first.id)] == [batch.id]
    oai = httpx.get(f"{stack.url}/v1/batches/{batch.id}", headers={"Authorization": f"Bearer {stack.keys.paid}"})
    assert oai.status_code == 404  # no OpenAI Batch object

    anonymous = httpx.get(f"{stack.url}/v1/messages/batches/{batch.id}")
    assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"
    assert anonymous.headers["request-id"] == anonymous.json()["request_id"]
    stranger = anthropic.Anthropic(base_url=stack.url, api_key=stack.keys.other, max_retries=0, timeout=30)
    for call in (lambda: stranger.messages.batches.retrieve(batch.id),
                 lambda: stranger.messages.batches.cancel(batch.id),
                 lambda: stranger.messages.batches.delete(batch.id),
                 lambda: list(stranger.messages.batches.results(batch.id))):
        with pytest.raises(anthropic.NotFoundError):
            call()
    assert batch.id not in [x.id for x in stranger.messages.batches.list().data]

    gone = claude.messages.batches.delete(batch.id)
    assert (gone.id, gone.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.batches.retrieve(batch.id)
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert batch.id not in [x.id for x in claude.messages.batches.list().data]
    with session_scope(stack.settings.sqlalchemy_url) as s:  # its jobs stay batch jobs (usage counts them so)
        assert s.get(Job, "job_" + b.id.removeprefix("msg_")).batch_id == batch.id


def test_cancel_a_message_batch(claude, stack):
    batch = claude.messages.batches.create(requests=[
        {"custom_id": f"long{i}", "params": params(f"Story {i}", max_tokens=200)} for i in range(3)])
    with pytest.raises(anthropic.ConflictError):  # in progress: cancel it first
        claude.messages.batches.delete(batch.id)
    early = httpx.get(f"{stack.url}/v1/messages/batches/{batch.id}/results", headers={"x-api-key": stack.keys.paid})
    assert early.status_code == 409 and early.json()["error"]["type"] == "conflict_error"
    canceling = claude.messages.batches.cancel(batch.id)
    assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at is not None
    done = ended(claude, batch.id)
    counts = done.request_counts
    assert counts.canceled >= 1 and counts.canceled + counts.succeeded == 3 and counts.processing == 0
    results = {r.custom_id: r.result.type for r in claude.messages.batches.results(batch.id)}
    assert sorted(results) == ["long0", "long1", "long2"]
    assert list(results.values()).count("canceled") == counts.canceled
    with pytest.raises(anthropic.ConflictError):
        claude.messages.batches.cancel(batch.id)
    assert claude.messages.batches.delete(batch.id).type == "message_batch_deleted"


def test_what_the_fan_out_would_refuse_is_errored_alone(claude, stack, monkeypatch):
    """A request without max_tokens, an unknown model, a metadata.user_id that is no string, a thinking budget the
    server cannot keep: each checked at create as /v1/messages checks it, and an ``errored`` result of its own, as
    Anthropic validates each request's params (they refused the whole batch with a 400)."""
    thinks = {"max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}}

    def errored(**bad: dict) -> dict[str, str]:
        batch = claude.messages.batches.create(requests=[{"custom_id": cid, "params": p} for cid, p in bad.items()])
        assert ended(claude, batch.id).request_counts.errored == len(bad)
        results = list(claude.messages.batches.results(batch.id))
        assert [r.custom_id for r in results] == list(bad) and {r.result.type for r in results} == {"errored"}
        assert {r.result.error.error.type for r in results} == {"invalid_request_error"}
        return {r.custom_id: r.result.error.error.message for r in results}

    no_max = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    found = errored(no_max=no_max, model=params("Hi", model="nope"), user=params("Hi", metadata={"user_id": 7}),
                    thinks=params("Hi", **thinks))
    assert "max_tokens" in found["no_max"] and "unknown model 'nope'" in found["model"], found
    assert "metadata.user_id" in found["user"] and "own torch engine" in found["thinks"], found  # the own engine's
    monkeypatch.setattr(stack.settings, "backend", "vllm")
    monkeypatch.setattr(stack.settings, "reasoning_parser", "qwen3")
    assert "thinking.budget_tokens needs a model whose tokenizer has <think>" in errored(thinks=params(
        "Hi", **thinks))["thinks"]
