"""The speculation benchmarks charge the drafter whose acceptance they use, Nightjar's
reward and arm sharing across batch sizes, AdaServe's A(r) after drafting, and the
attainment metric's TTFT rule."""

from __future__ import annotations


import pytest

from gpu_runtime.costmodel.linear import PiecewiseLinearCostModel
from gpu_runtime.executor.base import DraftEntry, StepResult
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.qos import QoSClass, QoSSpec
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.sim.acceptance import GeometricAcceptance
from gpu_runtime.speculation.adaserve import AdaServe
from gpu_runtime.speculation.nightjar import GammaBandit, Nightjar, NightjarConfig
from gpu_runtime.speculation.token_tree import TokenTree

from tests.conftest import ops_script

from .conftest import make_request



@pytest.fixture(scope="module")
def harness():
    return ops_script("bench_spec_harness")


# ---- drafter consistency ----
def test_prompt_lookup_costs_host_time_per_request_and_never_lags(harness):
    pl = harness.DRAFTERS["prompt-lookup"]
    assert not pl.model and pl.acceptance == "measured"
    profile = harness.PROFILES["4090-7b"]
    cost = pl.cost(profile, [100, 1000], depth=4, width_tokens=6)
    assert cost == pytest.approx(2 * pl.cpu_s_per_request + 1100 * pl.cpu_s_per_context_token)
    assert cost < profile.draft_weights_s  # far below one step of the 0.5B draft model
    ex = harness.HarnessExecutor(profile, drafter=pl)
    assert ex.draft_switch_cost(500, 64) == 0.0 and not ex.draft_offloadable and ex.draft_blocks == 0


def test_draft_model_uses_an_assumed_acceptance(harness):
    dm = harness.DRAFTERS["draft-model"]
    assert dm.model and dm.acceptance == "assumed"
    assert isinstance(harness.acceptance_for(dm), GeometricAcceptance)
    profile = harness.PROFILES["4090-7b"]
    assert dm.cost(profile, [100, 100], 3, 2) == pytest.approx(
        profile.draft_step(200, 2) + 2 * profile.draft_step(200, 2))
    assert harness.HarnessExecutor(profile, drafter=dm).draft_offloadable


def test_sim_executor_charges_cpu_drafting_per_request_and_context():
    cost = PiecewiseLinearCostModel([0.010, 0.0, 1e-4, 0.0, 0.0, 0.0], 0.0)
    ex = SimExecutor(cost, acceptance=GeometricAcceptance(), draft_cpu_s_per_request=1e-5,
                     draft_cpu_s_per_context_token=1e-7)
    for rid, n in (("a", 100), ("b", 300)):
        ex.blocks.allocate(rid, n)
    out = ex.draft([DraftEntry("a", 3, 1), DraftEntry("b", 3, 1)])
    assert out.latency_s == pytest.approx(2e-5 + 400e-7)
    assert ex.draft_switch_cost(400, 2) == 0.0  # no draft model: nothing to catch up


def test_sim_draft_model_stops_where_keep_drafting_says_and_charges_those_depths():
    cost = PiecewiseLinearCostModel([0.010, 0.0, 1e-4, 0.0, 0.0, 0.0], 0.0)
    ex = SimExecutor(cost, acceptance=GeometricAcceptance(alphas=[0.8]), draft_cost_s=0.002)
    asked = []

    def keep(depth, best):
        asked.append((depth, sorted(best)))
        return depth < 2

    out = ex.draft([DraftEntry("a", 5, 1), DraftEntry("b", 5, 1)], keep)
    assert asked == [(1, ["a", "b"]), (2, ["a", "b"])]
    assert all(max(t.depths()) == 2 for t in out.trees.values())
    assert out.latency_s == pytest.approx(2 * 0.002)
    assert ex.draft([DraftEntry("a", 5, 1)]).latency_s == pytest.approx(5 * 0.002)  # no callback: its depth


def test_azure_traces_use_the_same_stand_ins_as_adaserve_categories(harness):
    assert harness.TRACE_CATEGORY == {"code": harness.ACCEPTANCE_CATEGORY["coding"],
                                      "conv": harness.ACCEPTANCE_CATEGORY["chat"]}


# ---- closed-loop phases ----
def _first_admitted_in_phase_one(harness, policy: str, starts):
    from gpu_runtime.speculation.registry import create_policy

    qos = QoSSpec(QoSClass.BATCH, ttlt_s=3600.0)
    arrivals = [harness.Arrival(0.01 * i, 32, 32, "coding", qos) for i in range(60)]
    dm = harness.DRAFTERS["draft-model"]
    m = harness.simulate(create_policy(policy), arrivals, harness.PROFILES["4090-7b"], harness.acceptance_for(dm),
                         concurrency=lambda t: 4, horizon_s=2.0, phase_s=1.0, drafter=dm, phase_starts=starts)
    return m.admitted_by_phase


def test_paired_phases_admit_the_same_requests_whatever_the_policy_did_before(harness):
    # chain-4 decodes faster, so it gets through more of phase 0's requests than no speculation
    plain, fast = (_first_admitted_in_phase_one(harness, p, None) for p in ("none", "chain-4"))
    assert len(fast[0]) > len(plain[0])
    assert fast[1][0] > plain[1][0]  # one stream: phase 1 meets later requests under chain-4
    plain, fast = (_first_admitted_in_phase_one(harness, p, [0, 30]) for p in ("none", "chain-4"))
    assert len(fast[0]) > len(plain[0])
    n = min(len(plain[1]), len(fast[1]))
    assert plain[1][0] == 30 and plain[1][:n] == fast[1][:n]  # paired: phase 1 reads from its own start


def _largest_batch(harness, policy: str) -> int:
    from gpu_runtime.speculation.registry import create_policy

    pol = create_policy(policy)
    plan, seen = pol.draft_plan, [0]

    def counted(decodes, now):
        seen[0] = max(seen[0], len(decodes))
        return plan(decodes, now)

    pol.draft_plan = counted
    qos = QoSSpec(QoSClass.BATCH, ttlt_s=3600.0)
    arrivals = [harness.Arrival(0.0, 2048, 64, "coding", qos) for _ in range(120)]
    dm = harness.DRAFTERS["draft-model"]
    harness.simulate(pol, arrivals, harness.PROFILES["4090-7b"], harness.acceptance_for(dm), drafter=dm)
    return seen[0]


def test_a_loaded_draft_model_takes_kv_blocks_from_the_batch(harness):
    profile = harness.PROFILES["4090-7b"]
    per_request = -(-(2048 + 64) // 16) + 1
    with_draft = (profile.kv_blocks - profile.draft_kv_blocks) // per_request
    assert 0 < profile.draft_kv_blocks < profile.kv_blocks
    assert _largest_batch(harness, "chain-2") == with_draft  # the pool less the draft's share
    assert _largest_batch(harness, "none") == profile.kv_blocks // per_request > with_draft  # no draft loaded


# ---- attainment ----
def test_request_deferred_past_its_ttft_is_not_attained(harness):
    qos = QoSSpec(QoSClass.INTERACTIVE, ttft_s=1.0, tbt_s=0.05)
    arrivals, reqs = {}, []
    for rid, first in (("fast", 0.5), ("late", 5.0)):
        req = Request(rid, [1] * 8, SamplingParams(max_tokens=4, ignore_eos=True), qos, 0.0)
        req.output_token_ids = [0] * 4
        req.token_times = [first + 0.01 * i for i in range(4)]
        req.status = RequestStatus.FINISHED_LENGTH
        reqs.append(req)
        arrivals[rid] = harness.Arrival(0.0, 8, 4, "qa", qos)
    m = harness._metrics("x", reqs, arrivals, 6.0, 1.0, 10, 8)
    assert (m.attained, m.attained_tpot, m.requests) == (1, 2, 2)
    assert m.goodput_tokens == 4


def test_open_loop_goodput_is_over_the_arrivals_span_whatever_each_policys_drain(harness):
    """Policies given the same arrivals are divided by the same time, the arrivals' span: a slower one's longer
    drain after the last arrival costs it the requests it made late, not a longer divisor too."""
    from gpu_runtime.speculation.registry import create_policy

    qos = QoSSpec(QoSClass.BATCH, ttlt_s=3600.0)  # every request attains: goodput is tokens over the span
    arrivals = [harness.Arrival(0.5 + 0.01 * i, 32, 64, "coding", qos) for i in range(40)]
    dm = harness.DRAFTERS["draft-model"]
    runs = [harness.simulate(create_policy(p), arrivals, harness.PROFILES["4090-7b"], harness.acceptance_for(dm),
                             drafter=dm) for p in ("none", "chain-4")]
    assert harness.arrival_span(arrivals) == pytest.approx(0.39)
    assert harness.arrival_span(arrivals, 0.7) == pytest.approx(0.2)
    assert [m.makespan_s for m in runs] == [pytest.approx(0.39)] * 2  # the drains differ; the spans do not
    assert runs[0].goodput == runs[1].goodput == pytest.approx(40 * 64 / 0.39)


# ---- Nightjar ----
def _feed(bandit: GammaBandit, batch: int, per_request: list[float], times: int = 4) -> None:
    for _ in range(times):
        for g, r in enumerate(per_request):
            bandit.update(batch, g, r * batch)


def test_larger_batches_only_play_lengths_that_won_at_smaller_ones():
    b = GammaBandit(NightjarConfig(max_gamma=5, seed=1))
    assert b.arm_cap(64) == 5  # nothing learned yet
    _feed(b, 8, [10.0, 14.0, 12.0, 9.0, 8.0, 7.0])  # best at batch 8: gamma 1
    assert b.arm_cap(64) == 1 and b.arm_cap(8) == 5 and b.arm_cap(4) == 5
    seen = {b.choose(64) for _ in range(300) if not b.update(64, 0, 640.0)}
    assert seen <= {0, 1}


def test_arm_cap_ignores_buckets_without_enough_data_and_keeps_near_ties():
    b = GammaBandit(NightjarConfig(max_gamma=3, share_tolerance=0.05, unimodal=False))
    _feed(b, 4, [10.0, 11.0, 10.6], times=4)  # gamma 3 never tried at batch 4: no evidence yet
    assert b.arm_cap(32) == 3
    _feed(b, 4, [10.0, 11.0, 10.6, 5.0], times=3)
    assert b.arm_cap(32) == 3  # 3 rewards of gamma 3 at batch 4 cover 12 request-steps: not yet 16
    _feed(b, 4, [10.0, 11.0, 10.6, 5.0], times=1)
    assert b.arm_cap(32) == 2  # 10.6 is within 5% of 11: gamma 2 may still win above


def test_a_unimodal_bucket_shares_its_cap_without_playing_the_lengths_it_ruled_out():
    # Batch 1 plays only up to one above its leader (unimodal), so gamma 2..5 stay untried there. That must
    # not count as "not learned": larger batches would then play every length again (vLLM, SpecBench
    # summarization on the CPU: Nightjar 0.97x no speculation at batch 16 and 32).
    b = GammaBandit(NightjarConfig(max_gamma=5))
    _feed(b, 1, [20.0, 16.0], times=16)  # gamma 0 wins clearly over 16 steps each; 2..5 never played
    assert b.arm_cap(16) == 0 and b.arm_cap(32) == 0
    assert {b.choose(32) for _ in range(50) if not b.update(32, 0, 640.0)} == {0}
    with_ties = GammaBandit(NightjarConfig(max_gamma=5, share_tolerance=0.05))
    _feed(with_ties, 1, [20.0, 19.5, 15.0], times=16)  # gamma 1 within 5% of the leader: may still win above
    assert with_ties.arm_cap(16) == 1


def test_a_smaller_buckets_arm_caps_larger_ones_only_once_its_rewards_cover_enough_request_steps():
    # A worker's first steps run at batch 1, where one reward is one hit or miss of the drafter: one miss of
    # gamma 1 there capped every larger bucket at gamma 0 for the rest of the run (vLLM, suffix drafts).
    b = GammaBandit(NightjarConfig(max_gamma=5, share_min_request_steps=16))
    _feed(b, 1, [20.0], times=16)
    for _ in range(4):
        b.update(1, 1, 12.0)  # gamma 1 missed four times (the samples rule's count at batch 1): a few tokens' luck
    assert b.arm_cap(16) == 5
    assert b.choose(16) == 0 and not b.update(16, 0, 320.0)
    assert b.choose(16) == 1  # the larger bucket climbs on its own evidence
    for _ in range(12):
        b.update(1, 1, 12.0)  # 16 request-steps of misses: now batch 1's evidence is shared
    assert b.arm_cap(16) == 0


def test_exploration_skips_arms_whose_confidence_interval_cannot_reach_the_best():
    b = GammaBandit(NightjarConfig(max_gamma=2, share_across_batches=False))
    for r in (100.0, 101.0, 99.0, 100.0, 100.5, 99.5, 100.2, 99.8):
        b.update(1, 0, r)
        b.update(1, 1, r - 50.0)  # clearly worse, tight spread
        b.update(1, 2, r * (1.0 if r > 99.9 else 0.2))  # bimodal: interval too wide to rule out
    st = b.state_for(1)
    assert b.explorable(st, 2) == [0, 2]
    assert GammaBandit(NightjarConfig(max_gamma=2, explore_delta=None)).explorable(st, 2) == [0, 1, 2]


def test_a_few_identical_misses_do_not_rule_an_arm_out_at_batch_one():
    # Prompt lookup at batch 1: two steps of gamma 1 that both proposed nothing earn what gamma 0 earns,
    # with no spread; a zero-width interval would exclude gamma 1 for good (it had stuck Nightjar at
    # gamma 0 for a whole low-load phase where every fixed length gained 1.2-1.5x).
    b = GammaBandit(NightjarConfig(max_gamma=1, share_across_batches=False))
    for _ in range(8):
        b.update(1, 0, 71.4)
    b.update(1, 1, 71.3)
    b.update(1, 1, 71.3)
    assert b.explorable(b.state_for(1), 1, batch_size=1) == [0, 1]
    # at batch 64 the same two rewards each average 64 requests: the tight interval is evidence
    for _ in range(8):
        b.update(64, 0, 64 * 71.4)
    b.update(64, 1, 64 * 50.0)
    b.update(64, 1, 64 * 50.1)
    assert b.explorable(b.state_for(64), 1, batch_size=64) == [0]


def test_rewards_are_per_request_means_not_medians():
    b = GammaBandit(NightjarConfig(max_gamma=1))
    for r in (100.0, 100.0, 100.0, 300.0, 300.0):  # prompt lookup: misses and hits
        b.update(10, 1, r)
    assert b.state_for(10).mean(1) == pytest.approx(18.0)  # (3*100 + 2*300) / 5 / batch 10


class _CurveCost:
    """A cost model that prices a pass by its token count alone."""

    def __init__(self, curve) -> None:
        self.curve = curve

    def predict(self, f) -> float:
        return self.curve(f.num_prefill_tokens + f.num_decode_tokens + f.tree_tokens)


class _CurveExecutor:
    draft_on_device = True
    has_draft = True
    draft_offloadable = False

    @staticmethod
    def latency_curve(n: int) -> float:
        return 0.010 + 0.001 * n

    cost_model = _CurveCost(latency_curve)


def test_nightjar_rewards_the_whole_token_rate_of_a_mixed_pass():
    pol = Nightjar(NightjarConfig(max_gamma=1))
    pol.bind(_CurveExecutor())
    reqs = [make_request("a"), make_request("b")]
    pol.prefill_tokens_in_pass = 90
    pol.draft_plan(reqs, 0.0)
    assert pol.gamma == 0  # untried arm 0 first
    pol.observe(reqs, {}, StepResult(latency_s=0.2), 0.0, 0.0)  # 2 decodes + 90 prefill tokens
    curve = _CurveExecutor.latency_curve
    # the pass's token rate against the same pass's predicted one, at the decodes' predicted rate; per request
    st = pol.bandit.state_for(2, mixed=True)  # a pass with a prompt chunk: learned apart from plain passes
    assert st.mean(0) == pytest.approx(92 / 0.2 * curve(92) / 92 * 2 / curve(2) / 2)
    assert pol.bandit.state_for(2).mean(0) is None


def test_nightjar_reward_of_a_pass_with_a_chunk_compares_with_a_plain_pass():
    """A pass that also carries a prompt chunk is not a better arm: where the profile prices passes right, a
    plain decode step and one with a 2048-token chunk give gamma 0 the same reward (before, the chunk's
    tokens counted: 1.3x here, ~13x on vLLM at batch 32, and that arm led for its whole window)."""
    curve = _CurveExecutor.latency_curve
    reqs = [make_request(f"r{i}") for i in range(32)]
    rewards = []
    for chunk in (0, 2048):
        pol = Nightjar(NightjarConfig(max_gamma=1))
        pol.bind(_CurveExecutor())
        pol.prefill_tokens_in_pass = chunk
        pol.draft_plan(reqs, 0.0)
        pol.observe(reqs, {}, StepResult(latency_s=curve(chunk + 32)), 0.0, 0.0)
        rewards.append(pol.bandit.state_for(32, mixed=chunk > 0).mean(0))
    assert rewards[1] == pytest.approx(rewards[0]) == pytest.approx(32 / curve(32) / 32)


def _mixed_pass_rewards(prefill: int, curve) -> tuple[float, float]:
    """Nightjar's mean rewards for gamma 0 and 1 on one pass each: 10 decodes beside ``prefill``
    prompt tokens, gamma 1 adding one tree token per decode of which 5 are accepted."""
    from gpu_runtime.speculation.token_tree import TokenTree

    pol = Nightjar(NightjarConfig(max_gamma=1, share_across_batches=False, unimodal=False))
    pol.bind(type("Profiled", (_CurveExecutor,),
                  {"latency_curve": staticmethod(curve), "cost_model": _CurveCost(curve)})())
    reqs = [make_request(f"r{i}") for i in range(10)]
    for gamma in (0, 1):
        pol.prefill_tokens_in_pass = prefill
        pol.draft_plan(reqs, 0.0)
        assert pol.gamma == gamma  # untried arms in order
        trees = {r.request_id: TokenTree([7], [-1], [0.5]) for r in reqs} if gamma else {}
        accepted = {r.request_id: [0] for r in reqs[:5]} if gamma else {}
        verified = prefill + 10 + sum(len(t) for t in trees.values())
        pol.observe(reqs, trees, StepResult(accepted_nodes=accepted, latency_s=curve(verified)), 0.0, 0.0)
    st = pol.bandit.state_for(10, mixed=prefill > 0)
    return st.mean(0), st.mean(1)


def test_nightjar_reward_charges_trees_what_they_cost_in_the_pass():
    # 1 ms per token above a 50-ms memory-bound floor
    def curve(n):
        return max(0.050, 0.001 * n)

    # beside 200 prompt tokens the pass is compute-bound: 10 tree tokens cost 10 ms and return 5 tokens,
    # so gamma 1 lowers the pass's token rate (as if the decodes ran alone, both passes would cost 50 ms
    # and gamma 1 would look 1.5x better)
    plain, spec = _mixed_pass_rewards(200, curve)
    assert spec < plain
    # each as the pass's rate against the plain pass's predicted one, at the decodes' predicted rate alone
    to_decodes = curve(210) / 210 * 10 / curve(10)
    assert plain == pytest.approx(210 / 0.210 * to_decodes / 10)
    assert spec == pytest.approx(215 / 0.220 * to_decodes / 10)
    # beside 5 prompt tokens the pass stays under the floor: the trees ride free and gamma 1 wins
    plain, spec = _mixed_pass_rewards(5, curve)
    assert spec == pytest.approx(1.333 * plain, rel=1e-3)


# ---- AdaServe ----
def test_adaserve_requirement_after_drafting_counts_the_draft_once():
    pol = AdaServe(budget=64)
    req = make_request("a", tbt=0.05, outputs=5, gap=0.05)  # on target: 4 decoded in 0.2 s
    pol.observe([req], {}, StepResult(latency_s=0.04), 0.01, 0.2)
    # select() runs at the clock after drafting (0.21): l = 0.21, plus the 0.04 s pass still
    # to come -> A = 0.25 / 0.05 - 4 = 1.0 (not 1.2, which would count the draft twice)
    pol._depth = 4
    tree = TokenTree.chain([1, 2, 3, 4], [0.9] * 4)
    pol.select([req], {"a": tree}, 0.21)
    assert pol.last is not None and pol.last.expected["a"] >= 1.0
    from gpu_runtime.speculation.requirement import slo_requirement
    assert slo_requirement(req, 0.21, pol.t_verify.value) == pytest.approx(1.0)
