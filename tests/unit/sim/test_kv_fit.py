"""A request that can never fit the simulated replica's KV cache is refused at admission, as vLLM refuses one longer
than its max_model_len (which must fit its KV cache), instead of being admitted and waiting forever."""

import pytest

from gpu_runtime.costmodel.linear import PiecewiseLinearCostModel
from gpu_runtime.engine import Engine
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.qos import QoSClass, QoSSpec
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.scheduler.registry import create_scheduler
from gpu_runtime.sim.metrics import summarize
from gpu_runtime.sim.simulator import Simulator, make_replica

COST = PiecewiseLinearCostModel([0.010, 0.0, 1e-4, 0.0, 0.0, 0.0], 0.0)


def batch_request(rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   QoSSpec(QoSClass.BATCH, ttlt_s=1e6), arrival_time=arrival)


def test_the_sim_executor_serves_no_longer_context_than_its_kv_cache_holds():
    assert SimExecutor(COST, kv_blocks=4, block_size=16).max_model_len == 64
    assert SimExecutor(COST, kv_blocks=4, block_size=16, max_model_len=40).max_model_len == 40  # shorter: kept


@pytest.mark.parametrize("policy", ["qoserve", "sarathi-fcfs"])
def test_a_request_longer_than_the_kv_cache_is_refused_and_one_that_fills_it_finishes(policy):
    ex = SimExecutor(COST, kv_blocks=4, block_size=16)
    engine = Engine(ex, create_scheduler(policy, COST, ex))
    with pytest.raises(ValueError, match=r"prompt \(50 tokens\) \+ max_tokens \(15\) exceeds the 64 tokens"):
        engine.add_request(batch_request("long", 50, 15))
    fills = batch_request("fills", 50, 14)  # prompt + output = the whole cache: it can always finish alone
    engine.add_request(fills)
    engine.run_until_idle(max_steps=500)
    assert fills.status is RequestStatus.FINISHED_LENGTH and fills.num_output_tokens == 14
    assert not engine.has_work


def test_the_simulator_refuses_a_request_that_can_never_fit_and_serves_the_rest():
    rep = make_replica("r", "qoserve", COST, kv_blocks=4)
    sim = Simulator([rep])
    done = {r.request_id: r for r in sim.run([batch_request("never", 50, 50, 0.0), batch_request("fits", 20, 8, 0.1)])}
    assert done["never"].status is RequestStatus.FINISHED_ABORTED and done["never"].finish_time is None
    assert done["fits"].status is RequestStatus.FINISHED_LENGTH
    rejected = [o for o in sim.finished if o.event == "rejected"]
    assert [o.request_id for o in rejected] == ["never"] and "exceeds the 64 tokens" in rejected[0].error
    assert summarize(list(done.values())).violations == 1  # the refused one counts as an SLO violation
