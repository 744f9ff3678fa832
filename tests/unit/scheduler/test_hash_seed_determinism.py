"""The policies schedule the same load the same way in every process: nothing they decide or report follows
Python's per-process string hashing (the iteration order of a set of request ids).

Each policy runs a simulated load (the simulator's replica loop: Engine + SimExecutor) in subprocesses under
different PYTHONHASHSEEDs, and every step's schedule (prefill chunks in order, decodes, paused, released, relegated
and resumed requests) must be the same in all of them. The load comes in bursts of identical requests (same arrival,
QoS and prompt) into a small KV cache after one-token answers of their app (so the KV the policy reserved for their
predicted answers runs out): the ties the policies break are met, among started prompts that continue or are paused
and among recompute victims.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_runtime.qos import QoSClass, QoSSpec, Tier
from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[3]
HASH_SEEDS = ("1", "2", "3")
POLICIES = ("qoserve", "sarathi-edf", "sarathi-fcfs", "vllm-v1-fcfs", "vllm-v1-priority")
LOADS = 6  # loads per policy (seeds of the load generator)
LAX = QoSSpec(QoSClass.INTERACTIVE, Tier.FREE, ttft_s=20.0, tbt_s=0.5)
# small steps: long prompts take several, so started prompts are paused for more urgent ones and continue later
STEP = {"qoserve": {"chunk_ceiling": 64}, "sarathi-edf": {"chunk_size": 64}, "sarathi-fcfs": {"chunk_size": 64},
        "vllm-v1-fcfs": {"max_num_batched_tokens": 64}, "vllm-v1-priority": {"max_num_batched_tokens": 64}}


def _load(seed: int) -> tuple[int, list[Request]]:
    """KV blocks of the replica, and bursts of identical requests (ties by construction)."""
    rnd = random.Random(seed)
    # one-token answers first: the app's predicted length is short, so the KV reserved for the later jobs (their
    # prompt and predicted output) runs out while they decode, and the policy releases some (recompute)
    reqs = [Request(f"r{i}", [1] * 16, SamplingParams(max_tokens=1, ignore_eos=True), LAX, 0.0, app_id="chat")
            for i in range(3)]
    t = 1.0
    for _ in range(rnd.randint(6, 14)):
        t += rnd.choice([0.0, 0.005, 0.02, 0.1])
        tier = rnd.choice([Tier.FREE, Tier.PAID])
        if rnd.random() < 0.6:
            qos = QoSSpec(QoSClass.INTERACTIVE, tier, ttft_s=rnd.choice([0.05, 0.5, 5.0]),
                          tbt_s=rnd.choice([0.02, 0.1]))
        else:
            qos = QoSSpec(QoSClass.BATCH, tier, ttlt_s=rnd.choice([1.0, 30.0]))
        prompt, max_tokens = rnd.choice([16, 40, 64, 100, 160]), rnd.choice([4, 20, 40])
        for _ in range(rnd.randint(1, 6)):
            reqs.append(Request(f"r{len(reqs)}", [1] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                qos, t, app_id="chat"))
    return rnd.choice([14, 20, 40]), reqs


def schedules(policy: str, seed: int) -> list:
    """Every step's schedule of ``policy`` over load ``seed`` in the simulator, as request ids in output order."""
    from gpu_runtime.sim.simulator import Simulator, make_replica
    from tests.unit.scheduler.helpers import COST

    blocks, reqs = _load(seed)
    replica = make_replica("r", policy, COST, kv_blocks=blocks, max_num_seqs=8, **STEP[policy])
    scheduler, steps = replica.engine.scheduler, []
    plan = scheduler.schedule

    def recorded(now: float):  # noqa: ANN202 - the policy's SchedulerOutput
        out = plan(now)
        steps.append([[(p.request.request_id, p.num_tokens) for p in out.prefills]]
                     + [[r.request_id for r in rs] for rs in (out.decodes, out.preempted, out.recomputed,
                                                              out.relegated, out.resumed, out.expired)])
        return out

    scheduler.schedule = recorded
    Simulator([replica]).run(reqs)
    return steps


def _run_under(hash_seed: str, policies: tuple[str, ...]) -> subprocess.Popen:
    code = ("import json, sys; from tests.unit.scheduler.test_hash_seed_determinism import schedules, LOADS; "
            "json.dump({p: [schedules(p, s) for s in range(LOADS)] for p in sys.argv[1:]}, sys.stdout)")
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *policies], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_the_loads_reach_the_policies_choices_among_equals():
    """The ground of the test below, pinned: its loads run chunks of several prompts in a step, pause started prompts
    (QoServe), release KV (recompute) and relegate."""
    seen = {"chunks in a step": 0, "paused": 0, "released": 0, "relegated": 0}
    for seed in range(LOADS):
        for step in schedules("qoserve", seed):
            seen["chunks in a step"] += len(step[0]) > 1
            seen["paused"] += len(step[2]) > 0
            seen["released"] += len(step[3]) > 0
            seen["relegated"] += len(step[4]) > 0
    assert all(seen.values()), seen


def test_every_policy_schedules_the_same_load_the_same_way_under_any_hash_seed():
    procs = {h: _run_under(h, POLICIES) for h in HASH_SEEDS}  # in parallel: a process each
    runs = {}
    for h, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        runs[h] = json.loads(out)
    first = runs[HASH_SEEDS[0]]
    for h in HASH_SEEDS[1:]:
        for policy in POLICIES:
            for seed, (a, b) in enumerate(zip(first[policy], runs[h][policy], strict=True)):
                step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                assert a == b, (f"{policy}, load {seed}: PYTHONHASHSEED {HASH_SEEDS[0]} and {h} differ from step "
                                f"{step}", None if step is None else (a[step], b[step]))


@pytest.mark.parametrize("policy", ["qoserve", "sarathi-edf"])
def test_a_load_schedules_the_same_way_twice_in_one_process(policy):
    # the same process: what the subprocess test compares is the load's schedule, not noise of the simulation
    assert schedules(policy, 0) == schedules(policy, 0)
