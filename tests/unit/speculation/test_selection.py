"""AdaServe selection (Alg. 2): SLO requirements first, then global top-f under B."""

from __future__ import annotations

import itertools
import random

import pytest

from gpu_runtime.speculation.selection import SelectionInput, select_trees
from gpu_runtime.speculation.token_tree import TokenTree

from .conftest import random_tree


def connected_subsets(tree: TokenTree) -> list[frozenset[int]]:
    out = []
    for k in range(len(tree) + 1):
        for combo in itertools.combinations(range(len(tree)), k):
            s = set(combo)
            if all(tree.parents[i] < 0 or tree.parents[i] in s for i in s):
                out.append(frozenset(s))
    return out


def brute_force(trees: list[TokenTree], reqs: list[float], budget: int) -> float | None:
    """Best total f over per-request connected subtrees within B (roots count) meeting every A."""
    best = None
    options = [connected_subsets(t) for t in trees]
    for combo in itertools.product(*options):
        if sum(len(s) for s in combo) + len(trees) > budget:
            continue
        vals = [1.0 + sum(t.path_probs[i] for i in s) for t, s in zip(trees, combo)]
        if any(v + 1e-9 < a for v, a in zip(vals, reqs)):
            continue
        total = sum(vals)
        best = total if best is None else max(best, total)
    return best


def test_figure5_example():
    # Two requests, B = 8 (paper Fig. 5 shape): r0 needs 1.6 (0.6 beyond the root), r1 needs 1.8.
    t0 = TokenTree([10, 11, 12, 13], [-1, -1, 0, 2], [0.7, 0.2, 0.5, 0.3])
    t1 = TokenTree([20, 21, 22], [-1, 0, 1], [0.5, 0.4, 0.1])
    res = select_trees([SelectionInput("r0", 1.6, 3), SelectionInput("r1", 1.8, 3)], {"r0": t0, "r1": t1}, budget=8)
    assert not res.infeasible
    assert res.expected["r0"] >= 1.6 and res.expected["r1"] >= 1.8
    # 8 - 2 roots = 6 nodes; all 7 candidates minus the least probable (0.1) fit.
    assert len(res.trees["r0"]) + len(res.trees["r1"]) == 6
    assert 22 not in res.trees["r1"].token_ids
    assert res.budget_left == 0


def test_requirement_met_when_feasible_and_most_demanding_first():
    # Budget for 2 roots + 3 nodes. r_hi needs 3 nodes' worth; r_lo has more probable nodes.
    hi = TokenTree.chain([1, 2, 3], [0.9, 0.9, 0.9])  # f = .9, .81, .729
    lo = TokenTree.chain([4, 5, 6], [0.99, 0.99, 0.99])
    reqs = [SelectionInput("lo", 1.0, 3), SelectionInput("hi", 3.4, 3)]
    res = select_trees(reqs, {"hi": hi, "lo": lo}, budget=5)
    assert res.expected["hi"] >= 3.4
    assert len(res.trees["hi"]) == 3 and "lo" not in res.trees  # the pure top-f pick would favour lo
    assert not res.infeasible


def test_infeasible_requirement_is_reported():
    t = TokenTree.chain([1, 2], [0.5, 0.5])
    res = select_trees([SelectionInput("a", 3.0, 2), SelectionInput("b", 1.0, 2)], {"a": t, "b": t}, budget=10)
    assert res.infeasible == {"a"}  # at most 1 + 0.5 + 0.25 < 3
    assert len(res.trees["a"]) == 2


def test_budget_exhausted_reports_infeasible():
    t = TokenTree.chain([1, 2, 3], [0.9, 0.9, 0.9])
    res = select_trees([SelectionInput(f"r{i}", 1.5, 3) for i in range(3)], {f"r{i}": t for i in range(3)}, budget=4)
    # roots take 3 of 4 tokens: one request gets a node, the others can't reach 1.5
    assert sum(len(x) for x in res.trees.values()) == 1
    assert len(res.infeasible) == 2


def test_n_max_caps_slo_phase():
    t = TokenTree.chain([1, 2, 3, 4], [0.5] * 4)
    res = select_trees([SelectionInput("a", 5.0, 4)], {"a": t}, budget=3, n_max=1)
    # SLO phase stops at one node; the throughput phase still spends the budget.
    assert len(res.trees["a"]) == 2


def test_selected_trees_are_connected_and_within_budget(rng):
    for _ in range(50):
        n = rng.randint(1, 4)
        trees = {f"r{i}": random_tree(rng, rng.randint(1, 9)) for i in range(n)}
        inputs = [SelectionInput(rid, rng.uniform(0.5, 3.0), 5) for rid in trees]
        budget = rng.randint(n, n + 12)
        res = select_trees(inputs, trees, budget)
        assert n + sum(len(t) for t in res.trees.values()) <= budget
        for rid, sub in res.trees.items():
            src = trees[rid]
            # every kept token's parent token is kept (subtree() raises otherwise) and values match
            assert sorted(sub.token_ids) == sorted(set(sub.token_ids))
            assert abs(sub.expected_accepted() + 1 - res.expected[rid]) < 1e-9
            assert set(sub.token_ids) <= set(src.token_ids)


@pytest.mark.parametrize("seed", range(12))
def test_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 2)
    trees = [random_tree(rng, rng.randint(1, 5)) for _ in range(n)]
    reqs = [rng.uniform(1.0, 2.2) for _ in range(n)]
    budget = rng.randint(n + 1, n + 6)
    inputs = [SelectionInput(f"r{i}", a, 10) for i, a in enumerate(reqs)]
    res = select_trees(inputs, {f"r{i}": t for i, t in enumerate(trees)}, budget)
    optimum = brute_force(trees, reqs, budget)
    if optimum is None:
        assert res.infeasible  # nothing meets every A within B: the selection must say so
    else:
        assert not res.infeasible
        assert sum(res.expected.values()) == pytest.approx(optimum)


def test_unconstrained_greedy_is_optimal(rng):
    for _ in range(20):
        trees = [random_tree(rng, rng.randint(1, 5)) for _ in range(2)]
        budget = rng.randint(2, 9)
        res = select_trees([SelectionInput(f"r{i}", 0.0, 10) for i in range(2)],
                           {f"r{i}": t for i, t in enumerate(trees)}, budget)
        assert sum(res.expected.values()) == pytest.approx(brute_force(trees, [0.0, 0.0], budget))


def test_past_the_cheap_tokens_only_likely_nodes_are_taken():
    t = TokenTree.chain([1, 2, 3, 4], [0.9, 0.5, 0.5, 0.5])  # f = .9, .45, .225, .1125
    u = TokenTree.chain([5, 6], [0.35, 0.5])  # f = .35, .175
    reqs = [SelectionInput("t", 1.0, 4), SelectionInput("u", 1.0, 2)]
    everything = select_trees(reqs, {"t": t, "u": u}, budget=8)
    assert len(everything.trees["t"]) + len(everything.trees["u"]) == 6
    # 2 roots + 1 cheap node (the 0.9); past it only f >= 0.3: the 0.45 and the 0.35, nothing less likely.
    res = select_trees(reqs, {"t": t, "u": u}, budget=8, cheap_tokens=3, min_prob_beyond=0.3)
    assert len(res.trees["t"]) == 2 and len(res.trees["u"]) == 1
    assert res.budget_left == 3
    # Cheap tokens enough for everything: the rule never binds.
    assert select_trees(reqs, {"t": t, "u": u}, budget=8, cheap_tokens=8, min_prob_beyond=0.9).budget_left == 0
    # The SLO phase is not subject to it: a request that needs 1.4 tokens still gets its 0.45 node.
    slo = select_trees([SelectionInput("t", 2.3, 4)], {"t": t}, budget=8, cheap_tokens=1, min_prob_beyond=0.95)
    assert len(slo.trees["t"]) == 2 and not slo.infeasible
