"""Tree speculative decoding is lossless: greedy output unchanged, sampled distribution unchanged."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from gpu_runtime.executor.drafters.model_runner import DraftModelRunner
from gpu_runtime.executor.drafters.prompt_lookup import PromptLookupDrafter
from gpu_runtime.executor.torch import TorchExecutor
from gpu_runtime.speculation.token_tree import TokenTree
from tests.engine.conftest import hf_greedy, make_request, run_engine, tiny_llama
from tests.engine.spec_helpers import NoisyTreeDrafter, VerifyAll


def _prompts(seed: int, lengths: list[int], vocab: int = 97) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("layout", ["padded", "per-request"])
def test_random_trees_keep_greedy_output(tiny_model, layout):
    prompts = _prompts(2, [5, 13, 30])  # distinct lengths: the drafter finds each prompt's reference
    refs = {len(p): hf_greedy(tiny_model, p, 24) for p in prompts}
    drafter = NoisyTreeDrafter(refs, vocab=97, hit=0.6, seed=4)
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=64, block_size=4, drafter=drafter, attention_layout=layout)
    policy = VerifyAll(depth=4, width=3)
    reqs = [make_request(p, max_tokens=24) for p in prompts]
    out = run_engine(ex, reqs, speculation=policy, chunk=12)
    for r, p in zip(reqs, prompts):
        assert out[r.request_id] == refs[len(p)]
    assert policy.accepted > 10  # trees were really used, with nodes past the first branch accepted
    assert ex.capacity().free_blocks == 64


def test_draft_model_trees_keep_greedy_output_and_identical_draft_accepts_all():
    target = tiny_llama(seed=0)
    prompts = _prompts(3, [6, 19])
    refs = [hf_greedy(target, p, 20) for p in prompts]
    # a draft with the target's own weights proposes the target's argmax chain: every node accepted
    same = DraftModelRunner(copy.deepcopy(target), block_size=4)
    ex = TorchExecutor.from_model(target, kv_blocks=64, block_size=4, drafter=same)
    policy = VerifyAll(depth=3, width=2)
    reqs = [make_request(p, max_tokens=20) for p in prompts]
    out = run_engine(ex, reqs, speculation=policy)
    assert [out[r.request_id] for r in reqs] == refs
    assert policy.accepted >= 2.5 * policy.steps  # 3 drafted levels, the last steps are cut by max_tokens
    # a different random draft model: low acceptance, still exactly the target's output
    other = DraftModelRunner(tiny_llama(seed=9), block_size=4)
    ex2 = TorchExecutor.from_model(target, kv_blocks=64, block_size=4, drafter=other)
    reqs2 = [make_request(p, max_tokens=20) for p in prompts]
    out2 = run_engine(ex2, reqs2, speculation=VerifyAll(depth=3, width=3))
    assert [out2[r.request_id] for r in reqs2] == refs
    assert ex2.capacity().free_blocks == 64 and other.blocks.num_free == other.blocks.total_blocks


def test_beam_tree_path_probabilities_are_products_of_conditionals():
    target = tiny_llama(seed=0)
    runner = DraftModelRunner(copy.deepcopy(target), block_size=4)
    ex = TorchExecutor.from_model(target, kv_blocks=32, block_size=4, drafter=runner)
    req = make_request([7, 8, 9, 10, 11], max_tokens=4)
    ex.add_request(req.request_id, req.sampling)
    from gpu_runtime.executor.base import BatchPlan, DraftEntry, PrefillChunk

    first = ex.step(BatchPlan(prefills=[PrefillChunk(req.request_id, 0, req.prompt_token_ids, True)]))
    tree = ex.draft([DraftEntry(req.request_id, depth=3, width=2)]).trees[req.request_id]
    assert len(tree) == 6 and tree.depths() == [1, 1, 2, 2, 3, 3]
    seq = req.prompt_token_ids + first.tokens[req.request_id]
    with torch.no_grad():
        for i in range(len(tree)):
            path = [tree.token_ids[a] for a in tree.ancestors(i)]
            prob = 1.0
            for k, tok in enumerate(path):
                logits = target(torch.tensor([seq + path[:k]])).logits[0, -1]
                prob *= float(torch.softmax(logits.float(), -1)[tok])
            assert abs(prob - tree.path_probs[i]) < 1e-4 * max(1.0, prob)
    assert runner.blocks.num_tokens(req.request_id) == len(seq)  # scratch slots dropped


def test_prompt_lookup_trees_keep_greedy_output():
    target = tiny_llama(seed=0)
    rng = random.Random(5)
    motif = [rng.randrange(3, 97) for _ in range(6)]
    prompt = motif * 4 + [rng.randrange(3, 97) for _ in range(3)] + motif[:3]
    ref = hf_greedy(target, prompt, 24)
    ex = TorchExecutor.from_model(target, kv_blocks=64, block_size=4, drafter=PromptLookupDrafter())
    req = make_request(prompt, max_tokens=24)
    assert run_engine(ex, [req], speculation=VerifyAll(depth=4, width=2))[req.request_id] == ref


def test_prompt_lookup_branches_and_counts():
    d = PromptLookupDrafter(max_ngram=2, decay=1.0)
    tree = d.propose([1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 7, 1, 2], depth=2, width=2)
    # suffix [1, 2] matched 3 times: continuations [3, 7], [4, 8], [3, 9]
    assert tree.token_ids[0] == 3 and abs(tree.path_probs[0] - 2 / 3) < 1e-9
    top = tree.children(-1)
    assert sorted(tree.token_ids[c] for c in top) == [3, 4]
    assert sorted(tree.token_ids[c] for c in tree.children(0)) == [7, 9]
    assert all(abs(tree.path_probs[c] - 1 / 3) < 1e-9 for c in tree.children(0))
    assert d.propose([5, 6, 7], depth=3, width=2) == TokenTree()


def test_sampled_tree_verification_matches_target_distribution():
    """Verify the same tree many times from one state; first-token frequencies follow the target (TV test)."""
    from gpu_runtime.executor.torch.sampler import target_probs, verify_sampled
    from gpu_runtime.sampling import SamplingParams

    torch.manual_seed(0)
    V = 8
    logits = torch.randn(6, V) * 1.5  # root + 5 nodes
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    probs = target_probs(logits, sampling)
    order = probs[0].argsort(descending=True).tolist()
    # root children: the 2nd and 1st likeliest tokens and one outside the nucleus; node 0 has two children
    a, b = probs[1].argsort(descending=True).tolist()[:2]
    tree = TokenTree([order[1], order[0], order[-1], a, b], [-1, -1, -1, 0, 0], [0.5, 0.2, 0.1, 0.3, 0.1])
    gen = torch.Generator().manual_seed(123)
    n = 20000
    first = torch.zeros(V)
    second_given_3 = torch.zeros(V)
    for _ in range(n):
        accepted, bonus = verify_sampled(tree, probs, gen)
        toks = [tree.token_ids[a] for a in accepted] + [bonus]
        first[toks[0]] += 1
        if toks[0] == order[1]:
            second_given_3[toks[1]] += 1
    tv = 0.5 * float((first / n - probs[0]).abs().sum())
    assert tv < 0.02
    tv2 = 0.5 * float((second_given_3 / second_given_3.sum() - probs[1]).abs().sum())
    assert tv2 < 0.03
    assert float(probs[0][probs[0] > 0].numel()) < V  # top-p removed some tokens: the test covers it


def test_sampled_engine_output_with_trees_matches_plain_sampling_distribution():
    """Through the engine: the first 2 sampled tokens with random-tree speculation vs without (TV distance)."""
    target = tiny_llama(seed=1, vocab=11)
    prompt = [3, 5, 7, 4]
    counts = {True: {}, False: {}}
    n = 300
    for spec in (False, True):
        drafter = NoisyTreeDrafter({}, vocab=11, hit=0.0, seed=7, max_nodes=6) if spec else None
        ex = TorchExecutor.from_model(target, kv_blocks=256, block_size=4, drafter=drafter)
        reqs = [make_request(prompt, max_tokens=2, temperature=1.0, seed=1000 + i) for i in range(n)]
        out = run_engine(ex, reqs, speculation=VerifyAll(depth=2, width=3) if spec else None, chunk=64)
        for r in reqs:
            key = tuple(out[r.request_id])
            counts[spec][key] = counts[spec].get(key, 0) + 1
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].float(), -1)
    for spec in (False, True):
        freq = torch.zeros(11)
        for (a, _), c in counts[spec].items():
            freq[a] += c
        assert 0.5 * float((freq / n - p1).abs().sum()) < 0.12  # n=300 over 11 outcomes: sampling noise ~0.06


def test_trees_that_do_not_fit_the_free_kv_are_dropped_not_fatal(tiny_model):
    # a pool that holds the prompts and outputs but not every tree's transient slots
    prompts = _prompts(2, [5, 13, 30])
    refs = {len(p): hf_greedy(tiny_model, p, 24) for p in prompts}
    drafter = NoisyTreeDrafter(refs, vocab=97, hit=0.6, seed=4, max_nodes=24)
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=34, block_size=4, drafter=drafter)
    policy = VerifyAll(depth=8, width=3)
    reqs = [make_request(p, max_tokens=24) for p in prompts]
    out = run_engine(ex, reqs, speculation=policy, chunk=64)
    for r, p in zip(reqs, prompts):
        assert out[r.request_id] == refs[len(p)]
    assert ex.capacity().free_blocks == 34
