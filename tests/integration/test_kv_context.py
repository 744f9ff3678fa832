"""A worker on the own engine whose KV cache holds less than the model's context (real migrated SQLite, the real
HTTP app, the worker's real engine built and registered in this process): it serves what its cache holds and says
so in its heartbeat, and the API refuses at submit, on every route, what it could never run, instead of accepting a
job the engine then has to refuse."""

from __future__ import annotations

import json

import pytest

from app.services import routing
from app.services.model_info import get_tokenizer
from tests.conftest import Keys, wait_for
from workers.gpu_worker import GpuWorker

pytestmark = pytest.mark.integration

H = Keys.header
KV_TOKENS = 8 * 16  # 8 KV blocks of 16 tokens: a quarter of the tiny model's 512-token context


@pytest.fixture
def short_kv_worker(settings, monkeypatch):
    monkeypatch.setattr(routing, "REFRESH_S", 0.0)  # the API reads the workers' heartbeats on every request
    settings.kv_blocks = KV_TOKENS // 16
    worker = GpuWorker(settings)
    worker.tokenizer = get_tokenizer(settings.model)
    worker.attach(worker._build_engine())
    worker._register()
    return worker


def test_the_api_holds_jobs_to_what_a_workers_kv_cache_holds(client, keys, settings, short_kv_worker):
    assert short_kv_worker.engine.executor.max_model_len == KV_TOKENS
    assert client.get(f"/v1/models/{settings.model_name}", headers=H(keys.paid)).json()["max_model_len"] == KV_TOKENS
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    r = client.post("/v1/jobs", json=chat | {"max_tokens": 200}, headers=H(keys.paid))
    assert r.status_code == 422 and f"maximum context length is {KV_TOKENS} tokens" in r.text, r.text
    r = client.post("/v1/chat/completions", json=chat | {"model": settings.model_name, "max_tokens": 200},
                    headers=H(keys.paid))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert client.post("/v1/jobs", json=chat | {"max_tokens": 16}, headers=H(keys.paid)).status_code == 201
    checks = client.get("/readyz").json()["checks"]
    assert f"serves a context of {KV_TOKENS} tokens" in checks["context_length"]
    assert "COSERVE_KV_BLOCKS" in checks["context_length"]

    def line(cid: str, max_tokens: int) -> str:
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                           "body": chat | {"max_tokens": max_tokens}})
    f = client.post("/v1/files", files={"file": ("in.jsonl", f"{line('fits', 2)}\n{line('never', 200)}\n")},
                    data={"purpose": "batch"}, headers=H(keys.paid)).json()
    b = client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                         "completion_window": "1h"}, headers=H(keys.paid)).json()
    b = wait_for(lambda: (x := client.get(f"/v1/batches/{b['id']}", headers=H(keys.paid)).json())["status"]
                 != "validating" and x, 30, "the batch's validation")
    assert b["request_counts"] == {"total": 2, "completed": 0, "failed": 1}, b
    from app.batch.fanout import invalid_path

    errors = [json.loads(t) for t in invalid_path(settings.data_dir, b["id"]).read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["never"]
    assert f"maximum context length is {KV_TOKENS} tokens" in errors[0]["error"]["message"], errors

    headers = {"x-api-key": keys.paid}
    params = {"model": settings.model_name, "messages": [{"role": "user", "content": "hi"}]}
    made = client.post("/v1/messages/batches", headers=headers, json={"requests": [
        {"custom_id": "fits", "params": params | {"max_tokens": 2}},
        {"custom_id": "never", "params": params | {"max_tokens": 200}}]})
    # a message batch's request whose max_tokens leaves its prompt no room in the context the worker serves is
    # errored, in Anthropic's words; the batch's other requests run
    assert made.status_code == 200, made.text
    client.post(f"/v1/messages/batches/{made.json()['id']}/cancel", headers=headers)
    results = [json.loads(t) for t in client.get(f"/v1/messages/batches/{made.json()['id']}/results",
                                                 headers=headers).text.splitlines()]
    assert [r["custom_id"] for r in results] == ["fits", "never"] and results[1]["result"]["type"] == "errored"
    assert f"> {KV_TOKENS}," in results[1]["result"]["error"]["error"]["message"], results
