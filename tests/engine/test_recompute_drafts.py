"""Drafts after a recompute preemption on the own engine (tiny torch models): once a request's prompt + outputs are
prefilled again, its first draft follows its pending token as it would have without the preemption, so a draft
model that is the target itself keeps every greedy draft accepted.

The model is a tiny Llama whose greedy next token is the current one's successor (t -> t + 1): random tiny models
repeat one token, where a draft anchored a position early is accepted all the same."""

from __future__ import annotations

import random

import torch

from gpu_runtime.engine import Engine
from gpu_runtime.executor.drafters.model_runner import DraftModelRunner
from gpu_runtime.executor.torch import TorchExecutor
from gpu_runtime.qos import QoSClass, QoSSpec
from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.scheduler.registry import create_scheduler
from gpu_runtime.speculation.registry import create_policy
from tests.engine.conftest import tiny_llama


def successor_llama():
    """Layers that add nothing to the residual stream (attention and MLP still run) and an output head whose row
    t + 1 is token t's embedding: the next token of t is t + 1 (mod the vocabulary), whatever came before."""
    model = tiny_llama(tie_word_embeddings=False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(torch.roll(model.model.embed_tokens.weight, 1, 0))
    return model


def _run(kv_blocks: int) -> tuple[dict[str, list[int]], list[tuple[str, int, int, int]]]:
    """Greedy outputs, and every verified tree as (request, its recomputes so far, nodes, nodes accepted)."""
    draft = DraftModelRunner(successor_llama(), num_blocks=400, block_size=4)  # the target: greedy agrees
    ex = TorchExecutor.from_model(successor_llama(), kv_blocks=kv_blocks, block_size=4, drafter=draft)
    sched = create_scheduler("sarathi-fcfs", executor=ex, kv_watermark=0.0, chunk_size=32)
    for n in (2, 3, 4):  # the app's history predicts ~5 output tokens: far fewer than the 24 produced
        sched.history.record("app", n)
    engine = Engine(ex, sched, create_policy("chain-4"))
    rng = random.Random(3)
    reqs = [Request(f"q{i}", [rng.randrange(3, 97) for _ in range(rng.randint(8, 14))],
                    SamplingParams(max_tokens=24, ignore_eos=True), QoSSpec(QoSClass.BATCH, ttlt_s=1e6),
                    arrival_time=0.0, app_id="app") for i in range(4)]
    by_id = {r.request_id: r for r in reqs}
    verified: list[tuple[str, int, int, int]] = []
    step = ex.step

    def recording(plan):
        result = step(plan)
        verified.extend((d.request_id, by_id[d.request_id].num_recomputes, len(d.tree),
                         len(result.accepted_nodes[d.request_id])) for d in plan.decodes if d.tree)
        return result

    ex.step = recording
    for r in reqs:
        engine.add_request(r)
    engine.run_until_idle(max_steps=5000)
    return {r.request_id: list(r.output_token_ids) for r in reqs}, verified


def test_a_recomputed_request_drafts_from_its_pending_token_as_one_never_preempted():
    ample, ample_trees = _run(200)
    tight, tight_trees = _run(22)
    assert tight == ample and all(len(v) == 24 for v in tight.values())
    after_recompute = [t for t in tight_trees if t[1] > 0]
    assert after_recompute and all(t[1] == 0 for t in ample_trees)  # only the tight pool released a request's KV
    # the draft is the target: a draft anchored at the request's pending token is accepted whole, before and after
    assert [t for t in ample_trees + tight_trees if t[3] != t[2]] == []
