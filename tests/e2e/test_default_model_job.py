"""End to end with the real default model (SmolLM2-135M-Instruct GGUF): HTTP -> Redis -> worker -> SQL."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from tests.conftest import Keys, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.integration]


def test_chat_job_with_default_model(settings, keys, start_worker):
    settings = settings.model_copy(update={"model": "smollm2-135m", "model_name": "smollm2-135m-instruct",
                                           "default_max_tokens": 24, "lease_seconds": 30.0})
    start_worker("w-default", COSERVE_MODEL="smollm2-135m", COSERVE_MODEL_NAME="smollm2-135m-instruct",
                 COSERVE_LEASE_SECONDS="30")
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/jobs", headers=Keys.header(keys.paid), json={
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
            "max_tokens": 24, "ttft_ms": 5000, "tbt_ms": 500})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        job = wait_for(lambda: (j := client.get(f"/v1/jobs/{job_id}", headers=Keys.header(keys.paid)).json())
                       ["status"] in ("succeeded", "failed") and j, 300, "the job to finish", interval=0.5)
    assert job["status"] == "succeeded", job
    assert "paris" in job["output_text"].lower(), job["output_text"]
    assert job["finish_reason"] in ("stop", "length") and 0 < job["completion_tokens"] <= 24
    assert job["metrics"]["ttft_s"] > 0
