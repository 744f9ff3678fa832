"""Executor fast paths: oneDNN-prepacked projections, cache reads as views, chains without a tree mask."""

from __future__ import annotations

import torch

from gpu_runtime.executor.kv_blocks import BlockManager
from gpu_runtime.executor.torch import TorchExecutor
from gpu_runtime.executor.torch.batch import build_forward_batch, contiguous_run
from gpu_runtime.executor.torch.model import can_prepack
from gpu_runtime.speculation.token_tree import TokenTree
from tests.engine.conftest import hf_greedy, make_request, run_engine, tiny_llama
from tests.engine.spec_helpers import VerifyAll


def test_contiguous_run():
    assert contiguous_run(torch.arange(16, 40)) == slice(16, 40)
    assert contiguous_run(torch.tensor([5])) == slice(5, 6)
    assert contiguous_run(torch.tensor([0, 1, 2, 7])) is None
    assert contiguous_run(torch.tensor([0, 2, 1, 3])) is None  # same span, not in order
    assert contiguous_run(torch.tensor([], dtype=torch.long)) is None


def test_freed_blocks_come_back_ascending():
    bm = BlockManager(8, 4)
    bm.allocate("a", 12)
    bm.free("a")
    bm.allocate("b", 12)
    assert bm.tables["b"].blocks == [0, 1, 2]


def test_prepacked_projections_match_dense():
    model = tiny_llama(seed=3)
    packed = TorchExecutor.from_model(model, kv_blocks=32, block_size=4)
    dense = TorchExecutor.from_model(model, kv_blocks=32, block_size=4, prepack_weights=False)
    if can_prepack(packed.device, packed.model.dtype):
        assert packed.model.layers[0].packed is not None and packed.model.lm_head_packed is not None
    assert dense.model.layers[0].packed is None
    for ex in (packed, dense):
        ex.add_request("r", make_request([1]).sampling)
    tree = TokenTree.chain([7, 8, 9])
    logits = []
    for ex in (packed, dense):
        prefill = ex._prefill_segment("r", 0, [5, 6, 7, 8, 9, 10], sample=True)
        ex.model.forward(build_forward_batch([prefill], ex.device)[0])
        seg = ex._decode_segment("r", 6, 11, tree)
        assert seg.mask is None  # a chain is plain causal attention
        logits.append(ex.model.forward(build_forward_batch([seg], ex.device)[0]))
    assert torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_prepacked_speculation_keeps_greedy_output():
    model = tiny_llama(seed=4)
    prompt = [3, 9, 4, 11, 3, 9, 4, 11, 3, 9]
    ref = hf_greedy(model, prompt, 16)
    from gpu_runtime.executor.drafters.prompt_lookup import PromptLookupDrafter

    ex = TorchExecutor.from_model(model, kv_blocks=64, block_size=4, drafter=PromptLookupDrafter())
    req = make_request(prompt, max_tokens=16)
    assert run_engine(ex, [req], speculation=VerifyAll(depth=4, width=1))[req.request_id] == ref
