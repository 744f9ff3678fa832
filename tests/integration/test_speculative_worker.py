"""A worker deployed with a speculation policy really speculates (draft on device, trees verified)."""

from __future__ import annotations

import pytest

from tests.conftest import Keys, wait_for
from tests.integration.test_worker import _worker_state, status_of

pytestmark = pytest.mark.integration


def test_worker_with_spec_policy_speculates(client, keys, settings, start_worker):
    start_worker("w-spec", COSERVE_SPEC_POLICY="adaserve", COSERVE_DRAFT="prompt-lookup")
    # a repetitive prompt: the prompt-lookup drafter finds n-gram matches to propose
    prompt = " ".join(["one two three four five"] * 12)
    r = client.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 32, "ignore_eos": True, "temperature": 0},
                    headers=Keys.header(keys.paid))
    assert r.status_code == 201, r.text
    job = wait_for(lambda: (j := status_of(client, keys.paid, r.json()["id"]))["status"] == "succeeded" and j,
                   90, "the job to finish")
    assert job["completion_tokens"] == 32
    state = wait_for(lambda: (s := _worker_state(settings, "w-spec")).get("speculation", {}).get("policy") and s,
                     30, "a heartbeat with the speculation state")
    # the model-free drafter holds no device memory; it is bound to the executor
    assert state["speculation"]["policy"] == "adaserve" and state["drafter"] == "PromptLookupDrafter"
