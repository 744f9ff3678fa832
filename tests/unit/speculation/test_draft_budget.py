"""The own engine tells its scheduler the draft tokens its decodes verify, as the vLLM adapter does: a step budget
(Sarathi's chunk size, vLLM's) and QoServe's pass time count them."""

from __future__ import annotations

from gpu_runtime.engine import Engine
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.qos import QoSClass, QoSSpec
from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.scheduler.registry import create_scheduler
from gpu_runtime.sim.acceptance import GeometricAcceptance
from gpu_runtime.speculation.registry import create_policy

from tests.unit.scheduler.helpers import COST


def _engine(scheduler: str, speculation: str, **config) -> Engine:
    ex = SimExecutor(COST, kv_blocks=1000, block_size=16, acceptance=GeometricAcceptance(), seed=0)
    engine = Engine(ex, create_scheduler(scheduler, cost_model=COST, executor=ex, **config), create_policy(speculation))
    qos = QoSSpec(QoSClass.INTERACTIVE, ttft_s=10.0, tbt_s=1.0)
    for i in range(3):
        engine.add_request(Request(f"d{i}", [1] * 8, SamplingParams(max_tokens=50, ignore_eos=True), qos, 0.0))
    return engine


def test_the_decodes_verified_drafts_take_their_share_of_the_next_step_budget():
    engine = _engine("sarathi-fcfs", "chain-2", chunk_size=40)
    while engine.last_stats.num_tree_tokens < 6:  # the three prompts done, each decode verifies a 2-token chain
        engine.step()
    engine.add_request(Request("p", [1] * 500, SamplingParams(max_tokens=4, ignore_eos=True),
                               QoSSpec(QoSClass.INTERACTIVE, ttft_s=10.0, tbt_s=1.0), engine.executor.now()))
    engine.step()
    assert engine.scheduler.decode_drafts == {"d0": 2, "d1": 2, "d2": 2}
    # 40 tokens: 3 decodes and their 6 drafts first, the prompt's chunk the rest (it took 40 - 3 before)
    assert engine.last_stats.prefill_budget == engine.last_stats.num_prefill_tokens == 40 - 3 - 6
    assert engine.last_stats.num_tree_tokens == 6


def test_without_speculation_the_scheduler_hears_of_no_drafts():
    engine = _engine("sarathi-fcfs", "none", chunk_size=40)
    for _ in range(3):
        engine.step()
    assert engine.scheduler.decode_drafts == {} and engine.scheduler.step_drafts == 0
