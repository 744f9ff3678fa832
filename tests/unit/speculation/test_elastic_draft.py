"""Elastic draft memory and switch cost outside the torch path: the simulated draft holds
KV blocks that return to the pool on offload, Nightjar leaves model-free drafts alone,
the engine hands each request's category to the simulator, and AdaServe's B shares the
pass with prefill chunks."""

from __future__ import annotations

import random

import pytest

from gpu_runtime.costmodel.linear import PiecewiseLinearCostModel
from gpu_runtime.engine import Engine
from gpu_runtime.executor.base import BatchPlan, DecodeEntry, DraftEntry, PrefillChunk, StepResult
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.qos import QoSClass, QoSSpec
from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.scheduler.registry import create_scheduler
from gpu_runtime.sim.acceptance import GeometricAcceptance
from gpu_runtime.speculation.adaserve import AdaServe
from gpu_runtime.speculation.nightjar import Nightjar, NightjarConfig
from gpu_runtime.speculation.registry import create_policy

from .conftest import make_request

COST = PiecewiseLinearCostModel([0.010, 0.0, 1e-4, 0.0, 0.0, 0.0], 0.0)


def test_sim_draft_blocks_join_the_pool_on_offload_and_leave_on_load():
    ex = SimExecutor(COST, kv_blocks=100, block_size=16, acceptance=GeometricAcceptance(), draft_blocks=30)
    assert ex.draft_offloadable and ex.draft_on_device and ex.capacity().total_blocks == 100
    assert ex.offload_draft() == 30
    assert not ex.draft_on_device and not ex.has_draft and ex.capacity().total_blocks == 130
    assert ex.offload_draft() == 0  # already off
    ex.add_request("a", SamplingParams())
    ex.step(BatchPlan([PrefillChunk("a", 0, [1] * (16 * 125), sample=True)]))  # reaches into the grown ids
    assert not ex.load_draft() and ex.capacity().total_blocks == 130  # those blocks are live: stay off
    ex.free("a")
    assert ex.load_draft() and ex.draft_on_device and ex.capacity().total_blocks == 100


def test_sim_without_draft_memory_is_not_elastic():
    ex = SimExecutor(COST, kv_blocks=50, acceptance=GeometricAcceptance())
    assert not ex.draft_offloadable
    assert ex.offload_draft() == 0 and ex.draft_on_device and ex.capacity().total_blocks == 50


def test_sim_charges_draft_catch_up_after_skipped_steps():
    ex = SimExecutor(COST, kv_blocks=100, block_size=16, acceptance=GeometricAcceptance(), draft_cost_s=0.001)
    assert ex.draft_switch_cost(0, 4) == 0.0
    assert ex.draft_switch_cost(64, 4) > ex.draft_switch_cost(8, 4) > 0.0
    ex.add_request("a", SamplingParams())
    ex.step(BatchPlan([PrefillChunk("a", 0, [1] * 8, sample=True)]))
    synced = ex.draft([DraftEntry("a", 2, 1)]).latency_s
    assert synced == pytest.approx(0.002)
    pos = 8
    for _ in range(5):  # five plain decode steps: the draft falls behind by five tokens
        ex.step(BatchPlan(decodes=[DecodeEntry("a", pos, 7)]))
        pos += 1
    lagging = ex.draft([DraftEntry("a", 2, 1)]).latency_s
    assert lagging == pytest.approx(0.002 + ex.draft_switch_cost(5, 1))


class _ModelFreeExecutor:
    """A drafter with no device memory (prompt lookup): always on, nothing to offload."""

    draft_on_device = True
    draft_offloadable = False
    has_draft = True

    def __init__(self) -> None:
        self.offload_calls = self.load_calls = 0

    def capacity(self):
        from gpu_runtime.executor.base import KVCapacity

        return KVCapacity(100, 1, 16)  # memory pressure

    def offload_draft(self) -> int:
        self.offload_calls += 1
        return 0

    def load_draft(self) -> bool:
        self.load_calls += 1
        return True

    def draft_switch_cost(self, l_max: int, batch: int) -> float:
        return 0.0


def test_nightjar_never_offloads_a_model_free_draft():
    ex = _ModelFreeExecutor()
    pol = Nightjar(NightjarConfig(persist_steps=1))
    pol.bind(ex)
    pol.gamma = 0
    for waiting in (5, 5, 0, 0):
        pol.maintain(ex, num_waiting=waiting)
    assert ex.offload_calls == 0 and ex.load_calls == 0 and pol.offloads == 0 and pol.reloads == 0
    reqs = [make_request("a"), make_request("b")]
    seen = set()
    for _ in range(8):  # untried arms first: gamma > 0 gets played, the draft is never forced off
        entries = pol.draft_plan(reqs, 0.0)
        seen.add(entries[0].depth if entries else 0)
        pol.observe(reqs, {}, StepResult(latency_s=0.01), 0.0, 0.0)
    assert max(seen) > 0


def test_nightjar_switch_cost_falls_back_to_online_estimate_when_unknown():
    pol = Nightjar(switch_cost=lambda l_max, batch: None)
    pol._lag_cost.update(0.002)
    assert pol._c_prefill(10, 4) == pytest.approx(0.02)
    assert Nightjar(switch_cost=lambda l_max, batch: 0.5)._c_prefill(10, 4) == 0.5


def test_nightjar_binds_the_sim_executor_switch_cost():
    ex = SimExecutor(COST, acceptance=GeometricAcceptance(), draft_cost_s=0.001)
    pol = Nightjar()
    pol.bind(ex)
    assert pol._c_prefill(32, 2) == pytest.approx(ex.draft_switch_cost(32, 2)) and pol._c_prefill(32, 2) > 0


def test_engine_passes_the_request_category_to_the_simulator():
    ex = SimExecutor(COST, kv_blocks=1000, acceptance=GeometricAcceptance())
    engine = Engine(ex, create_scheduler("qoserve", cost_model=COST, executor=ex), create_policy("chain-2"))
    qos = QoSSpec(QoSClass.INTERACTIVE, ttft_s=10.0, tbt_s=1.0)
    engine.add_request(Request("r", [1] * 8, SamplingParams(max_tokens=4, ignore_eos=True), qos, 0.0,
                               app_id="summarization"))
    engine.step()
    assert ex.categories["r"] == "summarization"


def test_adaserve_budget_shares_the_pass_with_prefill_chunks_when_configured():
    pol = AdaServe(budget=40, budget_shares_prefill=True)
    reqs = [make_request(f"r{i}") for i in range(4)]
    pol.draft_plan(reqs, 0.0)
    assert pol.state()["budget"] == 40
    pol.prefill_tokens_in_pass = 30
    pol.draft_plan(reqs, 0.0)
    assert pol.state()["budget"] == 10
    pol.prefill_tokens_in_pass = 64
    assert pol.draft_plan(reqs, 0.0) == []  # nothing left beyond the roots: plain decoding
    pol = AdaServe(budget=40)  # default: B is the decodes' own, whatever the chunk
    pol.prefill_tokens_in_pass = 30
    pol.draft_plan(reqs, 0.0)
    assert pol.state()["budget"] == 40


def test_sim_nightjar_offloads_under_pressure_in_the_engine():
    """End to end in simulation: speculation off and the pool nearly full -> the draft's
    blocks join the pool (more KV visible to the scheduler), then come back when idle."""
    ex = SimExecutor(COST, kv_blocks=40, block_size=16, acceptance=GeometricAcceptance(), draft_blocks=10)
    pol = create_policy("nightjar", max_gamma=0, tau_low=0.5, persist_steps=2)
    engine = Engine(ex, create_scheduler("qoserve", cost_model=COST, executor=ex), pol)
    qos = QoSSpec(QoSClass.INTERACTIVE, ttft_s=100.0, tbt_s=10.0)
    rng = random.Random(0)
    for i in range(6):
        engine.add_request(Request(f"r{i}", [1] * rng.randrange(60, 90), SamplingParams(max_tokens=24, ignore_eos=True),
                                   qos, 0.0))
    grew = False
    steps = 0
    while engine.has_work and steps < 2000:
        engine.step()
        grew = grew or ex.capacity().total_blocks == 50
        steps += 1
    assert pol.offloads >= 1 and grew
    for _ in range(3):
        engine.step()
    assert ex.draft_on_device and pol.reloads >= 1 and ex.capacity().total_blocks == 40
