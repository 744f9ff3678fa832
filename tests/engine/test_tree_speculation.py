"""Tree speculative decoding is lossless: greedy output unchanged, sampled distribution unchanged."""

from __future__ import annotations

import copy
import math
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


@pytest.mark.parametrize("layout", ["padded", "per-request", "auto"])
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
    req = make_request([7, 8, 9, 10, 11], max_tokens=8)  # room for a depth-3 tree (see max_tree_depth)
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
                logits = target(torch.tensor([seq + path[:k]], device=target.device)).logits[0, -1]
                prob *= float(torch.softmax(logits.float(), -1)[tok])
            assert abs(prob - tree.path_probs[i]) < 1e-4 * max(1.0, prob)
    assert runner.blocks.num_tokens(req.request_id) == len(seq)  # scratch slots dropped


def test_draft_model_asks_before_each_further_depth_and_stops_when_told():
    target = tiny_llama(seed=0)
    runner = DraftModelRunner(copy.deepcopy(target), block_size=4)
    ex = TorchExecutor.from_model(target, kv_blocks=32, block_size=4, drafter=runner)
    from gpu_runtime.executor.base import BatchPlan, DraftEntry, PrefillChunk

    reqs = [make_request([7, 8, 9, 10, 11], max_tokens=12), make_request([5, 6, 7], max_tokens=12)]
    for r in reqs:
        ex.add_request(r.request_id, r.sampling)
    ex.step(BatchPlan(prefills=[PrefillChunk(r.request_id, 0, r.prompt_token_ids, True) for r in reqs]))
    asked: list[tuple[int, dict[str, float]]] = []

    def keep(depth: int, best: dict[str, float]) -> bool:
        asked.append((depth, best))
        return depth < 2

    entries = [DraftEntry(r.request_id, depth=5, width=1) for r in reqs]
    trees = ex.draft(entries, keep).trees
    assert [d for d, _ in asked] == [1, 2]  # asked after depth 1 (yes) and after depth 2 (no)
    assert all(t.depths() == [1, 2] for t in trees.values())
    for depth, best in asked:  # each request's path probability at that depth
        assert best == {rid: t.path_probs[depth - 1] for rid, t in trees.items()}
    assert all(runner.blocks.num_tokens(r.request_id) == len(r.prompt_token_ids) + 1 for r in reqs)
    full = ex.draft(entries).trees  # without the callback: the entries' depth
    assert all(len(t) == 5 for t in full.values())


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


def _exact_marginals(model, prompt: list[int], steps: int, temperature: float) -> list[torch.Tensor]:
    """Exact marginals p(x_1), ..., p(x_steps) of sampled continuations, by enumerating every prefix
    (V^(steps-1) sequences: tiny vocab only) with the reference transformers forward."""
    vocab = model.config.vocab_size
    marginals = []
    prefixes = torch.tensor([prompt], device=model.device)
    weights = torch.ones(1, dtype=torch.float64, device=model.device)
    with torch.no_grad():
        for step in range(steps):
            logits = model(prefixes).logits[:, -1].double()
            cond = torch.softmax(logits / temperature, -1)  # [prefixes, V]
            joint = weights[:, None] * cond
            marginals.append(joint.sum(0).cpu())
            if step + 1 < steps:  # every prefix extended by every token
                prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0),
                                      torch.arange(vocab, device=model.device).repeat(prefixes.shape[0])[:, None]],
                                     1)
                weights = joint.reshape(-1)
    return marginals


def _expected_tv(p: torch.Tensor, n: int) -> float:
    """E[TV(empirical, p)] for n samples, normal approximation: sum_i sqrt(p_i (1 - p_i) / (2 pi n))."""
    return float((p * (1 - p)).sqrt().sum()) / math.sqrt(2 * math.pi * n)


def test_sampled_engine_tokens_through_tree_verification_follow_the_target_marginals():
    """Through the engine with speculation on: tokens 2 and 3 come out of multi-branch tree
    verification (token 1 comes from the prefill), so their empirical marginals must match the
    exact target marginals p(x2) = sum_a p(a) p(x2 | a) and p(x3) = sum_ab p(a) p(b | a) p(x3 | ab).

    The drafts favour fixed tokens (the greedy continuation, 70% of nodes): a verifier that is not
    lossless over-weights them. Checked by hand: a verifier that draws the bonus from the target
    instead of the residual fails here, while uniformly random drafts would hide that very bug
    (their bias cancels). The tolerance is 3x the expected sampling noise of n samples."""
    V, T, n = 11, 0.8, 3000
    target = tiny_llama(seed=1, vocab=V)
    prompt = [3, 5, 7, 4]
    drafter = NoisyTreeDrafter({len(prompt): hf_greedy(target, prompt, 3)}, vocab=V, hit=0.7, seed=7, max_nodes=6)
    ex = TorchExecutor.from_model(target, kv_blocks=3 * n, block_size=4, drafter=drafter)
    policy = VerifyAll(depth=2, width=3)  # clipped to depth 1 at token 2 (max_tokens=3: see max_tree_depth)
    reqs = [make_request(prompt, max_tokens=3, temperature=T, seed=1000 + i) for i in range(n)]
    out = run_engine(ex, reqs, speculation=policy, chunk=256)
    assert policy.steps >= n and policy.accepted > n // 10  # every request verified a tree, drafts were accepted
    exact = _exact_marginals(target, prompt, 3, T)
    for k in (1, 2):  # token 2 and token 3
        freq = torch.zeros(V, dtype=torch.float64)
        for r in reqs:
            freq[out[r.request_id][k]] += 1
        tol = 3 * _expected_tv(exact[k], n)
        tv = 0.5 * float((freq / n - exact[k]).abs().sum())
        assert tv < tol, f"token {k + 1}: TV {tv:.4f} >= {tol:.4f}"
    assert ex.capacity().free_blocks == 3 * n


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


def test_tree_depth_is_clipped_to_remaining_tokens_and_context():
    from gpu_runtime.executor.base import BatchPlan, DraftEntry, PrefillChunk

    target = tiny_llama(seed=0)
    runner = DraftModelRunner(copy.deepcopy(target), block_size=4)
    ex = TorchExecutor.from_model(target, kv_blocks=64, block_size=4, drafter=runner, max_model_len=40)
    short = make_request(list(range(5, 12)), max_tokens=4)  # 1 token from the prefill, 3 left: depth <= 2
    edge = make_request(list(range(5, 41)), max_tokens=100)  # pending token at 36 of a 40 context: depth <= 2
    for r in (short, edge):
        ex.add_request(r.request_id, r.sampling)
        ex.step(BatchPlan(prefills=[PrefillChunk(r.request_id, 0, r.prompt_token_ids, True)]))
    trees = ex.draft([DraftEntry(short.request_id, 6, 2), DraftEntry(edge.request_id, 6, 2)]).trees
    assert max(trees[short.request_id].depths()) == 2 == ex.max_tree_depth(short.request_id)
    assert max(trees[edge.request_id].depths()) == 2 == ex.max_tree_depth(edge.request_id)
    assert len(trees[short.request_id]) == 4  # width 2 x depth 2: the beams stopped at the limit
    # drafters that ignore the depth (random trees up to 12 nodes) are cut to it as well
    refs = {7: hf_greedy(target, list(range(5, 12)), 10)}
    ex2 = TorchExecutor.from_model(target, kv_blocks=64, block_size=4,
                                   drafter=NoisyTreeDrafter(refs, vocab=97, hit=0.8, seed=1, max_nodes=12))
    seen: list[tuple[int, int]] = []  # (deepest node, tokens still allowed) per verified tree
    step = ex2.step

    def spy(plan):
        for d in plan.decodes:
            if d.tree is not None:
                outputs = len(ex2.token_ids(d.request_id)) - 7
                seen.append((max(d.tree.depths()), 10 - outputs))
        return step(plan)

    ex2.step = spy
    req = make_request(list(range(5, 12)), max_tokens=10)
    assert run_engine(ex2, [req], speculation=VerifyAll(depth=8, width=3))[req.request_id] == refs[7]
    assert seen and all(depth + 1 <= left for depth, left in seen)  # never a node whose token would be cut
    assert max(depth for depth, _ in seen) > 2  # early trees were deep: only the tail was clipped
