"""End to end with the real default model (SmolLM2-135M-Instruct) on a worker: a native job over HTTP -> Redis ->
worker -> SQL, and the official openai client, streamed and not."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import Keys, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.model]


@pytest.fixture
def settings(tmp_path, db_url, redis_url):
    from app.settings import Settings

    return Settings(data_dir=tmp_path, database_url=db_url, REDIS_URL=redis_url, model="smollm2-135m",
                    model_name="smollm2-135m-instruct", device="cpu", lease_seconds=10.0, heartbeat_seconds=0.5,
                    sweep_seconds=1.0, default_max_tokens=32)


def test_default_model_answers_a_job_and_the_openai_client(live_server, keys, start_worker):
    start_worker("w1", COSERVE_KV_BLOCKS="512")
    question = "What is the capital of France? Answer in one word."
    r = httpx.post(f"{live_server}/v1/jobs", headers=Keys.header(keys.paid), json={
        "messages": [{"role": "user", "content": question}], "max_tokens": 24, "ttft_ms": 5000, "tbt_ms": 500})
    assert r.status_code == 201, r.text
    url = f"{live_server}/v1/jobs/{r.json()['id']}"
    job = wait_for(lambda: (j := httpx.get(url, headers=Keys.header(keys.paid)).json())["status"]
                   in ("succeeded", "failed") and j, 300, "the job to finish", interval=0.5)
    assert job["status"] == "succeeded", job
    assert "paris" in job["output_text"].lower(), job["output_text"]
    assert job["finish_reason"] in ("stop", "length") and 0 < job["completion_tokens"] <= 24
    assert job["metrics"]["ttft_s"] > 0

    oai = openai.OpenAI(base_url=live_server + "/v1", api_key=keys.paid, max_retries=0, timeout=300)
    messages = [{"role": "user", "content": question}]
    full = oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12,
                                       temperature=0)
    text = full.choices[0].message.content
    assert "Paris" in text, text
    assert full.choices[0].finish_reason in ("stop", "length") and full.usage.completion_tokens <= 12
    stream = oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
