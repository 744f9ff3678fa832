"""The simulator's model of vLLM v1's scheduler (what the vLLM backend's vllm-fcfs / vllm-priority run)."""

import pytest

from gpu_runtime.qos import Tier
from gpu_runtime.scheduler.priority import vllm_priority
from gpu_runtime.scheduler.registry import create_scheduler

from tests.unit.scheduler.helpers import COST, batch, decoding, interactive


def _ids(out) -> list[tuple[str, int]]:
    return [(p.request.request_id, p.num_tokens) for p in out.prefills]


def _run(s, out, now: float) -> None:
    """What the engine does between two steps: the chunks are computed."""
    for p in out.prefills:
        p.request.num_computed_tokens += p.num_tokens
    s.update_from_output(out, now)


def test_one_token_budget_a_step_decodes_first_then_prompts_chunked_fcfs():
    s = create_scheduler("vllm-v1-fcfs", cost_model=COST, max_num_batched_tokens=100)
    for i in range(3):
        d = decoding(interactive(f"d{i}", prompt=10), outputs=1, times=[0.1])
        s.running[d.request_id] = d
    s.add_request(interactive("late", arrival=1.0, prompt=60))
    s.add_request(interactive("early", arrival=0.0, prompt=60))
    out = s.schedule(2.0)
    assert len(out.decodes) == 3
    # 100 - 3 decode tokens: the earlier prompt whole, the later one chunked into the rest (no whole-prompt rule)
    assert _ids(out) == [("early", 60), ("late", 37)]


def test_priority_orders_paid_before_free_interactive_before_batch_then_arrival():
    reqs = [batch("free-batch", arrival=0.0, tier=Tier.FREE), interactive("free-int", arrival=0.1, tier=Tier.FREE),
            batch("paid-batch", arrival=0.2), interactive("paid-int-2", arrival=0.4),
            interactive("paid-int-1", arrival=0.3)]
    assert [vllm_priority(r) for r in reqs] == [3, 2, 1, 0, 0]
    s = create_scheduler("vllm-v1-priority", cost_model=COST, max_num_batched_tokens=1000)
    for r in reqs:
        s.add_request(r)
    assert [rid for rid, _ in _ids(s.schedule(1.0))] == ["paid-int-1", "paid-int-2", "paid-batch", "free-int",
                                                        "free-batch"]


def test_a_started_prompt_continues_before_a_higher_priority_arrival():
    # vLLM schedules its running list (which holds partly prefilled prompts) before the waiting queue
    s = create_scheduler("vllm-v1-priority", cost_model=COST, max_num_batched_tokens=50)
    s.add_request(batch("free", arrival=0.0, prompt=100, tier=Tier.FREE))
    out = s.schedule(0.0)
    assert _ids(out) == [("free", 50)]
    _run(s, out, 0.1)
    s.add_request(interactive("paid", arrival=0.1, prompt=30))
    assert _ids(s.schedule(0.1)) == [("free", 50)]
    # not yet started, the paid prompt would have gone first
    s = create_scheduler("vllm-v1-priority", cost_model=COST, max_num_batched_tokens=50)
    s.add_request(batch("free", arrival=0.0, prompt=100, tier=Tier.FREE))
    s.add_request(interactive("paid", arrival=0.1, prompt=30))
    assert _ids(s.schedule(0.1)) == [("paid", 30), ("free", 20)]


def test_unknown_order_is_an_error():
    with pytest.raises(ValueError, match="unknown vLLM scheduling order"):
        create_scheduler("vllm-v1-fcfs", cost_model=COST, order="edf")


def test_each_decode_takes_its_draft_tokens_of_the_step_budget_too():
    # vLLM's scheduler budgets a decode's 1 + num spec tokens; the prompts get what is left
    s = create_scheduler("vllm-v1-fcfs", cost_model=COST, max_num_batched_tokens=100)
    for i in range(3):
        d = decoding(interactive(f"d{i}", prompt=10), outputs=1, times=[0.1])
        s.running[d.request_id] = d
    s.decode_drafts = {"d0": 4, "d1": 2}  # d2 drafted nothing
    s.add_request(interactive("p", arrival=0.0, prompt=200))
    out = s.schedule(1.0)
    assert len(out.decodes) == 3 and s.step_drafts == 6
    assert out.prefill_budget == 100 - 3 - 6
    assert _ids(out) == [("p", 91)]
