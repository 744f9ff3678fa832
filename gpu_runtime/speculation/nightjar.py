"""Nightjar: when (and how much) to speculate, plus elastic draft memory.

* A bandit per batch-size bucket over gamma in {0..G_max} (0 = no speculation), with
  ADA-BINGREEDY time structure (Algorithm 1): bins of sqrt(H) rounds, sqrt(H) bins per
  block, H doubling per block; a bin explores with probability 1/sqrt(b). Untried arms
  are played first (DESIGN.md decision).
* Exploitation (eq. 3, unit-consistent): argmin_gamma 1/g(B, gamma) +
  [prev gamma = 0 and gamma > 0] * c_prefill(L_max, B) / gamma, in seconds per token.
* Batch sizes share what they learned through the roofline argument of the paper's
  section 2.1 / Fig. 1: verification of gamma extra tokens per request only gets more
  expensive as the batch grows (memory-bound -> compute-bound) while the acceptance does
  not depend on the batch, so the best gamma does not grow with B. Once a smaller batch
  bucket has estimates for its arms, a larger bucket's search space (untried arms,
  exploration, exploitation) is capped at the largest gamma that was (near) best there:
  the exploration of Algorithm 1 stays uniform, but over arms that can still win, so
  exploring at large batch sizes no longer plays lengths already known to lose. Within a
  bucket, an exploration bin also skips arms that Lemma 1's confidence bound already
  shows to be worse than the best one (``NightjarConfig.explore_delta``), and no arm more
  than one above the best measured one (goodput is unimodal in gamma: ``unimodal``).
* Conservative where Nightjar's point is never to be slower than not speculating: exploitation
  values a speculating arm at its mean less one standard error and gamma 0 at its mean plus one
  (``exploit_doubt_se``, from batch size 4 on), so a length is played only when it beats no
  speculation by more than the rewards' noise; and arms other than the exploitation choice are
  played only while the bucket's estimated loss against gamma 0 stays within 1% of its reward
  (``regret_budget``, after the conservative bandits of Wu et al., 2016). Where speculation
  wins, both are idle.
* In a co-serving pass (QoServe sets the spare time its slack leaves), the chain tokens that fit
  that time are verified as drafted, beyond them only those with path probability >= 0.2
  (AdaServe's rule; ``min_prob_beyond_slack``): the pass QoServe sized for its deadlines does
  not grow by tokens unlikely to be accepted.
* Elastic memory (section 5): with speculation off and free KV below tau_low for
  ``persist_steps`` iterations, offload the draft (the KV pool grows); reload it when
  the waiting queue is empty and free blocks exceed the draft's size + tau_low.

Reward = realized goodput of the step: (accepted + bonus) tokens / (draft + verify) s,
and g(B, gamma) is the mean of an arm's recent rewards (the paper's empirical mean, over a
window because the load drifts), kept per request so that the batch sizes sharing a
bucket stay comparable (``GammaBandit.update``). The paper's steps are pure speculative decode steps
(vLLM 0.8 runs prefills in separate steps); here a pass may also carry prefill chunks, and
its reward counts them with the decode tokens: the pass's whole token rate, which is what a
length choice trades (``Nightjar._reward``). Such mixed passes learn apart from plain decode
passes (the bandit's context is the batch-size bucket and whether the pass carries a chunk):
in one window a chunk pass's rate, several times a plain pass's, made the arm that drew it
lead until the window forgot it (vLLM, batch 32, the batch's prompts still prefilling at
batch 19-31: gamma 1 played 34 of 84 steps, 0.94x no speculation).
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_runtime.costmodel.base import CostModel
from gpu_runtime.costmodel.features import BatchFeatures
from gpu_runtime.executor.base import DraftEntry
from gpu_runtime.speculation.base import SpeculationPolicy
from gpu_runtime.speculation.cost import Ema
from gpu_runtime.speculation.selection import likely_beyond_slack

log = logging.getLogger(__name__)


@dataclass
class NightjarConfig:
    max_gamma: int = 5  # Gamma_max: arms 0..max_gamma
    window: int = 32  # rewards kept per arm (recent ones: the environment drifts)
    bucket_batch_sizes: bool = True  # share statistics across batch sizes of one power of two
    tau_low: float = 0.10  # free-KV threshold (share of blocks) for offloading the draft
    persist_steps: int = 20  # T: iterations the condition must hold before offloading
    seed: int = 0
    # Algorithm 1 line 22 resets b each block, so every block re-explores from 1/sqrt(1);
    # False keeps counting bins, so exploration keeps decaying (less regret on short runs).
    explore_reset_per_block: bool = False
    # Cap a bucket's arms by what smaller buckets learned (monotone best gamma in B, see the
    # module doc); a smaller bucket counts once each of its arms has rewards covering
    # ``share_min_request_steps`` request-steps (rewards x the bucket's batch size), and an arm
    # within ``share_tolerance`` of its best reward still counts as best there. Before the
    # unimodal climb (``unimodal``), no cap made a new large bucket play every length once more
    # (untried arms first) plus exploration bins, each long step at gamma 5 and batch ~100
    # costing several plain steps; a cap set too low by a noisy small bucket, though, holds a
    # larger one below lengths that win there for good, so the evidence must be substantial. A
    # worker's first steps run at batch 1, where a reward is one hit or miss of the drafter: with
    # one reward (then four) enough, gamma 1's misses in the first 16 tokens of one prompt capped
    # every larger bucket at gamma 0 for the rest of the run (vLLM, suffix drafts, raw text: 1.00x
    # at batch 16 in one round, 1.56x in the next).
    share_across_batches: bool = True
    share_min_request_steps: int = 16
    share_tolerance: float = 0.03
    # Lemma 1's confidence radius bounds each arm's estimate with probability 1 - delta; an
    # exploration bin draws uniformly over the arms whose upper bound still reaches the best
    # arm's lower bound (an arm provably worse adds only regret, term (a) of Theorem 1). The
    # radius uses the arm's sample spread, not the worst-case range g_max (which never
    # separates arms on a window of 32 rewards). None: explore over every arm (Algorithm 1).
    explore_delta: float | None = 0.05
    # An arm whose rewards cover fewer request-steps than this (rewards x batch size: a step's reward
    # averages its batch) is never ruled out by that bound: a drafter that proposes nothing on some steps
    # (prompt lookup: 20-55% of them) can give an arm at batch size 1 a few rewards that are all misses,
    # with no spread, and a radius of zero would then exclude the arm for good on its first unlucky draws.
    explore_min_request_steps: int = 8
    # Goodput is unimodal in gamma (accepted tokens grow ever slower with the length while draft and
    # verification time grow about linearly), so a bucket tries and explores lengths only up to one above
    # its best measured arm, as unimodal bandits explore the leader's neighbours: at a batch size where
    # gamma 1 already loses to 0, gamma 2..5 are not each played once more.
    unimodal: bool = True
    # An arm is played until its rewards cover this many request-steps before its mean counts (untried arms
    # first, generalized). At batch size 1 a single step's reward is one hit or miss of the drafter, and one
    # unlucky first reward of gamma 2 stopped the unimodal climb there for a whole run: vLLM, n-gram drafts,
    # batch 1, gamma 1 played 300 times, gamma 2 28 and gamma 3 3, though gamma 2's mean was 85 tok/s
    # against gamma 1's 67. From batch size 4 on one reward is enough, as before. 4 against 8 (docs/BENCHMARKS.md,
    # stop 24): vLLM batch 1 raw text 2.35x against 2.21-2.33x, chat 1.26x against 1.22x; the simulator's
    # batch-1 phase (ops/bench_spec_dynamic.py) 1.37x against 1.17x (1.27x before either rule).
    sample_min_request_steps: int = 4
    # Co-serving (as AdaServe's rule): the chain tokens whose extra pass time fits the scheduler's spare time
    # are verified as drafted; beyond them only tokens with path probability >= this. 0: no limit.
    min_prob_beyond_slack: float = 0.2
    # AdaServe's rule that the spare time of a pass with a prefill chunk is not free, measured here and not taken
    # (draft model, assumed acceptance, 3 seeds; attained at 14 / 18 RPS with the spare time free, then without):
    # 0.6x the SLOs 77.5 / 60.0% against 73.7 / 58.4%, 1.0x 91.6 / 81.8% against 93.1 / 79.6%, 1.6x 100 / 91.0%
    # against 100 / 93.5%; prompt lookup within 0.1 point (docs/BENCHMARKS.md, stop 41)
    spare_free_beside_prefill: bool = True
    # Conservative exploration (Nightjar's promise: never slower than not speculating): a bucket plays an arm
    # other than its exploitation choice (untried arms, exploration bins) only while what its plays so far
    # are estimated to have lost against gamma 0 (plays x mean difference) stays within this share of gamma
    # 0's reward over all its steps. Where speculation wins the estimate is a gain and nothing is held back;
    # where every length loses, exploration is paid for by the budget and stops when it is spent (vLLM,
    # batch 32, chat prompts: gamma 1 3-5% below gamma 0 a step with 8% step noise, and explored in 29% of
    # the steps of a 0.96x run). None: explore as Algorithm 1 does.
    regret_budget: float | None = 0.01
    # Exploitation values a speculating arm at its mean less this many standard errors of it, gamma 0 at its mean
    # plus as many: a length must beat no speculation by more than its rewards' noise to be played. Only where a
    # step averages sample_min_request_steps requests or more (at batch 1 a reward is one hit or miss).
    exploit_doubt_se: float = 1.0


@dataclass
class _BinState:
    """Per batch-size hierarchy of Algorithm 1 (j_B, H_B, b_B, tau_B) and reward stats."""

    num_arms: int
    window: int
    block: int = 1  # j_B
    horizon: int = 1  # H_B
    bin: int = 1  # b_B
    round: int = 1  # tau_B
    exploring: bool = False
    bins_total: int = 1  # bins started so far (all blocks)
    reset_per_block: bool = True
    rewards: list[deque] = field(default_factory=list)
    plays: list[int] = field(default_factory=list)  # rewards per arm over the whole run (not windowed)

    def __post_init__(self) -> None:
        self.rewards = [deque(maxlen=self.window) for _ in range(self.num_arms)]
        self.plays = [0] * self.num_arms

    @property
    def updates(self) -> int:
        """Rewards observed in this bucket (T of Lemma 1)."""
        return sum(self.plays)

    @property
    def explore_index(self) -> int:
        """b in the 1/sqrt(b) exploration probability."""
        return self.bin if self.reset_per_block else self.bins_total

    def mean(self, arm: int) -> float | None:
        """Empirical mean goodput of the arm's recent rewards (eq. 3's g~(B, gamma)). Not a
        median: with a drafter that proposes nothing on some steps (prompt lookup misses
        ~20-55% of them), the reward is bimodal and a median hides the gain of the hits.
        A pass's prefill chunks count in its reward (``Nightjar._reward``)."""
        r = self.rewards[arm]
        return sum(r) / len(r) if r else None

    def spread(self, arm: int) -> float | None:
        """Sample standard deviation of the arm's recent rewards (None below two)."""
        r = self.rewards[arm]
        if len(r) < 2:
            return None
        m = sum(r) / len(r)
        return math.sqrt(sum((x - m) ** 2 for x in r) / (len(r) - 1))

    def standard_errors(self) -> list[float]:
        """Standard error of each arm's mean reward (0 without rewards). Below two rewards the spread is the
        bucket's, relative to the mean, pooled over the arms that have two (0 while none has)."""
        spreads = [self.spread(g) for g in range(self.num_arms)]
        rel = [sd / abs(m) for g, sd in enumerate(spreads) if sd is not None and (m := self.mean(g))]
        pooled = sum(rel) / len(rel) if rel else 0.0
        return [0.0 if not r else (sd if sd is not None else pooled * abs(self.mean(g))) / math.sqrt(len(r))
                for g, (r, sd) in enumerate(zip(self.rewards, spreads))]

    def radius(self, arm: int, delta: float, min_samples: int = 2) -> float:
        """Lemma 1: |g~ - mu| <= sqrt(2 log(2T/delta)) * sigma / sqrt(N), sigma the sample spread
        (unbounded below ``min_samples`` rewards)."""
        r = self.rewards[arm]
        if len(r) < max(2, min_samples):
            return math.inf
        sd = self.spread(arm)
        return math.sqrt(2.0 * math.log(2.0 * max(2, self.updates) / delta)) * sd / math.sqrt(len(r))

    def may_explore(self, budget: float | None) -> bool:
        """Whether this bucket can still afford an arm other than its exploitation choice: the estimated loss of
        its plays against gamma 0, sum over arms of plays x (mean(0) - mean(g)), is within ``budget`` times
        gamma 0's reward over all its steps (``NightjarConfig.regret_budget``). Always true before gamma 0
        has a reward (there is no baseline yet) and with no budget."""
        base = self.mean(0)
        if budget is None or base is None:
            return True
        lost = sum(n * (base - m) for g, n in enumerate(self.plays[1:], 1) if n and (m := self.mean(g)) is not None)
        return lost <= budget * self.updates * base

    def advance(self) -> None:
        """Algorithm 1 lines 16-22."""
        self.round += 1
        if self.round > math.sqrt(self.horizon):
            self.bin += 1
            self.bins_total += 1
            self.round = 1
            if self.bin > math.sqrt(self.horizon):
                self.block += 1
                self.horizon = 2 ** (self.block - 1)
                self.bin = 1


def rewards_covering(request_steps: int, batch_size: int) -> int:
    """Rewards of a bucket at ``batch_size`` that cover ``request_steps`` request-steps (a reward averages its
    batch), at least one."""
    return max(1, -(-request_steps // max(1, batch_size)))


def neighbour_of_leader(means: list[float | None]) -> int:
    """One above the arm (index) with the best mean among those tried (0 before any reward)."""
    tried = [(m, g) for g, m in enumerate(means) if m is not None]
    return max(tried)[1] + 1 if tried else 0


class GammaBandit:
    """The arm-selection part of Nightjar, usable without an engine (tests, simulation)."""

    def __init__(self, config: NightjarConfig | None = None) -> None:
        self.config = config or NightjarConfig()
        self.rng = random.Random(self.config.seed)
        self.states: dict[int, _BinState] = {}  # by batch-size bucket: plain decode passes
        self.mixed_states: dict[int, _BinState] = {}  # the same for passes that also carry prompt chunks
        self.prev_gamma = 0

    def bucket(self, batch_size: int) -> int:
        if not self.config.bucket_batch_sizes or batch_size <= 1:
            return max(1, batch_size)
        return 1 << (batch_size - 1).bit_length()

    def _states(self, mixed: bool) -> dict[int, _BinState]:
        return self.mixed_states if mixed else self.states

    def state_for(self, batch_size: int, mixed: bool = False) -> _BinState:
        """The statistics of ``batch_size``'s bucket, for passes with (``mixed``) or without prompt chunks."""
        key, states = self.bucket(batch_size), self._states(mixed)
        if key not in states:
            states[key] = _BinState(self.config.max_gamma + 1, self.config.window,
                                    reset_per_block=self.config.explore_reset_per_block)
        return states[key]

    def arm_cap(self, batch_size: int, mixed: bool = False) -> int:
        """Largest gamma bucket ``batch_size`` may play: the smallest over smaller buckets
        with enough data of the largest gamma (near) best there (Gamma_max if none). With
        ``unimodal``, a smaller bucket has enough data once the arms up to its leader's
        neighbour have it (it never plays the longer ones, which goodput's unimodality rules out)."""
        cap = self.config.max_gamma
        if not self.config.share_across_batches:
            return cap
        key, states = self.bucket(batch_size), self._states(mixed)
        for other in sorted(k for k in states if k < key):
            st = states[other]
            means = [st.mean(g) for g in range(min(cap, st.num_arms - 1) + 1)]
            if self.config.unimodal:  # lengths past the leader's neighbour are never played there: known to lose
                means = means[:neighbour_of_leader(means) + 1]
            arms = range(len(means))
            need = rewards_covering(self.config.share_min_request_steps, other)
            if any(m is None or len(st.rewards[g]) < need for g, m in zip(arms, means)):
                continue  # not learned yet: no evidence to share
            best = max(means)
            if best <= 0:
                continue
            near = [g for g, m in zip(arms, means) if m >= (1.0 - self.config.share_tolerance) * best]
            cap = min(cap, max(near))
        return cap

    def choose(self, batch_size: int, switch_cost_s: float = 0.0, mixed: bool = False) -> int:
        """Gamma for a pass of ``batch_size`` decodes; ``mixed``: the pass also carries prompt chunks."""
        st = self.state_for(batch_size, mixed)
        cap = self.longest_arm(batch_size, mixed)
        need = self.samples_needed(batch_size)
        untried = [g for g in range(cap + 1) if len(st.rewards[g]) < need]
        budget = self.config.regret_budget
        # untried (at small batch sizes, under-sampled) arms first, gamma 0 always, the others while affordable
        if untried and (untried[0] == 0 or st.may_explore(budget)):
            return untried[0]
        if st.round == 1:  # line 6-8: a new bin explores with probability 1/sqrt(b)
            st.exploring = self.rng.random() < 1.0 / math.sqrt(st.explore_index)
        if st.exploring and st.may_explore(budget):  # line 11: uniform over the arms that can still win
            arms = self.explorable(st, cap, batch_size)
            return arms[self.rng.randrange(len(arms))]
        return self.exploit(st, switch_cost_s, cap, batch_size)

    def longest_arm(self, batch_size: int, mixed: bool = False) -> int:
        """The largest gamma ``choose`` may play for such a pass (untried arms, exploration and exploitation all stay
        within it): the cap smaller buckets set and, with ``unimodal``, one above the highest arm that may lead. Reads
        the statistics only (no draw, no new bucket)."""
        cap = self.arm_cap(batch_size, mixed)
        if not self.config.unimodal:
            return cap
        st = self._states(mixed).get(self.bucket(batch_size))
        if st is None:
            return 0  # a bucket with no reward plays gamma 0 first
        return min(cap, self.leader_neighbour(st, cap, noisy=self.samples_needed(batch_size) > 1))

    def most_played(self, batch_sizes: int) -> int:
        """The largest gamma ``choose`` may play for a pass of at most ``batch_sizes`` decodes, with or without prompt
        chunks. Per bucket, its smallest batch size bounds the others (it needs the most rewards of an arm, so the
        climb's noise rule is widest there)."""
        most, size = 0, 1
        while size <= batch_sizes and most < self.config.max_gamma:
            most = max(most, self.longest_arm(size), self.longest_arm(size, mixed=True))
            size = self.bucket(size) + 1
        return most

    def samples_needed(self, batch_size: int) -> int:
        """Rewards an arm gets before exploitation and the unimodal climb weigh its mean: enough to cover
        ``sample_min_request_steps`` request-steps (1 at batch sizes from that on)."""
        return rewards_covering(self.config.sample_min_request_steps, batch_size)

    def leader_neighbour(self, st: _BinState, cap: int, noisy: bool = False) -> int:
        """One above the highest arm that may still be the best (0 before any reward): the leader by mean
        reward, or, where one step's reward is a few requests' hits and misses (``noisy``: an arm needs more
        than one reward, ``samples_needed``), an arm whose Lemma 1 upper bound reaches the leader's mean, so
        that one unlucky arm does not stop the climb. From there on a step averages enough requests, and the
        climb stays at one above the leader."""
        means = {g: m for g in range(cap + 1) if (m := st.mean(g)) is not None}
        if not means:
            return 0
        best, delta = max(means.values()), self.config.explore_delta
        noisy = noisy and delta is not None
        may_lead = [g for g, m in means.items()
                    if m >= best or (noisy and len(st.rewards[g]) >= 2 and m + st.radius(g, delta) >= best)]
        return max(may_lead) + 1

    def explorable(self, st: _BinState, cap: int, batch_size: int = 1) -> list[int]:
        """Arms 0..cap whose confidence interval reaches the best arm's lower bound."""
        arms = list(range(cap + 1))
        delta = self.config.explore_delta
        if delta is None:
            return arms
        min_samples = rewards_covering(self.config.explore_min_request_steps, batch_size)
        bounds = {g: (m, st.radius(g, delta, min_samples)) for g in arms if (m := st.mean(g)) is not None}
        if not bounds:
            return arms
        best_lower = max(m - r for m, r in bounds.values())
        return [g for g in arms if g not in bounds or bounds[g][0] + bounds[g][1] >= best_lower]

    def exploit(self, st: _BinState, switch_cost_s: float, cap: int | None = None, batch_size: int = 1) -> int:
        """Eq. 3: seconds per token, plus the draft catch-up cost spread over gamma tokens.
        Rewards are stored per request (see ``update``): g(B, gamma) = B * mean."""
        best, best_cost = 0, math.inf
        # where a step's reward is a few requests' hits and misses (batch sizes below sample_min_request_steps), its
        # spread says little of the arm's mean: there the means decide, as the samples rule already waited for them
        doubt = self.config.exploit_doubt_se if self.samples_needed(batch_size) == 1 else 0.0
        se = st.standard_errors() if doubt else None
        for g in range(st.num_arms if cap is None else cap + 1):
            m = st.mean(g)
            if m is not None and se is not None:  # speculating arms at their lower bound, gamma 0 at its upper one
                m += doubt * se[g] * (1 if g == 0 else -1)
            if m is None or m <= 0:
                continue
            cost = 1.0 / (m * max(1, batch_size))
            if self.prev_gamma == 0 and g > 0:
                cost += switch_cost_s / g
            if cost < best_cost:
                best, best_cost = g, cost
        return best

    def update(self, batch_size: int, gamma: int, reward: float, mixed: bool = False) -> None:
        """``reward``: the step's goodput g (tokens/s over the batch). It is kept per request
        (g / B): at one batch size that ranks arms exactly as g does (eq. 1), and within a
        bucket of batch sizes it removes the dominant confound, goodput growing with B, so
        arms played at different batch sizes of the bucket stay comparable. ``mixed``: the pass
        also carried prompt chunks (kept apart: ``Nightjar._reward``)."""
        st = self.state_for(batch_size, mixed)
        st.rewards[gamma].append(reward / max(1, batch_size))
        st.plays[gamma] += 1
        st.advance()
        self.prev_gamma = gamma


class Nightjar(SpeculationPolicy):
    name = "nightjar"

    @classmethod
    def drafting_up_to(cls, longest: int, chains_only: bool = False) -> dict[str, int]:
        return {"max_gamma": longest}  # arms 0..longest

    def __init__(self, config: NightjarConfig | None = None,
                 switch_cost: Callable[[int, int], float | None] | None = None, **overrides) -> None:
        self.config = config or NightjarConfig(**overrides)
        self.bandit = GammaBandit(self.config)
        self.switch_cost = switch_cost  # c_prefill(L_max, B) seconds, from the profile (None: unknown)
        self._lag_cost = Ema(0.0)  # online fallback: seconds per lagging token to catch up
        self._draft_step = Ema(0.0)  # draft seconds per step when in sync
        self.gamma = 0
        self._batch = 0
        self._last_drafted: dict[str, int] = {}  # request -> outputs when last drafted
        self._l_max = 0
        self._low_steps = 0
        self._offloaded_blocks = 0
        self.offloads = 0
        self.reloads = 0

    def bind(self, executor) -> None:
        super().bind(executor)
        if self.switch_cost is None:
            self.switch_cost = getattr(executor, "draft_switch_cost", None)
        self._curve = getattr(executor, "latency_curve", None)
        cost_model = self._cost_model = getattr(executor, "cost_model", None)
        if self._curve is None and cost_model is not None:
            from gpu_runtime.costmodel.base import batch_time

            self._curve = lambda n: batch_time(cost_model, n)

    _curve: Callable[[int], float] | None = None
    _cost_model: CostModel | None = None
    _prefill_tokens = 0
    _context = 0  # mean context of the pass's decodes

    def _reward(self, latency_s: float, draft_s: float, decodes: int, accepted: int) -> float | None:
        """The step's goodput, Nightjar's reward (tokens/s over the batch): every token the pass
        computed (its prefill chunks, one per decode, the accepted tree tokens) per second of
        drafting and pass. In a pass that prefill chunks already make compute-bound, tree tokens
        cost as much as prompt tokens and only what is accepted pays them back; in a memory-bound
        one they ride free. (Charging decodes a share of the pass's time instead, as if they ran
        alone, made trees look free in prefill-heavy passes: on the code trace Nightjar then
        speculated through phases where no speculation was best.)"""
        total_s = latency_s + draft_s
        if total_s <= 0:
            return None
        prefill = self._prefill_tokens
        rate = (prefill + decodes + accepted) / total_s
        if prefill and decodes and self._cost_model is not None:
            # Mixed passes keep their own statistics (``GammaBandit.mixed_states``), and among them the chunk
            # varies (QoServe sizes it each step): the pass's rate is taken relative to the same pass without
            # speculation, at the rate of its decodes alone (both priced by the profile), so a large chunk does
            # not make the arm that drew it lead. The arms still trade as the whole pass does.
            plain = self._cost_model.predict(BatchFeatures.of_shape(prefill, 0, decodes, self._context))
            alone = self._cost_model.predict(BatchFeatures.of_shape(0, 0, decodes, self._context))
            if plain > 0 and alone > 0:
                rate *= plain / (prefill + decodes) * decodes / alone
        return rate

    def _c_prefill(self, l_max: int, batch: int) -> float:
        """Eq. 3's c_prefill(L_max, B): the executor's profiled figure, else the online estimate."""
        if l_max <= 0:
            return 0.0
        if self.switch_cost is not None:
            cost = self.switch_cost(l_max, batch)
            if cost is not None:
                return cost
        return self._lag_cost.value * l_max

    def draft_plan(self, decodes, now):
        self._batch = len(decodes)
        self._prefill_tokens = self.prefill_tokens_in_pass
        if not decodes:
            return []
        self._context = _mean_context(decodes)
        self._l_max = max((r.num_output_tokens - self._last_drafted.get(r.request_id, 0) for r in decodes),
                          default=0)
        on_device = getattr(self, "executor", None) is None or self.executor.draft_on_device
        self.gamma = self.bandit.choose(len(decodes), self._c_prefill(self._l_max, len(decodes)),
                                        mixed=self._prefill_tokens > 0)
        if not on_device:
            self.gamma = 0  # the draft is offloaded: only plain decoding is possible
        if self.gamma == 0:
            return []
        for r in decodes:
            self._last_drafted[r.request_id] = r.num_output_tokens
        return [DraftEntry(r.request_id, self.gamma, 1) for r in decodes]

    def most_kept(self, decodes: int) -> int | None:
        """The longest arm the bandit may play at a batch size up to ``decodes`` (none with the draft offloaded)."""
        if getattr(self, "executor", None) is not None and not self.executor.draft_on_device:
            return 0
        return self.bandit.most_played(decodes)

    def select(self, decodes, candidates, now):
        chains = {rid: t.subtree(list(range(min(len(t), self.gamma)))) for rid, t in candidates.items()
                  if len(t) and all(p == i - 1 for i, p in enumerate(t.parents[:self.gamma]))}
        threshold = self.config.min_prob_beyond_slack
        spare = self.free_spare_s(self._prefill_tokens, self.config.spare_free_beside_prefill)
        if threshold <= 0 or spare is None or self._curve is None or not chains:
            return chains
        return likely_beyond_slack(chains, self._curve, len(decodes), self._prefill_tokens, spare, threshold)

    def observe(self, decodes, selected, result, draft_latency_s, now):
        if not decodes:
            return
        # Engine skips draft_plan when it has no drafter; count those steps as gamma = 0.
        gamma = self.gamma if self._batch == len(decodes) else 0
        accepted = sum(len(v) for v in result.accepted_nodes.values())
        if self._batch != len(decodes):  # draft_plan was skipped (no drafts this pass): the engine's own figures
            self._prefill_tokens = self.prefill_tokens_in_pass
            self._context = _mean_context(decodes)
        reward = self._reward(result.latency_s, draft_latency_s, len(decodes), accepted)
        prev = self.bandit.prev_gamma
        if reward is not None:
            self.bandit.update(len(decodes), gamma, reward, mixed=self._prefill_tokens > 0)
        else:
            self.bandit.prev_gamma = gamma
        if gamma > 0 and draft_latency_s > 0:
            per_step = draft_latency_s / gamma
            if prev == 0 and self._l_max > 1 and self._draft_step.count:
                extra = per_step - self._draft_step.value  # catch-up beyond a normal draft step
                self._lag_cost.update(max(0.0, extra * gamma) / self._l_max)
            else:
                self._draft_step.update(per_step)
        live = {r.request_id for r in decodes}
        self._last_drafted = {k: v for k, v in self._last_drafted.items() if k in live}
        self._batch = 0

    def maintain(self, executor, num_waiting):
        if not executor.draft_offloadable:  # a model-free draft stays on (section 5 moves weights)
            return
        cap = executor.capacity()
        if cap.total_blocks <= 0:
            return
        low = cap.free_blocks < self.config.tau_low * cap.total_blocks
        if executor.draft_on_device:
            self._low_steps = self._low_steps + 1 if (low and self.gamma == 0) else 0
            if self._low_steps >= self.config.persist_steps:
                gained = executor.offload_draft()
                self._low_steps = 0
                if not executor.draft_on_device:
                    self._offloaded_blocks = gained
                    self.offloads += 1
                    log.info("draft offloaded: KV pool +%d blocks", gained)
        elif num_waiting == 0 and (cap.free_blocks - self._offloaded_blocks
                                   > self.config.tau_low * (cap.total_blocks - self._offloaded_blocks)):
            # free > draft size + tau_low, tau_low taken of the pool as it will be after the reload
            if executor.load_draft():
                self.reloads += 1
                log.info("draft reloaded")

    def state(self):
        on = getattr(self, "executor", None)
        return {"policy": self.name, "gamma": self.gamma, "prev_gamma": self.bandit.prev_gamma,
                "draft_on_device": bool(on.draft_on_device) if on is not None else True,
                "offloads": self.offloads, "reloads": self.reloads}


def _mean_context(decodes) -> int:
    """Mean context (computed tokens) of a pass's decodes, the context its cost is priced at."""
    return sum(r.num_computed_tokens for r in decodes) // len(decodes)
