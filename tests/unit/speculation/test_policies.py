"""AdaServe eq. 8-9 / A(r) / budget, AdaSpec estimator, static baselines, registry."""

from __future__ import annotations

import pytest

from gpu_runtime.executor.base import StepResult
from gpu_runtime.speculation.adaserve import AdaServe, AdaServeConfig
from gpu_runtime.speculation.adaspec import AdaSpec, AdaSpecConfig
from gpu_runtime.speculation.base import NoSpeculation
from gpu_runtime.speculation.cost import LinearStepCost, knee_budget
from gpu_runtime.speculation.registry import create_policy
from gpu_runtime.speculation.requirement import slo_requirement
from gpu_runtime.speculation.static import StaticChain, StaticTree
from gpu_runtime.speculation.token_tree import TokenTree

from .conftest import make_request, random_tree


# ---- A(r) ----
def test_requirement_interactive_on_track_and_behind():
    # 5 tokens, first at t=0, 4 decoded in 0.2 s: exactly on a 50 ms TPOT.
    r = make_request("a", tbt=0.05, outputs=5, gap=0.05)
    assert slo_requirement(r, now=0.2, t_spec=0.05) == pytest.approx(1.0)  # one token per 50 ms step
    # Same progress but 0.1 s later: two extra tokens are owed.
    assert slo_requirement(r, now=0.3, t_spec=0.05) == pytest.approx(3.0)


def test_requirement_batch_uses_deadline_rate():
    r = make_request("b", ttlt=10.0, outputs=4)
    r.predicted_output_len = 24  # 20 tokens left, 10 s left at now=0 -> 0.5 s/token
    assert slo_requirement(r, now=0.0, t_spec=1.0) == pytest.approx(2.0)


# ---- budget and eq. 8-9 ----
def test_knee_budget_from_roofline_curve():
    def curve(n):  # flat until 64 tokens, then linear
        return 0.010 * max(1.0, n / 64)
    assert knee_budget(curve, max_tokens=1024, tolerance=0.25) in range(64, 81)
    assert knee_budget(lambda n: 0.01 + 0.001 * n, max_tokens=1024, tolerance=0.5) == 6  # 0.01 + 0.001n <= 1.5 * 0.011


def test_linear_cost_fit_recovers_coefficients():
    cost = LinearStepCost()
    for nc in (100, 400, 900, 1600):
        for nb in (1, 4, 9, 16, 30):
            cost.observe(nc, nb, 2e-6 * nc + 1e-3 * nb + 0.02)
    assert cost.alpha == pytest.approx(2e-6, rel=1e-6)
    assert cost.gamma == pytest.approx(1e-3, rel=1e-6)
    assert cost.delta == pytest.approx(0.02, rel=1e-6)


def test_linear_cost_prices_a_passs_prompt_tokens_apart_from_its_decode_and_draft_tokens():
    """Chunks of prompt cost less a token than decode and draft tokens; lumped together, a draft token looks cheap."""
    cost = LinearStepCost()
    for nb in (16, 24, 40, 56):
        cost.observe(16_000, nb, 0.015 + 1.5e-3 * nb)  # plain decode passes
        for np_ in (256, 512, 1024):
            cost.observe(16_000, nb, 0.015 + 1.5e-3 * nb + 0.8e-3 * np_, np_)  # passes with a prompt chunk
    assert cost.gamma == pytest.approx(1.5e-3, rel=1e-3) and cost.gamma_prompt == pytest.approx(0.8e-3, rel=1e-3)
    assert cost.predict(16_000, 40, 512) == pytest.approx(0.015 + 0.06 + 0.4096, rel=1e-3)
    lumped = LinearStepCost()  # the same passes, prompt tokens counted as batch tokens
    for nc, nb, npr, t in cost._obs:
        lumped.observe(nc, nb + npr, t)
    assert lumped.gamma < 0.9e-3 and lumped.gamma_prompt is None
    assert lumped.predict(0, 10, 5) == pytest.approx(lumped.predict(0, 15))  # no prompt token seen: a batch token


def test_adaspecs_time_model_prices_a_draft_tokens_attention_over_its_requests_context():
    """A verified draft token reads its request's whole context, as its decode token does: at long contexts a draft
    token costs more. With N_c the contexts alone, the fit prices every draft token alike, at its mean."""
    from gpu_runtime.speculation.adaspec import _attended

    def true_time(n: int, ctx: int, k: int) -> float:  # k draft tokens per request, each attending ctx
        return 0.012 + 0.8e-3 * n * (1 + k) + 0.9e-6 * n * (1 + k) * ctx

    with_attention, contexts_only = LinearStepCost(), LinearStepCost()
    for n in (1, 2, 4, 8):
        for ctx in (200, 1000, 3000):
            for k in (0, 1, 2, 4):
                t, context, verified = true_time(n, ctx, k), n * ctx, n * k
                with_attention.observe(_attended(context, n, verified), n + verified, t)
                contexts_only.observe(context, n + verified, t)
    for ctx in (200, 3000):  # 32 draft tokens at batch 8
        extra = true_time(8, ctx, 4) - true_time(8, ctx, 0)
        priced = with_attention.predict(_attended(8 * ctx, 8, 32), 40) - with_attention.predict(8 * ctx, 8)
        assert priced == pytest.approx(extra, rel=0.02)
    extra = true_time(8, 3000, 4) - true_time(8, 3000, 0)
    assert contexts_only.predict(24_000, 40) - contexts_only.predict(24_000, 8) < 0.8 * extra


def test_adaserve_depth_width_follow_load():
    pol = AdaServe(AdaServeConfig(d_min=2, d_max=8, w_max=3, c1=1, c2=0, draft_budget=12))
    assert pol.shape(1, budget=64) == (8, 3)  # light load: deepest, widest
    d16, w16 = pol.shape(16, budget=64)
    assert d16 == 2 and w16 == 1  # eq. 8: floor(64/17) - 1 = 2; eq. 9: floor(12/16) = 0 -> 1
    assert pol.shape(4, budget=64) == (8, 3)
    assert pol.shape(8, budget=64) == (6, 1)


def test_adaserve_budget_uses_latency_curve_when_bound():
    class Exec:
        latency_curve = staticmethod(lambda n: 0.01 * max(1.0, n / 32))
    pol = AdaServe(budget_tolerance=0.25)
    pol.bind(Exec())
    assert 32 <= pol.budget(4) <= 40


def test_adaserve_plan_and_select_meets_requirements(rng):
    behind = make_request("behind", tbt=0.05, outputs=5, gap=0.05)  # needs 2 tokens at now=0.25
    ahead = make_request("ahead", tbt=0.5, outputs=5, gap=0.05)
    pol = AdaServe(AdaServeConfig(budget=6, d_min=2, d_max=4))
    entries = pol.draft_plan([behind, ahead], now=0.25)
    assert {e.request_id for e in entries} == {"behind", "ahead"}
    cands = {"behind": TokenTree.chain([1, 2, 3], [0.8, 0.8, 0.8]),
             "ahead": TokenTree.chain([4, 5, 6], [0.95, 0.95, 0.95])}
    trees = pol.select([behind, ahead], cands, now=0.25)
    assert pol.last is not None and not pol.last.infeasible
    assert pol.last.expected["behind"] >= slo_requirement(behind, 0.25, 0.0)
    assert sum(len(t) for t in trees.values()) == 4  # B=6 minus two roots
    pol.observe([behind, ahead], trees, StepResult(accepted_nodes={"behind": [0]}, latency_s=0.04), 0.01, 0.3)
    assert pol.t_spec.value == pytest.approx(0.05)


# ---- AdaSpec ----
def _seeded_adaspec(**kw) -> AdaSpec:
    target = LinearStepCost(alpha=0.0, gamma=0.002, delta=0.02)
    draft = LinearStepCost(alpha=0.0, gamma=0.0005, delta=0.002)
    pol = AdaSpec(target_cost=target, draft_cost=draft, warmup_steps=0, **kw)
    return pol


def test_adaspec_length_grows_with_confidence():
    sure, unsure = _seeded_adaspec(), _seeded_adaspec()
    for e in sure.confidence:
        e.value = 0.95
    for e in unsure.confidence:
        e.value = 0.1
    assert sure.plan_length(n=2, context=100, tpot_limit=None) > unsure.plan_length(n=2, context=100, tpot_limit=None)
    assert unsure.plan_length(n=2, context=100, tpot_limit=None) == 0


def test_adaspec_length_is_first_local_maximum():
    pol = _seeded_adaspec()
    for e in pol.confidence:
        e.value = 0.8
    sl = pol.plan_length(n=1, context=0, tpot_limit=None)
    rates = lambda k: [pol._acceptance([0.8] * k)]  # noqa: E731
    g = [pol.estimate(1, 0, k, rates(k), None).goodput for k in range(0, 9)]
    assert g[sl] >= g[sl - 1] if sl > 0 else True
    assert sl == 8 or g[sl + 1] <= g[sl]


def test_adaspec_tpot_limit_stops_drafting():
    pol = _seeded_adaspec(tpot_check="step")  # the paper's Alg. 3: the step's time within the target
    for e in pol.confidence:
        e.value = 0.95
    free = pol.plan_length(n=1, context=0, tpot_limit=None)
    assert free >= 3
    # one draft step costs 0.0025 s on top of 0.022 s: a 0.026 s limit allows at most one
    assert pol.plan_length(n=1, context=0, tpot_limit=0.026) <= 1
    # a target that even a plain step (0.022 s) breaks binds nothing: only accepted drafts can bring a request's
    # pace toward it, so the length is goodput's, as with no target (before, every chain was refused there)
    assert pol.plan_length(n=1, context=0, tpot_limit=0.015) == free
    pol._step_plan, pol._step_tokens, pol._step_verified = (1, 0, 0.015), 1.0, 0  # a draft model's later depths
    assert pol.keep_drafting(1, {"a": 0.95})
    pol._step_plan, pol._step_tokens, pol._step_verified = (1, 0, 0.026), 1.0, 0
    assert not pol.keep_drafting(1, {"a": 0.95})  # two draft steps and two tokens: past 0.026 s


def test_adaspec_tpot_check_per_token_bounds_the_expected_time_a_token():
    """The default reads Alg. 3's target as a pace: the step's decode time over the tokens a request is expected
    to get from it. A 40 ms step that yields 2 tokens keeps a 25 ms target, one that yields 1.5 does not; the
    paper's check refuses both. Where a plain step (22 ms) already breaks the target, neither binds."""
    per_token, step = _seeded_adaspec(), _seeded_adaspec(tpot_check="step")
    assert per_token.config.tpot_check == "per-token"
    assert not per_token._breaks_tpot(0, 1, 0.040, 2.0, 0.025) and step._breaks_tpot(0, 1, 0.040, 2.0, 0.025)
    assert per_token._breaks_tpot(0, 1, 0.040, 1.5, 0.025) and step._breaks_tpot(0, 1, 0.040, 1.5, 0.025)
    assert not per_token._breaks_tpot(0, 1, 0.040, 1.5, 0.015) and not step._breaks_tpot(0, 1, 0.040, 1.5, 0.015)
    for e in per_token.confidence:
        e.value = 0.95
    assert per_token.plan_length(n=1, context=0, tpot_limit=0.026) == per_token.plan_length(1, 0, None)


def test_adaspec_verifier_drops_unlikely_tail():
    pol = _seeded_adaspec()
    pol._steps = 100
    pol._length = 4
    a, b = make_request("a"), make_request("b")
    cands = {"a": TokenTree.chain([1, 2, 3, 4], [0.95, 0.95, 0.95, 0.95]),
             "b": TokenTree.chain([5, 6, 7, 8], [0.9, 0.05, 0.9, 0.9])}
    out = pol.select([a, b], cands, now=0.0)
    assert len(out["a"]) == 4
    assert len(out["b"]) == 1  # after the 0.05 step, acceptance is ~4% and costs more than it returns
    assert out["b"].token_ids == [5]


def test_adaspec_in_a_co_serving_pass_keeps_only_likely_tokens_beyond_the_spare_time():
    def select(spare, min_prob=0.85, prefill=0, free_beside_prefill=False):
        pol = _seeded_adaspec(min_prob_beyond_slack=min_prob, spare_free_beside_prefill=free_beside_prefill)
        pol._steps, pol._length, pol.pass_spare_s, pol.prefill_tokens_in_pass = 100, 4, spare, prefill
        a = make_request("a", ttlt=1e6)
        chain = TokenTree.chain([1, 2, 3, 4], [0.95, 0.95, 0.95, 0.95])  # path 0.95, 0.90, 0.86, 0.81
        return len(pol.select([a], {"a": chain}, now=0.0)["a"])

    assert select(None) == 4  # no scheduler time budget: Alg. 2 keeps all four
    assert select(0.0) == 3  # nothing fits the spare time: only path probability >= 0.85
    assert select(0.0045) == 3  # two tokens (2 ms each) are cheap: the two most likely; the third passes 0.85
    assert select(0.0085) == 4  # all four fit the spare time
    assert select(0.0, min_prob=0.0) == 4  # rule off
    # beside a prefill chunk the spare time is not free: the queued prompts wait for the whole pass
    assert select(0.0085, prefill=32) == 3
    assert select(0.0085, prefill=32, free_beside_prefill=True) == 4


def test_adaspec_free_draft_drafts_max_length_and_stops_on_real_confidences():
    """Prompt lookup: draft steps cost ~nothing, so the whole chain is drafted and Alg. 1's
    stop rule runs on the proposed chain's own confidences (not on predicted ones)."""
    target = LinearStepCost(alpha=0.0, gamma=0.002, delta=0.02)
    pol = AdaSpec(target_cost=target, draft_cost=LinearStepCost(alpha=0.0, gamma=0.0, delta=1e-6), warmup_steps=0)
    for e in pol.confidence:
        e.value = 0.05  # history says: do not draft (a model draft would get length 0)
    a = make_request("a")
    entries = pol.draft_plan([a], 0.0)
    assert [e.depth for e in entries] == [pol.config.max_length]
    cands = {"a": TokenTree.chain([1, 2, 3, 4, 5, 6, 7, 8], [0.95, 0.9, 0.85, 0.01, 0.01, 0.01, 0.01, 0.01])}
    out = pol.select([a], cands, now=0.0)
    assert out["a"].token_ids == [1, 2, 3]
    seeded = _seeded_adaspec()  # a draft model (11% of a target pass): the first step on the predicted confidence
    for e in seeded.confidence:
        e.value = 0.05
    assert seeded.draft_plan([a], 0.0) == []


def test_adaspec_takes_a_drafter_timed_at_zero_as_free():
    """vLLM's n-gram drafter runs inside the step it verifies: the policy hears a draft time of 0. That is a
    free draft (the whole chain, Alg. 1 on its confidences), not a draft cost never measured (the warm-up's
    cycle through lengths 1..max_length, forever)."""
    pol = AdaSpec(warmup_steps=4)
    a = make_request("a")
    for step in range(12):
        entries = pol.draft_plan([a], float(step))
        chain = TokenTree.chain(list(range(entries[0].depth)), [0.9] * entries[0].depth)
        selected = pol.select([a], {"a": chain}, float(step))
        pol.observe([a], selected, StepResult(accepted_nodes={"a": [0, 1]}, latency_s=0.02 + 0.001 * len(chain)),
                    0.0, float(step))
    assert pol.draft_cost.fitted and pol.draft_cost.predict(100, 1) == 0.0
    assert [e.depth for e in pol.draft_plan([a], 12.0)] == [pol.config.max_length]


def _drafted_depth(pol: AdaSpec, path_prob, max_depth: int = 8) -> int:
    """The depth a drafter reaches asking ``keep_drafting`` after each depth (both requests alike)."""
    depth = 1
    while depth < max_depth and pol.keep_drafting(depth, {"a": path_prob(depth), "b": path_prob(depth)}):
        depth += 1
    return depth


def test_adaspec_draft_model_decides_each_further_step_on_the_real_confidences():
    """Alg. 1's predict-execute-correct: the first step on the predicted confidence, every further one
    on the confidences the draft model really had (costs as in _seeded_adaspec: draft step 3 ms for 2
    requests, target 20 ms + 2 ms per token; batch jobs with a far deadline: no TPOT limit)."""
    a, b = make_request("a", ttlt=1e6), make_request("b", ttlt=1e6)
    pol = _seeded_adaspec()
    for e in pol.confidence:
        e.value = 0.8
    assert pol.plan_length(n=2, context=0, tpot_limit=None) == 3  # up front, 0.8 per step looks worth 3
    assert [e.depth for e in pol.draft_plan([a, b], 0.0)] == [8, 8]  # the drafter asks before each depth
    # after depth 1 (0.9 each): 3.8 tokens in 31 ms vs 5.24 in 38 ms -> go on
    assert pol.keep_drafting(1, {"a": 0.9, "b": 0.9}) and pol._length == 2
    # the chains collapse at depth 2 (path 0.05): 3.9 tokens in 38 ms vs 3.98 in 45 ms -> stop
    assert not pol.keep_drafting(2, {"a": 0.05, "b": 0.05}) and pol._length == 2
    # real confidences of 0.97 per step carry the chains past the up-front plan
    for predicted, plan, reached in ((0.6, 1, 3), (0.8, 3, 6)):
        pol = _seeded_adaspec()
        for e in pol.confidence:
            e.value = predicted
        assert pol.plan_length(n=2, context=0, tpot_limit=None) == plan
        pol.draft_plan([a, b], 0.0)
        assert _drafted_depth(pol, lambda d: 0.97 ** d) == reached == pol._length
    # a 36 ms TBT target on schedule (token 6 due at 1.0 + 5 * 0.036 = 1.18 s, now 1.17 s): a second step
    # (38 ms with its verification) would break it (Alg. 3)
    tight = [make_request("a", tbt=0.036), make_request("b", tbt=0.036)]
    for now, depth in ((1.17, 1), (0.0, 8)):  # at 0 s the next token is due in 1.18 s: no step breaks that
        pol = _seeded_adaspec(tpot_check="step")
        for e in pol.confidence:
            e.value = 0.95
        pol.draft_plan(tight, now)
        assert _drafted_depth(pol, lambda d: 0.97 ** d) == depth
    # read as a pace (the default), the longer steps' expected time per token stays within the 36 ms
    pol = _seeded_adaspec()
    for e in pol.confidence:
        e.value = 0.95
    pol.draft_plan(tight, 1.17)
    assert _drafted_depth(pol, lambda d: 0.97 ** d) > 1


def test_adaspec_fits_the_target_on_every_token_of_a_co_serving_pass():
    """The scheduler puts prefill chunks in the same pass: the fit must count their tokens, or a pass's
    chunk time lands on the few decode tokens and tree tokens look many times dearer than they are."""
    import random

    pol = AdaSpec(AdaSpecConfig(warmup_steps=0))
    rng = random.Random(0)
    reqs = [make_request(f"r{i}") for i in range(8)]
    for _ in range(64):
        pol.prefill_tokens_in_pass = rng.choice([0, 256, 1024, 2048])
        pol.draft_plan(reqs, 0.0)
        verified = rng.randrange(0, 24)
        selected = {"r0": TokenTree.chain(list(range(verified)))} if verified else {}
        latency = 0.02 + 1e-4 * (len(reqs) + verified + pol.prefill_tokens_in_pass)  # every token of the pass
        pol.observe(reqs, selected, StepResult(latency_s=latency), 0.0, 0.0)
    assert pol.target_cost.gamma == pytest.approx(1e-4, rel=0.02)
    context = sum(r.num_computed_tokens for r in reqs)
    assert pol.target_cost.predict(context, 100) == pytest.approx(0.02 + 1e-4 * 100, rel=0.02)


# ---- static baselines and registry ----
def test_static_chain_and_tree_shapes(rng):
    reqs = [make_request("a"), make_request("b")]
    chain = StaticChain(3)
    assert [(e.depth, e.width) for e in chain.draft_plan(reqs, 0.0)] == [(3, 1), (3, 1)]
    wide = random_tree(rng, 12)
    sel = chain.select(reqs, {"a": wide}, 0.0)
    assert sel["a"].parents == list(range(-1, len(sel["a"]) - 1)) and len(sel["a"]) <= 3
    tree = StaticTree(num_nodes=5)
    sel = tree.select(reqs, {"a": wide, "b": random_tree(rng, 3)}, 0.0)
    assert len(sel["a"]) == 5 and len(sel["b"]) == 3
    top5 = sorted(wide.path_probs, reverse=True)[:5]
    assert sorted(sel["a"].path_probs, reverse=True) == pytest.approx(top5)


def test_registry_names():
    assert isinstance(create_policy("none"), NoSpeculation)
    assert create_policy("chain-4").length == 4
    assert isinstance(create_policy("static-tree"), StaticTree)
    assert create_policy("adaserve", budget=16).config.budget == 16
    assert create_policy("nightjar", max_gamma=3).config.max_gamma == 3
    with pytest.raises(ValueError):
        create_policy("eagle")
    with pytest.raises(TypeError):
        create_policy("adaspec", no_such_knob=1)


def test_adaptive_lengths_go_up_to_what_the_drafter_proposes():
    """vLLM drafts num_speculative_tokens per request: each policy's longest length becomes that."""
    assert create_policy("adaspec", longest_draft=16).config.max_length == 16
    assert create_policy("nightjar", longest_draft=16).config.max_gamma == 16
    ada = create_policy("adaserve", longest_draft=16).config
    assert ada.fallback_depth == 16 and ada.d_max == AdaServeConfig.d_max
    assert create_policy("adaserve", longest_draft=2).config.d_max == 2
    assert create_policy("nightjar", longest_draft=16, max_gamma=3).config.max_gamma == 3  # explicit config wins
    assert create_policy("chain-4", longest_draft=16).length == 4
    # one chain per request (vLLM): no beam width, so AdaServe's eq. 8 may go as deep as the drafter
    assert create_policy("adaserve", longest_draft=16, chains_only=True).config.d_max == 16
    assert create_policy("adaspec", longest_draft=16, chains_only=True).config.max_length == 16


def test_position_acceptance_learns_each_position_of_a_copying_drafter():
    """A chain of k tokens with a accepted tried positions 1..min(a + 1, k) and passed 1..a."""
    from gpu_runtime.speculation.draft_acceptance import PositionAcceptance

    acc = PositionAcceptance(longest=8, prior=0.6, weight=0.05)
    assert acc.conditionals(3) == [0.6, 0.6, 0.6]
    for _ in range(400):  # a lookup that misses at once half the time, and copies 4 tokens when it hits
        acc.observe(4, 0)
        acc.observe(4, 4)
    q = acc.conditionals(8)
    assert abs(q[0] - 0.5) < 0.05  # position 1: half the chains
    assert q[1] > 0.95 and q[2] > 0.95 and q[3] > 0.95  # past a first hit the copy goes on
    assert acc.seen[4:] == [0] * 4 and q[4:] == [q[3]] * 4  # never verified: the deepest measured rate
    acc.observe(2, 1)  # a rejection at position 2 lowers position 2, not position 3
    assert acc.conditionals(3)[1] < q[1] and acc.conditionals(3)[2] == q[2]
    assert acc.conditionals(10)[8:] == [acc.conditionals(8)[7]] * 2  # past the longest: the last rate


def test_position_acceptance_leaves_the_prior_as_fast_at_deep_positions_as_at_the_first():
    """Few chains reach a deep position: its rate is the mean of what it saw (the prior counting as one) until the
    EMA's window is reached, not an EMA that creeps away from the prior."""
    from gpu_runtime.speculation.draft_acceptance import PositionAcceptance

    acc = PositionAcceptance(longest=12, prior=0.6, weight=0.02)
    for _ in range(9):  # nine 12-token chains, all accepted
        acc.observe(12, 12)
    q = acc.conditionals(12)
    assert q == [q[0]] * 12 and abs(q[0] - (0.6 + 9) / 10) < 1e-9  # (prior + 9 hits) / 10
    for _ in range(500):  # past 1/weight tokens it forgets at the EMA's rate
        acc.observe(1, 0)
    assert acc.conditionals(1)[0] < 0.01


def test_proposal_acceptance_keeps_a_self_sizing_drafters_long_proposals_apart_from_its_guesses():
    """Suffix decoding proposes many tokens when its tree is confident and one when it guesses: the rates of a long
    proposal come from long proposals once they have enough, the pooled rates before and for unseen sizes."""
    from gpu_runtime.speculation.draft_acceptance import ProposalAcceptance, size_class

    assert [size_class(n) for n in (0, 1, 2, 3, 4, 7, 8, 12, 16)] == [1, 1, 2, 2, 3, 3, 4, 4, 5]
    acc = ProposalAcceptance(longest=12, min_seen=8)
    for _ in range(4):
        acc.observe(12, 12, 12)  # confident proposals: every token accepted
    assert acc.conditionals(12, proposed=12) == acc.pooled.conditionals(12)  # too few yet: the pooled rates
    for _ in range(40):
        acc.observe(12, 12, 12)
        for _ in range(3):
            acc.observe(1, 1, 0)  # guesses: rejected
    long, guess, pooled = acc.conditionals(12, proposed=12), acc.conditionals(1, proposed=1), acc.pooled.conditionals(1)
    assert long[0] > 0.95 and guess[0] < 0.1 and guess[0] < pooled[0] < long[0]
    assert acc.conditionals(12, proposed=5) == acc.pooled.conditionals(12)  # a size never proposed: pooled
    assert acc.conditionals(4, proposed=9) == long[:4]  # 9 is in 12's class
    acc.observe(12, 6, 6)  # trimmed to 6 and all accepted: positions 1..6 of the class learn, 7.. do not
    assert acc.by_size[4].seen[5] == 45 and acc.by_size[4].seen[6] == 44


def test_adaserve_budget_from_cost_model_knee():
    from gpu_runtime.costmodel.base import batch_time
    from gpu_runtime.costmodel.profile import A100_PROFILE, load_cost_model

    cm = load_cost_model(A100_PROFILE, ("piecewise-linear",))

    class Exec:
        cost_model = cm

    pol = AdaServe(budget_tolerance=0.25, budget_reference="one-token")
    pol.bind(Exec())
    b = pol.budget(8)
    base = batch_time(cm, 1)
    assert batch_time(cm, b) <= 1.25 * base < batch_time(cm, 2 * b)
    assert b > 32  # an 8B model on an A100 verifies dozens of tokens for ~the price of one
    # Relative to the pass itself: with 200 decodes and a 512-token chunk the pass is past the knee,
    # B still slows it by at most the tolerance, and never falls below the one-token knee.
    pol = AdaServe(budget_tolerance=0.25)
    pol.bind(Exec())
    assert pol.budget(8) >= b
    loaded = pol.budget(200, prefill_tokens=512)
    assert loaded > 200 + b // 2
    assert batch_time(cm, loaded + 512) <= 1.25 * batch_time(cm, 200 + 512) < batch_time(cm, 2 * loaded + 512)


def test_adaserve_counts_the_tokens_that_fit_the_passs_spare_time_as_cheap():
    from gpu_runtime.costmodel.base import batch_time
    from gpu_runtime.costmodel.profile import A100_PROFILE, load_cost_model

    cm = load_cost_model(A100_PROFILE, ("piecewise-linear",))

    class Exec:
        cost_model = cm

    pol = AdaServe(min_prob_beyond_slack=0.3)
    pol.bind(Exec())
    pol.pass_spare_s = None  # no time budget from the scheduler: all of B is cheap
    b = pol.budget(16, prefill_tokens=256)
    assert pol._cheap is None
    pol.pass_spare_s = 0.0  # the decodes' slack is spent: only the roots are cheap
    b = pol.budget(16)
    assert pol._cheap == 16
    pol.pass_spare_s = 0.002
    pol.budget(16)
    cheap = pol._cheap
    assert 16 < cheap < b
    grow = batch_time(cm, cheap) - batch_time(cm, 16)
    assert grow <= 0.002 < batch_time(cm, cheap + 1) - batch_time(cm, 16)
    # beside a prefill chunk the spare time is the queued prompts' too: no tree token is cheap there
    pol.budget(16, prefill_tokens=256)
    assert pol._cheap == 16
    free = AdaServe(min_prob_beyond_slack=0.3, spare_free_beside_prefill=True)
    free.bind(Exec())
    free.pass_spare_s = 0.002
    free.budget(16, prefill_tokens=256)
    assert 16 < free._cheap
    assert batch_time(cm, 256 + free._cheap) - batch_time(cm, 256 + 16) <= 0.002
    assert AdaServe(min_prob_beyond_slack=0.0).config.min_prob_beyond_slack == 0.0


def test_linear_cost_fit_stays_nonnegative_without_compensating():
    """One request: context barely moves and N_b is constant. Clipping a negative alpha of the
    unconstrained fit used to leave a huge intercept (a 0.1 ms draft step predicted at ~60 ms)."""
    import random

    rng = random.Random(0)
    cost = LinearStepCost()
    for i in range(40):
        cost.observe(770 + i, 1, 1e-4 * (1 + 0.3 * rng.random()) + (2e-3 if i == 0 else 0.0))
    assert min(cost.alpha, cost.gamma, cost.delta) >= 0.0
    assert cost.predict(800, 1) < 5e-4
    # the verification pass: per-token slope recovered under noise, no negative coefficient
    target = LinearStepCost()
    for i in range(60):
        nb = 1 + i % 9
        target.observe(760 + i, nb, 0.090 + 0.0045 * (nb - 1) + 0.004 * rng.random())
    assert target.gamma == pytest.approx(0.0045, rel=0.25)
    assert target.predict(800, 1) == pytest.approx(0.092, rel=0.05)


def test_adaspec_probes_after_stopping():
    """Length 0 is not absorbing: confidences are refreshed by a periodic 1-token probe."""
    target = LinearStepCost(alpha=0.0, gamma=0.002, delta=0.02)
    draft = LinearStepCost(alpha=0.0, gamma=0.0005, delta=0.002)
    pol = AdaSpec(AdaSpecConfig(warmup_steps=0, probe_every=4), target_cost=target, draft_cost=draft)
    for e in pol.confidence:
        e.value = 0.0  # nothing was ever accepted: plan length 0
    reqs = [make_request("a")]
    plans = [pol.draft_plan(reqs, now=0.0) for _ in range(8)]
    assert [len(p) for p in plans] == [0, 0, 0, 1, 0, 0, 0, 1]
    assert plans[3][0].depth == 1


def test_adaspec_tpot_constraint_allows_a_longer_step_to_a_request_ahead_of_its_deadlines():
    from gpu_runtime.speculation.adaspec import _tightest_tpot

    # TTFT 1 s, TBT 50 ms from arrival: token n is due at 1.0 + (n-1) * 0.05
    ahead = make_request("ahead", tbt=0.05, outputs=25)  # token 26 due at 2.25
    on_time = make_request("on-time", tbt=0.05, outputs=5)  # token 6 due at 1.25
    assert _tightest_tpot([ahead], 1.24) == pytest.approx(1.01)  # 25 tokens ahead: a long step still delivers
    assert _tightest_tpot([on_time], 1.24) == pytest.approx(0.05)  # 10 ms left: the TBT itself (Alg. 3)
    assert _tightest_tpot([ahead, on_time], 1.24) == pytest.approx(0.05)  # the tightest of the batch
    # a batch job keeps the rate its deadline needs: 59 tokens left (max_tokens 64) in 8.76 s
    assert _tightest_tpot([make_request("job", ttlt=10.0)], 1.24) == pytest.approx(8.76 / 59)


def test_adaspecs_most_kept_is_each_warm_up_steps_length_and_max_length_past_it():
    """What the vLLM adapter counts of a decode's drafts before the step is planned: during the warm-up exactly the
    length AdaSpec then drafts (1..max_length in turn), past it max_length (Alg. 1 and 2 choose on the drafts)."""
    policy = AdaSpec(AdaSpecConfig(max_length=3, warmup_steps=5),
                     target_cost=LinearStepCost(gamma=1e-3, delta=1e-2), draft_cost=LinearStepCost(gamma=1e-4))
    decodes = [make_request("a"), make_request("b")]
    told, drafted = [], []
    for _ in range(7):
        told.append(policy.most_kept(len(decodes)))
        drafted.append(max((e.depth for e in policy.draft_plan(decodes, now=1.0)), default=0))
    assert told[:5] == drafted[:5] == [1, 2, 3, 1, 2]
    assert told[5:] == [3, 3] and all(d <= 3 for d in drafted[5:])


@pytest.mark.parametrize(("budget", "most"), [(4, 3), (2, 1), (1, 0), (None, 4)])
def test_adaserves_most_kept_is_what_b_and_eq_8_leave_one_request(budget, most):
    """B fixed by hand: B less the request's root (none at B = 1, the root alone); no latency curve yet: the warm-up's
    B per request, eq. 8's depth of it (4). A lone request with a likely 8-token chain keeps exactly that many."""
    policy = AdaServe(AdaServeConfig(d_max=8, budget=budget))
    assert policy.most_kept(3) == most
    decodes = [make_request("a")]
    depth = max((e.depth for e in policy.draft_plan(decodes, now=1.0)), default=0)
    chain = TokenTree.chain(list(range(100, 100 + depth)), [0.99] * depth) if depth else None
    kept = policy.select(decodes, {"a": chain} if chain else {}, now=1.0)
    assert len(kept.get("a", ())) == most
