"""A batch's and a background response's end reach the tenant's webhook endpoint: real app, Redis, Celery worker
(whose webhook thread sends them), SQLite, and a real HTTP receiver; the official client checks the signature."""

from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def test_a_finished_batch_is_announced_to_the_endpoint(live_server, keys, start_worker, webhook_receiver):
    start_worker("w1")
    oai = openai.OpenAI(base_url=live_server + "/v1", api_key=keys.paid, max_retries=0, timeout=60)
    hook = oai.webhooks.create(event_types=["batch.completed", "batch.failed"], name="pipeline",
                               url=webhook_receiver.url)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}}
    src = oai.files.create(file=("in.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = oai.batches.create(input_file_id=src.id, endpoint="/v1/chat/completions", completion_window="1h")
    bad = oai.files.create(file=("bad.jsonl", b'{"custom_id": "x"}\n{"custom_id": "x"}\n'), purpose="batch")
    failed = oai.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="1h")

    def events():
        return {e.data.id: e for e in (oai.webhooks.unwrap(b, h, secret=hook.signing_secret)
                                       for b, h in webhook_receiver.received)}

    got = wait_for(lambda: e if {batch.id, failed.id} <= set(e := events()) else None, 60,
                   "both batches' events at the endpoint")
    assert got[batch.id].type == "batch.completed" and oai.batches.retrieve(batch.id).status == "completed"
    assert got[failed.id].type == "batch.failed"
    assert len(webhook_receiver.received) == 2  # once each


def test_a_background_response_is_announced_when_it_ends(live_server, keys, start_worker, webhook_receiver):
    start_worker("w1")
    oai = openai.OpenAI(base_url=live_server + "/v1", api_key=keys.paid, max_retries=0, timeout=60)
    hook = oai.webhooks.create(event_types=["response.completed", "response.incomplete", "response.failed"],
                               name="responses", url=webhook_receiver.url)
    shown = oai.responses.create(model="tiny", input="Hi", max_output_tokens=4)  # not background: no event
    late = oai.responses.create(model="tiny", input="Hi", max_output_tokens=4, background=True)
    event = wait_for(lambda: webhook_receiver.received and oai.webhooks.unwrap(*webhook_receiver.received[0],
                                                                                  secret=hook.signing_secret),
                     60, "the background response's event")
    done = oai.responses.retrieve(late.id)
    assert event.data.id == late.id and event.type == f"response.{done.status}", (event, done.status)
    assert shown.id != late.id and len(webhook_receiver.received) == 1
