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


def test_the_own_engines_speculation_is_vllms_spec_decode_counters_on_metrics(client, keys, settings, start_worker):
    """A dashboard built for vLLM graphs speculation from vllm:spec_decode_num_drafts, _num_draft_tokens,
    _num_accepted_tokens and _num_accepted_tokens_per_pos (acceptance rate, mean acceptance length, per position):
    a worker on the own engine that speculated published none of them (vLLM's workers do). It now counts its
    engine's verified drafts as vLLM's scheduler does, and the API's /metrics carries them, labelled with the worker."""
    from prometheus_client.parser import text_string_to_metric_families

    start_worker("w-spec", COSERVE_SPEC_POLICY="chain-4", COSERVE_DRAFT="prompt-lookup")
    prompt = " ".join(["one two three four five"] * 12)
    r = client.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 32, "ignore_eos": True, "temperature": 0},
                    headers=Keys.header(keys.paid))
    assert r.status_code == 201, r.text
    assert wait_for(lambda: status_of(client, keys.paid, r.json()["id"])["status"] == "succeeded", 90, "the job")

    def spec() -> dict:
        text = client.get("/metrics", headers=Keys.header(keys.admin)).text
        return {(f.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(text)
                if f.name.startswith("vllm:spec_decode_") for s in f.samples
                if s.name.endswith("_total") and s.labels.get("worker_id") == "w-spec"
                and s.labels.get("model_name") == settings.model_name and s.labels.get("engine") == "0"}
    got = wait_for(lambda: (c := spec()).get(("vllm:spec_decode_num_accepted_tokens", None)) and c, 30,
                   "the worker's spec decode counters on /metrics")
    drafts, drafted = got[("vllm:spec_decode_num_drafts", None)], got[("vllm:spec_decode_num_draft_tokens", None)]
    accepted = got[("vllm:spec_decode_num_accepted_tokens", None)]
    per_pos = [v for _pos, v in sorted((int(pos), v) for (name, pos), v in got.items()
                                       if name == "vllm:spec_decode_num_accepted_tokens_per_pos")]
    assert 0 < drafts <= drafted <= 4 * drafts and 0 < accepted <= drafted, got
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= drafts, got
