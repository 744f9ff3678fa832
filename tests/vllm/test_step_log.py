"""The step log's batch features, read from what vLLM's scheduler scheduled (hand-built scheduler, no model)."""

from __future__ import annotations

from tests.vllm.conftest import run_step, vllm_request


def test_features_split_prompt_chunks_from_decodes(make_scheduler):
    sched = make_scheduler("vllm-fcfs", max_batched=64)
    sched.record_features = True
    first, second = vllm_request(40), vllm_request(50)
    sched.add_request(first)
    sched.add_request(second)
    run_step(sched)  # the first prompt whole (40) and 24 tokens of the second
    f = sched.last_features
    assert (f.num_prefill_tokens, f.num_decode_tokens, f.num_requests) == (64, 0, 2)
    assert f.prefill_context_sum == 40 + 24 and f.prefill_attn == 40 * 20 + 24 * 12
    run_step(sched)  # the first decodes at context 40; the second's last 26 prompt tokens start at 24
    f = sched.last_features
    assert (f.num_prefill_tokens, f.num_decode_tokens, f.decode_context_sum) == (26, 1, 40)
    assert f.prefill_context_sum == 50 and f.prefill_attn == 26 * (24 + 13)
    run_step(sched)
    f = sched.last_features
    assert (f.num_prefill_tokens, f.num_decode_tokens, f.decode_context_sum, f.num_requests) == (0, 2, 41 + 50, 2)


def test_features_are_kept_only_when_asked(make_scheduler):
    """The step log's features cost a pass over the batch: only with a step log or calibration."""
    sched = make_scheduler("qoserve")
    sched.add_request(vllm_request(20))
    run_step(sched)
    assert sched.last_features is None
    sched.record_features = True
    run_step(sched)
    assert sched.last_features.num_decode_tokens == 1
