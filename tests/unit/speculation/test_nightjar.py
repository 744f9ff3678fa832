"""Nightjar: bandit convergence and tracking, eq. 3 switch cost, elastic draft memory logic."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gpu_runtime.executor.base import KVCapacity, StepResult
from gpu_runtime.speculation.nightjar import GammaBandit, Nightjar, NightjarConfig

from .conftest import make_request


def play(bandit: GammaBandit, means: list[float], steps: int, rng: random.Random, batch: int = 4) -> Counter:
    counts: Counter = Counter()
    for _ in range(steps):
        g = bandit.choose(batch)
        bandit.update(batch, g, means[g] + rng.gauss(0, 1.0))
        counts[g] += 1
    return counts


def test_untried_arms_first():
    b = GammaBandit(NightjarConfig(max_gamma=3))
    seen = []
    for _ in range(4):
        g = b.choose(8)
        seen.append(g)
        b.update(8, g, 1.0)
    assert seen == [0, 1, 2, 3]


def test_at_batch_size_one_an_arm_is_sampled_before_its_mean_counts():
    """One step's reward at batch 1 is a single hit or miss: each arm is played 4 times before exploitation
    (twice at batch 2, once from batch 4 on)."""
    b = GammaBandit(NightjarConfig(max_gamma=2))
    seen = []
    for _ in range(12):
        g = b.choose(1)
        seen.append(g)
        b.update(1, g, 10.0 + g)
    assert seen == [0] * 4 + [1] * 4 + [2] * 4
    assert [b.samples_needed(n) for n in (1, 2, 3, 4, 64)] == [4, 2, 2, 1, 1]


def test_noisy_rewards_at_batch_one_do_not_stop_the_climb_at_an_unlucky_arm():
    """Batch 1, n-gram drafts: a step either hits (the longer the draft, the more tokens) or misses. The
    goodput grows with gamma, so the bandit ends on the longest lengths, though some arms' first rewards
    are all misses."""
    rng = random.Random(11)
    bandit = GammaBandit(NightjarConfig(max_gamma=8, seed=2))

    def reward(g: int) -> float:
        return 38.0 + (25.0 * g if rng.random() < 0.45 else -4.0 * (g > 0))

    for _ in range(400):
        g = bandit.choose(1)
        bandit.update(1, g, reward(g))
    late = Counter()
    for _ in range(300):
        g = bandit.choose(1)
        bandit.update(1, g, reward(g))
        late[g] += 1
    assert late.most_common(1)[0][0] >= 6


def test_converges_to_best_arm_and_switches_after_change():
    rng = random.Random(7)
    bandit = GammaBandit(NightjarConfig(max_gamma=5, seed=3))
    means = [10.0, 14.0, 18.0, 15.0, 12.0, 8.0]
    play(bandit, means, 1500, rng)
    late = play(bandit, means, 500, rng)
    assert late.most_common(1)[0][0] == 2
    assert late[2] > 0.7 * 500
    shifted = [10.0, 14.0, 6.0, 15.0, 21.0, 8.0]  # load changed: gamma=4 is now best
    play(bandit, shifted, 2500, rng)
    late = play(bandit, shifted, 500, rng)
    assert late.most_common(1)[0][0] == 4
    assert late[4] > 0.6 * 500


def test_unimodal_search_never_plays_lengths_above_one_that_loses():
    rng = random.Random(5)
    means = [20.0, 12.0, 30.0, 30.0, 30.0, 30.0]  # gamma 1 loses to 0: the climb stops there
    counts = play(GammaBandit(NightjarConfig(max_gamma=5, seed=1)), means, 600, rng, batch=64)
    assert set(counts) == {0, 1} and counts[0] > 0.8 * 600
    # without the unimodal prior every length is tried (and explored) at least once
    counts = play(GammaBandit(NightjarConfig(max_gamma=5, seed=1, unimodal=False)), means, 600, rng, batch=64)
    assert set(counts) == {0, 1, 2, 3, 4, 5}


def test_switch_cost_keeps_speculation_off_when_gain_is_small():
    b = GammaBandit(NightjarConfig(max_gamma=2))
    for g, r in [(0, 100.0), (1, 104.0), (2, 101.0)]:
        b.update(1, g, r)
    b.update(1, 0, 100.0)  # last played arm: 0 (speculation off)
    st = b.state_for(1)
    assert b.exploit(st, switch_cost_s=0.0) == 1
    # 1/100 vs 1/104 + 0.005/1: the catch-up cost outweighs the gain
    assert b.exploit(st, switch_cost_s=0.005) == 0
    b.prev_gamma = 1  # already speculating: no switch cost applies
    assert b.exploit(st, switch_cost_s=0.005) == 1


def _share_of_no_speculation(config: NightjarConfig, means: list[float], seed: int, steps: int = 90,
                              batch: int = 32, noise: float = 0.08) -> float:
    """A short run at one batch size (a step's reward: the arm's mean times 1 +- ``noise``): the goodput the
    played arms' means give, as a share of playing gamma 0 throughout."""
    rng = random.Random(seed)
    bandit = GammaBandit(config)
    total = 0.0
    for _ in range(steps):
        g = bandit.choose(batch)
        total += means[g]
        bandit.update(batch, g, means[g] * (1.0 + rng.gauss(0.0, noise)) * batch)
    return total / (steps * means[0])


def test_where_every_length_loses_a_short_run_stays_near_no_speculation():
    """vLLM at batch 32 on a CPU: gamma 1 a few per cent below gamma 0 a step, 8% step noise, ~90 steps. Without
    the exploration budget and the doubt in exploitation the bandit played lengths that lose in a large share
    of the steps (one run in 20 at 0.96x or below); with them every run stays within 2.5% of no speculation."""
    means = [1.0, 0.96, 0.92, 0.88, 0.84, 0.80]
    shipped = [_share_of_no_speculation(NightjarConfig(seed=s), means, s) for s in range(20)]
    before = [_share_of_no_speculation(NightjarConfig(seed=s, regret_budget=None, exploit_doubt_se=0.0), means, s)
              for s in range(20)]
    assert min(shipped) >= 0.975 and sum(shipped) / 20 >= 0.99
    assert min(before) < 0.965 and sum(before) < sum(shipped)
    # where speculation wins, neither rule holds it back
    wins = [1.0, 1.5, 1.9, 2.1, 2.0, 1.8]
    assert min(_share_of_no_speculation(NightjarConfig(seed=s), wins, s) for s in range(10)) >= 1.9


def test_a_length_must_beat_no_speculation_by_more_than_its_noise():
    b = GammaBandit(NightjarConfig(max_gamma=1))
    for r in (100.0, 101.0, 99.0, 100.0):
        b.update(8, 0, r * 8)
    for r in (90.0, 115.0, 96.0, 111.0):  # mean 103, standard error ~5.8: not clearly better
        b.update(8, 1, r * 8)
    st = b.state_for(8)
    assert b.exploit(st, 0.0, batch_size=8) == 0
    b.config.exploit_doubt_se = 0.0  # by means alone (Algorithm 1) gamma 1 would be played
    assert b.exploit(st, 0.0, batch_size=8) == 1
    b.config.exploit_doubt_se = 1.0
    for r in (104.0, 103.0, 104.0, 103.0) * 4:  # now clearly better
        b.update(8, 1, r * 8)
    assert b.exploit(st, 0.0, batch_size=8) == 1


def test_exploration_stops_while_its_budget_is_spent():
    b = GammaBandit(NightjarConfig(max_gamma=2, regret_budget=0.01))
    for _ in range(10):
        b.update(32, 0, 100.0 * 32)
    st = b.state_for(32)
    assert st.may_explore(0.01)
    for _ in range(3):  # 3 plays 10% below gamma 0: 30 lost against a budget of 1% of 13 steps x 100
        b.update(32, 1, 90.0 * 32)
    assert not st.may_explore(0.01) and st.may_explore(None)
    st.exploring, st.round = True, 2  # inside an exploration bin: gamma 0 is played all the same
    assert b.choose(32) == 0
    for _ in range(300):  # the budget grows with the steps played
        b.update(32, 0, 100.0 * 32)
    assert st.may_explore(0.01)


def test_bins_and_blocks_double():
    st = GammaBandit().state_for(1)
    lengths = []
    block, n = st.block, 0
    for _ in range(200):
        st.advance()
        n += 1
        if st.block != block:
            lengths.append(n)
            block, n = st.block, 0
    # a block of horizon H lasts ceil(sqrt H)^2-ish rounds and H doubles per block
    assert lengths[:4] == [1, 1, 4, 4]
    assert lengths[-1] >= lengths[2]


class FakeExecutor:
    """Memory bookkeeping only: what Nightjar reads and calls (pure-logic unit test)."""

    def __init__(self, total: int, free: int, draft_blocks: int) -> None:
        self.total, self.free_blocks, self.draft_blocks = total, free, draft_blocks
        self.draft_on_device = True
        self.has_draft = True
        self.draft_offloadable = True

    def capacity(self) -> KVCapacity:
        return KVCapacity(self.total, self.free_blocks, 16)

    def offload_draft(self) -> int:
        self.draft_on_device = False
        self.total += self.draft_blocks
        self.free_blocks += self.draft_blocks
        return self.draft_blocks

    def load_draft(self) -> bool:
        self.draft_on_device = True
        self.total -= self.draft_blocks
        self.free_blocks -= self.draft_blocks
        return True


def test_offload_after_persistent_low_memory_then_reload():
    ex = FakeExecutor(total=100, free=5, draft_blocks=30)
    pol = Nightjar(NightjarConfig(persist_steps=3))
    pol.bind(ex)
    pol.gamma = 0
    for _ in range(2):
        pol.maintain(ex, num_waiting=4)
    assert ex.draft_on_device  # not yet T steps
    pol.maintain(ex, num_waiting=4)
    assert not ex.draft_on_device and ex.total == 130 and pol.offloads == 1
    # while offloaded the policy cannot speculate
    reqs = [make_request("a"), make_request("b")]
    for _ in range(10):
        assert pol.draft_plan(reqs, 0.0) == []
        pol.observe(reqs, {}, StepResult(latency_s=0.01), 0.0, 0.0)
    pol.maintain(ex, num_waiting=3)  # queue not empty: stays off
    assert not ex.draft_on_device
    ex.free_blocks = 80
    pol.maintain(ex, num_waiting=0)
    assert ex.draft_on_device and pol.reloads == 1 and ex.total == 100


def test_no_offload_while_speculating():
    ex = FakeExecutor(total=100, free=5, draft_blocks=30)
    pol = Nightjar(NightjarConfig(persist_steps=2))
    pol.bind(ex)
    pol.gamma = 3
    for _ in range(5):
        pol.maintain(ex, num_waiting=1)
    assert ex.draft_on_device


def test_in_a_co_serving_pass_only_likely_tokens_go_beyond_the_spare_time():
    """QoServe's spare time fits 2 tree tokens (1 ms each on this curve); beyond them a token needs
    path probability >= 0.2 (hand-checked: a keeps 0.9, 0.5 as the cheap ones; b keeps 0.3, 0.25)."""
    from gpu_runtime.speculation.token_tree import TokenTree

    def chains():
        return {"a": TokenTree([1, 2, 3], [-1, 0, 1], [0.9, 0.5, 0.1]),
                "b": TokenTree([4, 5, 6], [-1, 0, 1], [0.3, 0.25, 0.05])}

    reqs = [make_request("a"), make_request("b")]
    pol = Nightjar()
    pol._curve = lambda n: 0.010 + 0.001 * n
    pol.gamma, pol._prefill_tokens = 3, 0
    pol.pass_spare_s = 0.0025
    assert {rid: len(t) for rid, t in pol.select(reqs, chains(), 0.0).items()} == {"a": 2, "b": 2}
    pol.pass_spare_s = 0.0065  # all six fit: nothing is cut
    assert {rid: len(t) for rid, t in pol.select(reqs, chains(), 0.0).items()} == {"a": 3, "b": 3}
    pol.pass_spare_s = None  # no scheduler time budget (not QoServe)
    assert {rid: len(t) for rid, t in pol.select(reqs, chains(), 0.0).items()} == {"a": 3, "b": 3}
    pol.pass_spare_s, pol.config.min_prob_beyond_slack = 0.0, 0.3  # nothing cheap: only >= 0.3
    assert {rid: len(t) for rid, t in pol.select(reqs, chains(), 0.0).items()} == {"a": 2, "b": 1}
    # a pass that carries a prefill chunk: its spare time is free (Nightjar's default), all six fit as before;
    # with AdaServe's rule it is not (the queued prompts wait for the pass too): every token takes the likelihood rule
    pol.pass_spare_s, pol.config.min_prob_beyond_slack, pol._prefill_tokens = 0.0065, 0.2, 64
    assert {rid: len(t) for rid, t in pol.select(reqs, chains(), 0.0).items()} == {"a": 3, "b": 3}
    pol.config.spare_free_beside_prefill = False
    assert {rid: len(t) for rid, t in pol.select(reqs, chains(), 0.0).items()} == {"a": 2, "b": 2}


def test_passes_with_prompt_chunks_learn_apart_from_plain_decode_passes():
    """A pass that also prefills has a rate several times a plain pass's: kept in its own statistics, the arm
    that drew such passes does not lead among plain passes (vLLM, batch 32: gamma 1 had drawn the passes of the
    batch's last prompt chunks and was played 34 of 84 steps, 0.94x no speculation)."""
    b = GammaBandit(NightjarConfig(max_gamma=1, share_across_batches=False))
    for _ in range(3):
        b.update(32, 1, 32 * 40.0, mixed=True)
    for gamma, per_request in ((0, 14.5), (1, 13.9)):  # plain passes: gamma 1 costs more than it returns
        for _ in range(3):
            b.update(32, gamma, 32 * per_request)
    assert b.state_for(32).mean(1) == pytest.approx(13.9) and b.state_for(32, mixed=True).mean(1) == 40.0
    assert b.exploit(b.state_for(32), 0.0, 1, 32) == 0
    assert b.exploit(b.state_for(32, mixed=True), 0.0, 1, 32) == 1


def test_a_pass_without_drafts_that_carries_prompt_chunks_is_a_mixed_pass():
    """vLLM's drafter may propose nothing for a pass (prompts just started); Nightjar then hears of the pass
    without having planned it. A pass that prefilled is slow for its decodes: counted as a plain gamma-0 pass
    (as before) one such reward, 1.4 tokens/s a request against ~15, made no speculation look worst at batch 16."""
    pol = Nightjar(NightjarConfig(max_gamma=1))
    reqs = [make_request(f"r{i}") for i in range(4)]
    pol.prefill_tokens_in_pass = 512  # the engine says what the pass carries, drafts or not
    pol.observe(reqs, {}, StepResult(accepted_nodes={}, latency_s=0.5), 0.0, 0.0)
    assert pol.bandit.state_for(4, mixed=True).plays == [1, 0]
    assert pol.bandit.state_for(4).plays == [0, 0]
    pol.prefill_tokens_in_pass = 0
    pol.observe(reqs, {}, StepResult(accepted_nodes={}, latency_s=0.05), 0.0, 0.0)
    assert pol.bandit.state_for(4).plays == [1, 0]


def test_the_longest_arm_told_before_a_pass_bounds_every_arm_played_and_changes_no_choice():
    """The vLLM adapter sizes a step with ``most_played`` before the bandit chooses (for a pass of any batch size up
    to the running decodes, with prompt chunks or not): never below the arm then played, and asking draws nothing, so
    the choices are those of a bandit never asked."""
    asked, alone, rng = GammaBandit(NightjarConfig(max_gamma=5)), GammaBandit(NightjarConfig(max_gamma=5)), \
        random.Random(3)
    means = [10.0, 13.0, 14.0, 12.0, 9.0, 8.0]
    bounds = []
    for _ in range(400):
        batch, mixed = rng.choice([1, 2, 3, 6, 12]), rng.random() < 0.3
        most = asked.most_played(12)
        g = asked.choose(batch, mixed=mixed)
        assert g <= most, (g, most, batch, mixed)
        assert g == alone.choose(batch, mixed=mixed)
        bounds.append(most)
        reward = means[g] + rng.gauss(0, 1.0)
        asked.update(batch, g, reward, mixed=mixed)
        alone.update(batch, g, reward, mixed=mixed)
    assert bounds[0] == 0 and min(bounds[100:]) < 5  # a fresh bandit plays gamma 0 first; the climb stops short
