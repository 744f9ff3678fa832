"""ops/bench_prefix_reuse.py's simulated runs: the same conversations load through the simulator, with its model
of vLLM's prefix cache and without it (what the simulator priced before it had one)."""

from __future__ import annotations

import argparse

import pytest

from tests.conftest import ops_script

PROFILE = "cpu-avx512-smollm2-135m-vllm"
ENGINE = {"block_size": 128, "kv_blocks": 727, "max_num_batched_tokens": 2048, "max_num_seqs": 128}


@pytest.fixture(scope="module")
def bench():
    return ops_script("bench_prefix_reuse")


@pytest.mark.parametrize("policy", ["qoserve", "vllm-fcfs"])
def test_conversations_behind_one_system_prompt_find_it_cached_in_simulation(bench, policy):
    load = argparse.Namespace(conversations=12, turns=2, system=512, user=64, answer=16, think_s=0.5,
                              stagger_s=0.0, fresh_qps=0.5, fresh_len=256, fresh_minutes=0.3, ttft_s=2.0, tbt_s=0.5,
                              seed=0)
    measured = {"policy": policy, "engine": ENGINE}
    cached = bench.summary(bench.simulate_one(load, measured, PROFILE, prefix_cache=True))
    whole = bench.summary(bench.simulate_one(load, measured, PROFILE, prefix_cache=False))
    assert cached["n"] == whole["n"] == 12 * 2 + cached["fresh"][2] and cached["fresh"][2] > 0
    # later turns find their conversation so far cached (prompt and answer blocks), first turns the system prompt
    assert cached["cached"] > 0.5 and whole["cached"] == 0.0
    assert cached["later turn"][0] < whole["later turn"][0]  # TTFT p50 of the turns the cache holds


def test_tenants_reuse_only_their_own_cached_prompts_unless_the_cache_is_shared(bench):
    """--tenants with the worker's per-tenant cache (vLLM's cache_salt): each tenant computes the system prompt
    once; with --cache-scope shared one tenant's blocks serve all."""
    def run(scope: str) -> dict:
        load = argparse.Namespace(conversations=8, turns=1, system=512, user=64, answer=8, think_s=0.5,
                                  stagger_s=1.0, fresh_qps=0.0, fresh_len=256, fresh_minutes=0.0, ttft_s=2.0,
                                  tbt_s=0.5, seed=0, tenants=4, cache_scope=scope)
        return bench.simulate_one(load, {"policy": "vllm-fcfs", "engine": ENGINE}, PROFILE, prefix_cache=True)

    def misses(run: dict) -> int:
        return sum(r["cached"] == 0 for r in run["requests"])

    assert misses(run("shared")) == 1 and misses(run("tenant")) == 4  # the system prompt: once, once per tenant
