"""A batch create retried under its Idempotency-Key (the official SDKs retry a POST whose connection dropped, and on
5xx/429) answers the batch the first one made, uncharged, as ``/v1/jobs`` and ``/v1/summarize`` do: one batch runs
its lines once. A different body under the key is a 409; keys are each tenant's own; the key outlives the app (it is
in the SQL store). The real app, Redis and SQLite; no worker (TestClient runs the fan-out before it answers)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from app.auth import clear_cache
from app.db.models import Batch
from app.db.session import session_scope, write_guard
from app.main import create_app
from app.services.transitions import utcnow
from tests.conftest import Keys

pytestmark = pytest.mark.integration


def _input_file(client, key: str, prompt: str = "Hi") -> str:
    line = json.dumps({"custom_id": "c0", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": prompt, "max_tokens": 2}})
    made = client.post("/v1/files", headers=Keys.header(key), data={"purpose": "batch"},
                       files={"file": ("in.jsonl", line)})
    assert made.status_code == 200, made.text
    return made.json()["id"]


def _create(client, key: str, file_id: str, idempotency_key: str, window: str = "24h"):
    return client.post("/v1/batches", headers={**Keys.header(key), "Idempotency-Key": idempotency_key},
                       json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": window})


def _requests_a_minute(client, keys, limit: int) -> None:
    limited = client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": limit},
                           headers=Keys.header(keys.admin))
    assert limited.status_code == 200, limited.text


def _listed(client, key: str) -> list[str]:
    return [b["id"] for b in client.get("/v1/batches", headers=Keys.header(key)).json()["data"]]


def test_a_retried_batch_create_answers_the_first_batch_uncharged(client, keys):
    """The retry's answer is the first batch (200), the list shows one batch, and the retry takes nothing from the
    tenant's one request per minute, which the first create used up."""
    _requests_a_minute(client, keys, 1)
    file_id = _input_file(client, keys.paid)
    first = _create(client, keys.paid, file_id, "batch-1")
    assert first.status_code == 200, first.text
    again = _create(client, keys.paid, file_id, "batch-1")
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    assert _listed(client, keys.paid) == [first.json()["id"]]


def test_another_body_under_a_batch_key_is_a_409_and_keys_are_each_tenants(client, keys):
    file_id = _input_file(client, keys.paid)
    first = _create(client, keys.paid, file_id, "batch-2")
    other = _create(client, keys.paid, file_id, "batch-2", window="2h")
    assert other.status_code == 409, other.text
    said = other.json()["error"]["message"]
    assert "use a new key" in said and first.json()["id"] in said, said
    theirs = _create(client, keys.other, _input_file(client, keys.other), "batch-2")
    assert theirs.status_code == 200 and theirs.json()["id"] != first.json()["id"], theirs.text
    assert _listed(client, keys.paid) == [first.json()["id"]]
    assert _listed(client, keys.other) == [theirs.json()["id"]]


def test_a_batch_key_outlives_the_app(client, keys, settings):
    """A retry that reaches an API process started since (a restart, another replica) still finds the batch."""
    file_id = _input_file(client, keys.paid)
    first = _create(client, keys.paid, file_id, "batch-3")
    clear_cache()
    with TestClient(create_app(settings)) as restarted:
        again = _create(restarted, keys.paid, file_id, "batch-3")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"], again.text


def _message_batch(client, key: str, idempotency_key: str, content: str = "Hi"):
    return client.post("/v1/messages/batches", headers={"x-api-key": key, "Idempotency-Key": idempotency_key},
                       json={"requests": [{"custom_id": "r0", "params": {
                           "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}}]})


def _message_batches(client, key: str) -> list[str]:
    return [b["id"] for b in client.get("/v1/messages/batches", headers={"x-api-key": key}).json()["data"]]


def test_a_retried_message_batch_create_answers_the_first_batch_uncharged(client, keys):
    _requests_a_minute(client, keys, 2)  # the create, then the list: a retry charged would leave the list a 429
    first = _message_batch(client, keys.paid, "mb-1")
    assert first.status_code == 200, first.text
    again = _message_batch(client, keys.paid, "mb-1")
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    assert _message_batches(client, keys.paid) == [first.json()["id"]]


def test_another_message_batch_under_its_key_is_a_409_and_keys_are_each_tenants(client, keys):
    first = _message_batch(client, keys.paid, "mb-2")
    other = _message_batch(client, keys.paid, "mb-2", content="Hello")
    assert other.status_code == 409, other.text
    assert other.json()["type"] == "error" and "use a new key" in other.json()["error"]["message"], other.text
    theirs = _message_batch(client, keys.other, "mb-2")
    assert theirs.status_code == 200 and theirs.json()["id"] != first.json()["id"], theirs.text
    assert _message_batches(client, keys.paid) == [first.json()["id"]]
    assert _message_batches(client, keys.other) == [theirs.json()["id"]]


def test_batches_made_in_one_instant_page_once_each_in_id_order(client, keys, settings):
    """OpenAI lists batches newest first; those created at the same time (ties) come by id, and ``after`` pages on
    through every one of them once."""
    file_id = _input_file(client, keys.paid)
    made = [client.post("/v1/batches", headers=Keys.header(keys.paid), json={
        "input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}).json()["id"]
        for _ in range(5)]
    with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
        s.execute(update(Batch).where(Batch.id.in_(made)).values(created_at=utcnow() - timedelta(seconds=1)))
    seen, after = [], None
    while True:
        page = client.get("/v1/batches", headers=Keys.header(keys.paid),
                          params={"limit": 2, **({"after": after} if after else {})}).json()
        seen += [b["id"] for b in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == sorted(made, reverse=True)


def test_a_retried_create_of_a_deleted_message_batch_is_a_409_saying_it_was_deleted(client, keys):
    """The batch made under the key was deleted since: the retry answered it with 200, a batch that every other route
    (retrieve, list, results) says does not exist. The retry cannot run the requests again (a second batch) nor
    answer a gone one: a 409 saying the batch was deleted and to use a new key for a new batch."""
    headers = {"x-api-key": keys.paid}
    first = _message_batch(client, keys.paid, "mb-del").json()
    assert client.post(f"/v1/messages/batches/{first['id']}/cancel", headers=headers).status_code == 200
    assert client.delete(f"/v1/messages/batches/{first['id']}", headers=headers).status_code == 200
    again = _message_batch(client, keys.paid, "mb-del")
    assert again.status_code == 409, again.text
    error = again.json()
    assert error["type"] == "error", error  # Anthropic's shape
    assert "deleted" in error["error"]["message"] and "use a new key" in error["error"]["message"], error
    assert _message_batches(client, keys.paid) == []


def test_a_key_used_by_one_batch_api_is_a_409_in_the_others_terms(client, keys):
    """One key per tenant across ``POST /v1/batches`` and ``POST /v1/messages/batches``: another API's create under
    it is another request, a 409 in the shape of the API asked (OpenAI's ``error.code``, Anthropic's ``type``)."""
    made = _message_batch(client, keys.paid, "shared")
    assert made.status_code == 200, made.text
    openai = _create(client, keys.paid, _input_file(client, keys.paid), "shared")
    assert openai.status_code == 409 and openai.json()["error"]["code"] == "idempotency_key_reused", openai.text
    batch = _create(client, keys.paid, _input_file(client, keys.paid), "shared-2")
    assert batch.status_code == 200, batch.text
    anthropic = _message_batch(client, keys.paid, "shared-2")
    assert anthropic.status_code == 409 and anthropic.json()["type"] == "error", anthropic.text
