"""Paged KV cache behaviour: chunked prefill == one-shot prefill, no block leaks, elastic draft memory."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from gpu_runtime.executor.base import BatchPlan, DecodeEntry, DraftEntry, PrefillChunk
from gpu_runtime.executor.drafters.model_runner import DraftModelRunner
from gpu_runtime.executor.torch import TorchExecutor
from gpu_runtime.sampling import SamplingParams
from tests.engine.conftest import make_request, run_engine, tiny_llama
from tests.engine.spec_helpers import VerifyAll


def _prefill(ex: TorchExecutor, rid: str, prompt: list[int], chunks: list[int]) -> torch.Tensor:
    ex.add_request(rid, SamplingParams())
    start = 0
    for n in chunks:
        piece = prompt[start:start + n]
        ex.step(BatchPlan(prefills=[PrefillChunk(rid, start, piece, sample=start + n >= len(prompt))]))
        start += n
    return ex.last_logits[ex.last_rows[rid]][0].clone()


def test_chunked_prefill_gives_one_shot_logits(tiny_model):
    prompt = [random.Random(0).randrange(3, 97) for _ in range(45)]
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=64, block_size=4)
    one = _prefill(ex, "one", prompt, [45])
    chunked = _prefill(ex, "chunked", prompt, [7, 1, 16, 13, 8])
    with torch.no_grad():
        ref = tiny_model(torch.tensor([prompt], device=ex.device)).logits[0, -1].float()
    assert torch.allclose(one, chunked, atol=1e-4, rtol=1e-4)
    assert torch.allclose(one, ref, atol=1e-4, rtol=1e-4)
    # the next decode step reads both caches the same way
    tok = int(one.argmax())
    ex.step(BatchPlan(decodes=[DecodeEntry("one", 45, tok), DecodeEntry("chunked", 45, tok)]))
    a, b = (ex.last_logits[ex.last_rows[r]][0] for r in ("one", "chunked"))
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_prefill_chunks_of_several_requests_mix_with_decodes(tiny_model):
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=64, block_size=4)
    p1, p2 = list(range(3, 23)), list(range(40, 51))
    solo = _prefill(ex, "solo", p2, [11])
    ex.free("solo")
    _prefill(ex, "a", p1, [20])
    ex.add_request("b", SamplingParams())
    ex.step(BatchPlan(prefills=[PrefillChunk("b", 0, p2[:6], False)], decodes=[DecodeEntry("a", 20, 5)]))
    ex.step(BatchPlan(prefills=[PrefillChunk("b", 6, p2[6:], True)], decodes=[DecodeEntry("a", 21, 9)]))
    assert torch.allclose(ex.last_logits[ex.last_rows["b"]][0], solo, atol=1e-4, rtol=1e-4)


def test_no_block_leak_over_1000_small_requests_with_cancellations():
    model = tiny_llama(seed=2, layers=1)
    ex = TorchExecutor.from_model(model, kv_blocks=48, block_size=4)
    from gpu_runtime.engine import Engine
    from tests.engine.fcfs import FCFSTestScheduler

    engine = Engine(ex, FCFSTestScheduler(ex, chunk=64, max_decodes=32))
    rng = random.Random(0)
    finished = 0
    for wave in range(20):
        reqs = [make_request([rng.randrange(3, 97) for _ in range(rng.randint(1, 9))], max_tokens=rng.randint(1, 6))
                for _ in range(50)]
        for r in reqs:
            engine.add_request(r)
        for _ in range(2):
            engine.step()
        for r in reqs[::7]:
            engine.abort(r.request_id)
        engine.run_until_idle(max_steps=2000)
        finished += sum(r.status.finished for r in reqs)
        assert ex.capacity().free_blocks == 48
    assert finished == 1000
    assert not ex.blocks.tables and not ex._requests


def test_no_block_leak_with_draft_model_speculation_and_cancels_mid_tree():
    """Speculation with the draft runner: greedy and sampled requests, aborts landing at random steps
    while requests are mid-speculation (trees drafted, scratch slots taken, branches accepted);
    both the target's pool and the draft runner's own pool must come back whole."""
    from gpu_runtime.engine import Engine
    from tests.engine.fcfs import FCFSTestScheduler

    target = tiny_llama(seed=2, layers=1)
    runner = DraftModelRunner(copy.deepcopy(target), block_size=4)  # the target's argmax: long accepted paths
    ex = TorchExecutor.from_model(target, kv_blocks=96, block_size=4, drafter=runner)
    policy = VerifyAll(depth=3, width=2)
    engine = Engine(ex, FCFSTestScheduler(ex, chunk=64, max_decodes=16), policy)
    rng = random.Random(1)
    finished = aborted = 0
    for wave in range(20):
        reqs = [make_request([rng.randrange(3, 97) for _ in range(rng.randint(1, 9))], max_tokens=rng.randint(1, 12),
                             temperature=rng.choice([0.0, 1.0]), seed=wave * 100 + i) for i in range(50)]
        for r in reqs:
            engine.add_request(r)
        for _ in range(60):
            if not engine.has_work:
                break
            engine.step()
            live = [r for r in reqs if r.status.value == "decoding"]
            for r in rng.sample(live, k=min(len(live), rng.randint(0, 2))):
                engine.abort(r.request_id)  # taken at the next step, after this step's tree was verified
        engine.run_until_idle(max_steps=2000)
        finished += sum(r.status.finished for r in reqs)
        aborted += sum(r.status.value == "finished_aborted" for r in reqs)
        assert ex.capacity().free_blocks == 96
        assert runner.blocks.num_free == runner.blocks.total_blocks and not runner.blocks.tables
    assert finished == 1000 and aborted > 100
    assert policy.accepted > 500  # speculation really ran: trees accepted nodes
    assert not ex.blocks.tables and not ex._requests


def test_cancel_between_draft_and_verification_returns_both_pools():
    """The draft runner took (and dropped) scratch slots and the tree was never verified: freeing the
    request then must release its target blocks and its draft-cache blocks."""
    target = tiny_llama(seed=0)
    runner = DraftModelRunner(copy.deepcopy(target), block_size=4)
    ex = TorchExecutor.from_model(target, kv_blocks=16, block_size=4, drafter=runner)
    req = make_request(list(range(5, 14)), max_tokens=8)
    ex.add_request(req.request_id, req.sampling)
    first = ex.step(BatchPlan(prefills=[PrefillChunk(req.request_id, 0, req.prompt_token_ids, True)]))
    tree = ex.draft([DraftEntry(req.request_id, depth=3, width=2)]).trees[req.request_id]
    assert len(tree) == 6 and runner.blocks.num_free < runner.blocks.total_blocks  # the draft cache holds the prompt
    ex.step(BatchPlan(decodes=[DecodeEntry(req.request_id, 9, first.tokens[req.request_id][0], tree)]))
    ex.draft([DraftEntry(req.request_id, depth=3, width=2)])  # the next tree, never verified
    ex.free(req.request_id)
    assert ex.capacity().free_blocks == 16 and runner.blocks.num_free == runner.blocks.total_blocks


def test_rejected_tree_branches_return_their_blocks(tiny_model):
    from gpu_runtime.speculation.token_tree import TokenTree

    ex = TorchExecutor.from_model(tiny_model, kv_blocks=16, block_size=4)
    _prefill(ex, "a", [5, 6, 7], [3])
    used = ex.capacity().free_blocks
    wide = TokenTree([1] * 12, [-1] * 12, [0.1] * 12)  # 12 siblings: reserves 4 scratch blocks
    res = ex.step(BatchPlan(decodes=[DecodeEntry("a", 3, 8, wide)]))
    kept = 4 + len(res.accepted_nodes["a"])
    assert ex.blocks.num_tokens("a") == kept
    assert ex.capacity().free_blocks == 16 - -(-kept // 4)
    assert ex.capacity().free_blocks >= used - 1


def test_offload_draft_moves_weights_and_grows_pool_then_load_restores():
    target = tiny_llama(seed=0)
    runner = DraftModelRunner(copy.deepcopy(target), block_size=4)
    ex = TorchExecutor.from_model(target, kv_blocks=32, block_size=4, drafter=runner)
    before = {n: p.data_ptr() for n, p in runner.hf_model.named_parameters()}
    total = ex.capacity().total_blocks
    gained = ex.offload_draft()
    assert gained > 0 and not ex.draft_on_device
    assert ex.capacity().total_blocks == total + gained == ex.model.num_slots // 4
    assert all(p.numel() == 0 for p in runner.hf_model.parameters())  # device tensors released
    assert all(t.data_ptr() != before[n] for n, t in runner._offloaded.items())  # weights live in new storage
    # the grown pool is usable: a long request fills it, drafting is skipped while offloaded
    prompts = [list(range(3, 60)), list(range(10, 40))]
    refs = {}
    policy = VerifyAll(depth=2, width=2)
    reqs = [make_request(p, max_tokens=8) for p in prompts]
    out = run_engine(ex, reqs, speculation=policy)
    refs = [out[r.request_id] for r in reqs]
    assert policy.accepted == 0
    assert ex.load_draft() and ex.draft_on_device
    assert ex.capacity().total_blocks == total == ex.model.num_slots // 4
    reqs2 = [make_request(p, max_tokens=8) for p in prompts]
    policy2 = VerifyAll(depth=2, width=2)
    out2 = run_engine(ex, reqs2, speculation=policy2)
    assert [out2[r.request_id] for r in reqs2] == refs
    assert policy2.accepted > 0


def test_load_draft_refuses_while_grown_blocks_are_in_use():
    target = tiny_llama(seed=0)
    runner = DraftModelRunner(copy.deepcopy(target), block_size=4)
    ex = TorchExecutor.from_model(target, kv_blocks=8, block_size=4, drafter=runner)
    gained = ex.offload_draft()
    total = ex.capacity().total_blocks
    ex.add_request("big", SamplingParams())
    n = total * 4 - 2  # occupies the top blocks too
    ex.step(BatchPlan(prefills=[PrefillChunk("big", 0, [5] * n, True)]))
    assert gained > 0 and not ex.load_draft() and ex.capacity().total_blocks == total
    ex.free("big")
    assert ex.load_draft() and ex.capacity().total_blocks == total - gained


@pytest.mark.parametrize("speculation", [None, "chain-4"])
def test_recompute_preemption_keeps_greedy_outputs_and_leaks_nothing(tiny_model, speculation):
    """KV reserved by a short predicted length runs out mid-decode: the least urgent job's KV is released
    and its prompt + outputs recomputed later; every output equals the run that never ran out (also
    while prompt lookup drafts, whose index is rebuilt after the release)."""
    from gpu_runtime.engine import Engine
    from gpu_runtime.executor.drafters.prompt_lookup import PromptLookupDrafter
    from gpu_runtime.qos import QoSClass, QoSSpec
    from gpu_runtime.request import Request
    from gpu_runtime.scheduler.registry import create_scheduler
    from gpu_runtime.speculation.registry import create_policy

    rng = random.Random(3)
    motif = [rng.randrange(3, 97) for _ in range(5)]
    prompts = [motif * 2 + [rng.randrange(3, 97) for _ in range(rng.randint(2, 6))] for _ in range(4)]

    def run(kv_blocks: int) -> tuple[dict[str, list[int]], int]:
        drafter = PromptLookupDrafter() if speculation else None
        ex = TorchExecutor.from_model(tiny_model, kv_blocks=kv_blocks, block_size=4, drafter=drafter)
        sched = create_scheduler("sarathi-fcfs", executor=ex, kv_watermark=0.0, chunk_size=32)
        for n in (2, 3, 4):  # the app's history predicts ~5 output tokens: far fewer than the 24 produced
            sched.history.record("app", n)
        engine = Engine(ex, sched, create_policy(speculation) if speculation else None)
        reqs = [Request(f"q{i}", p, SamplingParams(max_tokens=24, ignore_eos=True),
                        QoSSpec(QoSClass.BATCH, ttlt_s=1e6), arrival_time=0.0, app_id="app")
                for i, p in enumerate(prompts)]
        for r in reqs:
            engine.add_request(r)
        engine.run_until_idle(max_steps=5000)
        assert ex.capacity().free_blocks == kv_blocks and not ex.blocks.tables
        return {r.request_id: list(r.output_token_ids) for r in reqs}, sum(r.num_recomputes for r in reqs)

    ample, none = run(200)
    tight, recomputes = run(22)
    assert none == 0 and recomputes > 0
    assert tight == ample and all(len(v) == 24 for v in tight.values())
