"""A structured output that reaches the API by a path ``CheckedRoute`` does not see in the body (a batch's input
file, a message batch's requests, a Messages request's ``output_config.format``) is checked with the backends the
live workers' engines publish, as one a route sees is: a worker on guidance serves ``\\p{L}`` and refuses a schema's
``not``, and each line or request is judged so (the refused ones get their own error, the rest their jobs)."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from app.batch.finalize import invalid_path
from app.db.models import Job, WorkerState
from app.db.session import session_scope
from tests.conftest import Keys

pytestmark = pytest.mark.integration

_NOT = {"type": "object", "properties": {"name": {"type": "string", "not": {"const": "x"}}}}  # guidance refuses not
_LETTERS = {"type": "object", "properties": {"name": {"type": "string", "pattern": r"[\p{L} ]+"}}}  # guidance reads


@pytest.fixture
def guidance_worker(settings, monkeypatch) -> None:
    """A live worker of the model whose engine compiles with guidance, as its heartbeat's row says."""
    from app.services import routing

    monkeypatch.setattr(routing, "REFRESH_S", 0.0)  # read the workers on every request here
    settings.backend = "vllm"
    with session_scope(settings.sqlalchemy_url) as s:
        s.add(WorkerState(id="w-guidance", model=settings.model_name, queue="q", device="cpu",
                          state={"served": [settings.model_name], "grammar_backend": "guidance"}))


def _refused(settings, batch_id: str) -> dict[str, str]:
    """The batch's refused lines: custom_id -> the error's message."""
    lines = invalid_path(settings.data_dir, batch_id).read_text().splitlines()
    return {(row := json.loads(line))["custom_id"]: json.dumps(row["response"] or row["error"]) for line in lines}


def _job_ids(settings, batch_id: str) -> set[str]:
    with session_scope(settings.sqlalchemy_url) as s:
        return set(s.scalars(select(Job.custom_id).where(Job.batch_id == batch_id)))


def test_a_batch_line_is_checked_with_the_backend_the_live_workers_publish(client, keys, settings, guidance_worker):
    lines = [{"custom_id": "letters", "body": {"structured_outputs": {"regex": r"\p{L}+"}}},
             {"custom_id": "not", "body": {"response_format": {"type": "json_schema",
                                                               "json_schema": {"name": "n", "schema": _NOT}}}}]
    content = "\n".join(json.dumps({"custom_id": line["custom_id"], "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": settings.model_name, "max_tokens": 2,
                                             "messages": [{"role": "user", "content": "Hi"}], **line["body"]}})
                        for line in lines)
    upload = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                         files={"file": ("in.jsonl", content.encode())}).json()
    batch = client.post("/v1/batches", headers=Keys.header(keys.paid), json={  # fans out before it answers
        "input_file_id": upload["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    assert _job_ids(settings, batch["id"]) == {"letters"}, _refused(settings, batch["id"])
    refused = _refused(settings, batch["id"])
    assert list(refused) == ["not"] and "Unimplemented keys" in refused["not"] and "under guidance" in refused["not"]


def test_a_message_batch_request_is_checked_with_the_backend_the_live_workers_publish(client, keys, settings,
                                                                                        guidance_worker):
    made = client.post("/v1/messages/batches", headers={"x-api-key": keys.paid}, json={"requests": [
        {"custom_id": name, "params": {"model": settings.model_name, "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "Hi"}],
                                       "output_config": {"format": {"type": "json_schema", "schema": schema}}}}
        for name, schema in (("letters", _LETTERS), ("not", _NOT))]})
    assert made.status_code == 200, made.text
    assert _job_ids(settings, made.json()["id"]) == {"letters"}, _refused(settings, made.json()["id"])
    refused = _refused(settings, made.json()["id"])
    assert list(refused) == ["not"] and "Unimplemented keys" in refused["not"] and "under guidance" in refused["not"]


def test_a_messages_output_format_is_checked_with_the_backend_the_live_workers_publish(client, keys, settings,
                                                                                        guidance_worker):
    r = client.post("/v1/messages", headers={"x-api-key": keys.paid}, json={
        "model": settings.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
        "output_config": {"format": {"type": "json_schema", "schema": _NOT}}})
    assert r.status_code == 400, r.text
    assert "Unimplemented keys" in r.text and "under guidance" in r.text and "output_config.format" in r.text, r.text
