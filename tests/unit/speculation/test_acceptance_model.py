"""Simulator acceptance model: sampled acceptance matches E[acc(T)] = sum f(v)."""

from __future__ import annotations

import json
import random

import pytest

from gpu_runtime.sim.acceptance import AcceptanceModel, EmpiricalAcceptance, GeometricAcceptance
from gpu_runtime.speculation.selection import SelectionInput, select_trees


@pytest.mark.parametrize("width", [1, 3])
def test_sampled_acceptance_matches_path_probabilities(width):
    rng = random.Random(5)
    model = GeometricAcceptance(alphas=[0.8, 0.7, 0.6])
    assert isinstance(model, AcceptanceModel)
    trees = [model.draft_tree(None, 5, width, rng) for _ in range(300)]
    expected = sum(t.expected_accepted() for t in trees) / len(trees)
    sampled = sum(len(model.sample_accepted(t, None, rng)) for t in trees for _ in range(20)) / (20 * len(trees))
    assert sampled == pytest.approx(expected, rel=0.05)
    for t in trees[:20]:
        assert len(t) == 5 * width
        for path in [model.sample_accepted(t, None, rng)]:
            assert all(t.parents[b] == a for a, b in zip(path, path[1:]))


def test_selection_on_confident_nodes_beats_fixed_shape():
    """Confidences carry information: the top-f subtree gets more accepted than a fixed chain."""
    rng = random.Random(9)
    model = GeometricAcceptance(alphas=[0.6], concentration=2.0)
    top_f = chain = 0
    for _ in range(400):
        t = model.draft_tree(None, 6, 3, rng)
        sel = select_trees([SelectionInput("r", 0.0, 6)], {"r": t}, budget=5).trees["r"]  # 4 nodes
        top_f += len(model.sample_accepted(sel, None, rng))
        chain += len(model.sample_accepted(t.subtree(t.ancestors(_deepest_first(t))[:4]), None, rng))
    assert top_f > chain


def _deepest_first(t):
    return max(range(len(t)), key=lambda i: (t.depths()[i], t.path_probs[i]))


def test_empirical_model_per_category(tmp_path):
    data = {"drafters": {"prompt_lookup": {"categories": {
        "summarization": {"cond_accept": [0.9, 0.8], "hit_rate": 0.9},
        "math_reasoning": {"cond_accept": [0.2], "hit_rate": 0.3}}}}}
    path = tmp_path / "acc.json"
    path.write_text(json.dumps(data))
    model = EmpiricalAcceptance.load(path)
    rng = random.Random(0)

    def mean_acc(cat):
        total = 0
        for _ in range(400):
            t = model.draft_tree(cat, 4, 1, rng)
            total += len(model.sample_accepted(t, cat, rng))
        return total / 400

    assert mean_acc("summarization") > 3 * mean_acc("math_reasoning")
    assert 0 < mean_acc("unknown") < mean_acc("summarization")  # pooled default
