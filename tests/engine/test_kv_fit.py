"""The own engine serves no longer a context than its KV cache holds: it fits max_model_len to the cache and says so
(vLLM refuses to start where its max_model_len does not fit, ``check_enough_kv_cache_memory``), and a request that
could never fit is refused at admission with what to change, never admitted to wait."""

import logging

import pytest

from gpu_runtime.costmodel.profile import default_cost_model
from gpu_runtime.engine import Engine
from gpu_runtime.executor.torch import TorchExecutor
from gpu_runtime.request import RequestStatus
from gpu_runtime.scheduler.registry import create_scheduler
from tests.engine.conftest import make_request, run_engine


def test_a_kv_cache_shorter_than_the_models_context_caps_max_model_len_and_says_so(tiny_model, caplog):
    with caplog.at_level(logging.WARNING, logger="gpu_runtime.executor.torch.executor"):
        ex = TorchExecutor.from_model(tiny_model, kv_blocks=4, block_size=16)
    assert ex.max_model_len == 64  # 4 blocks of 16, not the tiny model's 512
    note = " ".join(r.getMessage() for r in caplog.records)
    assert "max_model_len 512 does not fit the KV cache (4 blocks of 16 tokens = 64 tokens)" in note
    assert "COSERVE_KV_BLOCKS" in note
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpu_runtime.executor.torch.executor"):
        assert TorchExecutor.from_model(tiny_model, kv_blocks=4, block_size=16, max_model_len=48).max_model_len == 48
    assert not caplog.records  # a context the cache holds: nothing to say


@pytest.mark.parametrize("policy", ["qoserve", "sarathi-fcfs"])
def test_a_request_longer_than_the_kv_cache_is_refused_and_one_that_fills_it_finishes(tiny_model, policy):
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=4, block_size=16)
    scheduler = create_scheduler(policy, default_cost_model(), ex)
    with pytest.raises(ValueError, match=r"exceeds the 64 tokens this engine serves .*lower max_tokens"):
        Engine(ex, scheduler).add_request(make_request(list(range(3, 53)), max_tokens=15))
    assert scheduler.num_unfinished == 0  # refused before the scheduler saw it
    fills = make_request(list(range(3, 53)), max_tokens=14)  # prompt + output = the whole cache
    out = run_engine(ex, [fills], scheduler=scheduler)
    assert fills.status is RequestStatus.FINISHED_LENGTH and len(out[fills.request_id]) == 14
    assert ex.capacity().free_blocks == 4
