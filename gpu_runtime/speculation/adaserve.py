"""AdaServe: SLO-customized speculative decoding (EuroSys'26, Algorithm 2, eq. 8-9).

Per iteration: choose beam depth d and width w from the load (eq. 8-9), let the
executor expand candidate trees, then select the sub-trees to verify under the
verification budget B so that each request's requirement A(r) is met first
(most demanding first) and the remaining budget goes to the globally most probable
nodes. B is the knee of the executor's latency-vs-tokens curve.

When that selection leaves unmet a requirement another selection could act on (SLOs tighter than
B, n_max and the likelihood rule let it serve), the policy instead meets every requirement the
candidate trees can meet and then verifies what maximizes expected accepted tokens per second of
iteration (``select_for_rate``): by that objective no static shape drawn from the same candidates
does better. After an iteration with a requirement unmet it drafts at least the static tree's beam.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from gpu_runtime.executor.base import DraftEntry
from gpu_runtime.speculation.base import SpeculationPolicy
from gpu_runtime.speculation.cost import Ema, LinearStepCost, knee_budget, slack_tokens
from gpu_runtime.speculation.requirement import slo_requirement
from gpu_runtime.speculation.selection import SelectionInput, SelectionResult, select_for_rate, select_trees

log = logging.getLogger(__name__)


@dataclass
class AdaServeConfig:
    # Defaults: the grid setting (ops/spec_grid_search.py) with the best worst case over both drafters'
    # grids, score relative to each grid's best (data/adaserve_grid.json: prompt lookup at 6/8 RPS,
    # 0.94; data/adaserve_grid_draft_model.json: draft model at 10/14 RPS, 0.93).
    d_min: int = 1  # D_min of eq. 8
    d_max: int = 4  # D_max of eq. 8 (artifact: 8)
    w_max: int = 3  # W_max of eq. 9 (artifact: 3)
    c1: float = 0.0  # eq. 8 constant
    c2: int = 0  # eq. 9 constant
    draft_budget: int = 96  # B2: draft tokens per beam step (artifact: 96)
    n_max: int = 2  # per-request node cap of the SLO-customized phase (Alg. 2 line 12); 8 let requests
    # far behind their TPOT take most of B for little expected gain (draft model at 10 RPS: 82% -> 99%)
    budget: int | None = None  # B fixed by hand; None = knee of the latency curve
    budget_shares_prefill: bool = False  # True: B also counts the pass's prefill-chunk tokens, which leaves
    # no speculation in exactly the slow iterations that carry a chunk (draft model at 10 RPS: 99% -> 100%)
    budget_tolerance: float = 0.5  # knee: latency within (1+tol) of the reference pass (grid search)
    budget_reference: str = "pass"  # "pass": the same pass without speculation (its decodes and chunk), never
    # below the one-token knee; "one-token": a one-token pass only (a fixed B: at 14 RPS with the draft model
    # it left ~1 token per request and attainment fell to 34%, 65% with "pass")
    max_budget: int = 512
    # Past the tokens that fit the time the scheduler's slack leaves in the pass (a co-serving pass is sized
    # to the tightest decode's deadline), a tree token delays every stream and displaces prefill: the
    # throughput phase then takes only nodes at least this likely to be accepted (0 = no such rule). Sweep
    # (ops/bench_spec_sim.py workload, first-token pace), attainment at 0 / 0.1 / 0.2 / 0.3 / 0.5 / 0.7:
    # prompt lookup 8 RPS 86.0 / 98.4 / 96.6 / 93.9 / 92.5 / 92.5%, 10 RPS 70.2 / 82.5 / 81.7 / 79.9 / 77.8 /
    # 77.6%; draft model (assumed acceptance) 18 RPS 81.8 / 86.1 / 87.2 / 87.0 / 84.6 / 79.2%.
    min_prob_beyond_slack: float = 0.2
    # The spare time of a pass that carries a prefill chunk is not free: the prompts queued behind the chunk wait
    # for the whole pass, so there tree tokens take the likelihood rule from the first one (False), as they do
    # beyond the slack. Draft model (assumed acceptance) at 18 RPS and 1.6x the SLOs, 3 seeds: 97.6% attained with
    # those tokens free (the misses: first tokens of queued prompts), 97.8% without, the best static shape 97.7%
    # (docs/BENCHMARKS.md, stop 40).
    spare_free_beside_prefill: bool = False
    warmup_tokens_per_request: int = 4  # B per request until a latency curve is known
    # When the selection above leaves an A(r) unmet that a selection can act on (``_selection_can_help``),
    # meet every requirement the candidates can, then verify what maximizes expected accepted tokens per
    # second of iteration (``select_for_rate``: no B, no n_max, no likelihood rule; the rate prices every
    # token by the time it adds). Without it, at 0.6x the SLOs with prompt lookup (8 RPS) the scheduler's
    # slack was always 0, the likelihood rule kept ~1 tree token per request, and AdaServe attained 16.2%
    # against the static tree's 35.6% (3 seeds; with it 38.4%: docs/BENCHMARKS.md, issue 18).
    rate_fallback: bool = True
    # Beam drafted after an iteration whose requirements could not all be met: at least the static tree's
    # (StaticTree: depth 8, width 3), so every static shape is among the candidates the fallback ranks.
    fallback_depth: int = 8
    fallback_width: int = 3


class AdaServe(SpeculationPolicy):
    name = "adaserve"

    @classmethod
    def drafting_up_to(cls, longest: int, chains_only: bool = False) -> dict[str, int]:
        # The deepest beam (the fallback's) is the drafter's longest, and eq. 8's D_max never exceeds it. A
        # drafter of chains has no width to multiply the depth (D_max 4 was fitted to beams 3 wide): eq. 8's
        # budget per request sets the depth up to the whole chain (vLLM batch 1, 16-token n-gram drafts: D_max 4
        # gave 2.05-2.08x no speculation, a static 16-token chain 2.34x).
        return {"fallback_depth": longest, "d_max": longest if chains_only else min(AdaServeConfig.d_max, longest)}

    def __init__(self, config: AdaServeConfig | None = None,
                 latency_curve: Callable[[int], float] | None = None, **overrides) -> None:
        self.config = config or AdaServeConfig(**overrides)
        self.latency_curve = latency_curve  # seconds for a pass of n tokens (cost-model profile)
        self.step_cost = LinearStepCost()
        self.t_spec = Ema(0.0)  # one iteration: draft + verification
        self.t_verify = Ema(0.0)  # the verification pass alone
        self.last: SelectionResult | None = None
        self._depth = self.config.d_min
        self._width = 1
        self._budget = 0
        self._accepted = Ema(0.0)
        self._knee: int | None = None  # one-token knee of ``latency_curve`` (set on first use)
        self._cheap: int | None = None  # tokens of B that fit the pass's spare time (None: all of B)
        self.t_draft = Ema(0.0)  # the drafting part of an iteration
        self._behind = False  # the last iteration left some requirement unmet: draft the fallback beam
        self._fell_back = 0  # iterations that used the rate fallback (state())
        self._curve_cache: dict[int, float] = {}

    def bind(self, executor) -> None:
        super().bind(executor)
        if self.latency_curve is None:
            self.latency_curve = getattr(executor, "latency_curve", None)
        cost_model = getattr(executor, "cost_model", None)
        if self.latency_curve is None and cost_model is not None:
            from gpu_runtime.costmodel.base import batch_time

            self.latency_curve = lambda n: batch_time(cost_model, n)  # the profile's latency-vs-tokens curve
        self._knee = None  # a new curve: walk it again
        self._curve_cache = {}

    # ---- eq. 8-9 and B ----
    def budget(self, num_requests: int, num_context: int = 0, prefill_tokens: int = 0) -> int:
        """B: verification tokens (roots included) this pass may carry, from the latency-vs-tokens curve."""
        cfg = self.config
        self._cheap = None
        if cfg.budget is not None:
            return cfg.budget
        if self.latency_curve is not None:
            curve = self.latency_curve
            if self._knee is None:  # the one-token knee depends on the curve alone: walk it once
                self._knee = knee_budget(curve, cfg.max_budget, cfg.budget_tolerance)
            knee = self._knee
            if cfg.budget_reference == "one-token":
                return knee
            # The pass without speculation already carries the decodes and the chunk; B may slow it by tol.
            in_pass = knee_budget(lambda n: curve(n + prefill_tokens), cfg.max_budget, cfg.budget_tolerance,
                                  min_tokens=max(1, num_requests))
            budget = max(knee, in_pass)
            spare = self.free_spare_s(prefill_tokens, cfg.spare_free_beside_prefill)
            if cfg.min_prob_beyond_slack > 0 and spare is not None:
                self._cheap = slack_tokens(curve, num_requests, prefill_tokens, spare, budget)
            return budget
        if self.step_cost.fitted and self.step_cost.gamma > 0:
            return knee_budget(lambda n: self.step_cost.predict(num_context, n), cfg.max_budget,
                               cfg.budget_tolerance)
        return num_requests * (1 + cfg.warmup_tokens_per_request)

    def most_kept(self, decodes: int) -> int | None:
        """The fallback beam's depth after an iteration with a requirement unmet (the rate fallback verifies any part
        of it), else eq. 8's depth and the tokens B leaves beyond the roots, over every batch of up to ``decodes``
        where B is known before the pass (fixed by hand, or the warm-up's per request); D_max where B depends on the
        pass's prompt tokens (the latency curve's knee) or its contexts (the fitted step cost)."""
        cfg = self.config
        if self._behind and cfg.rate_fallback:
            return max(cfg.d_max, cfg.fallback_depth)
        fitted = self.step_cost.fitted and self.step_cost.gamma > 0
        if cfg.budget is None and (self.latency_curve is not None or fitted):
            return cfg.d_max
        # ``budget_shares_prefill`` only lowers B, and a smaller B never verifies more
        return max((self._most_verified(n, self.budget(n)) for n in range(1, max(1, decodes) + 1)), default=0)

    def _most_verified(self, num_requests: int, budget: int) -> int:
        """The most tree tokens one of ``num_requests`` requests verifies under B = ``budget``: its beam's depth, and
        B less every request's root (none at all when B leaves nothing beyond the roots)."""
        if budget <= num_requests:
            return 0
        return min(self.shape(num_requests, budget)[0], budget - num_requests)

    def shape(self, num_requests: int, budget: int) -> tuple[int, int]:
        cfg = self.config
        n = max(1, num_requests)
        d = min(cfg.d_max, max(cfg.d_min, int(budget // (n + cfg.c1)) - 1))  # eq. 8
        w = min(cfg.w_max, max(1, int(cfg.draft_budget // n) + cfg.c2))  # eq. 9
        return d, w

    # ---- the policy ----
    def draft_plan(self, decodes, now):
        if not decodes:
            return []
        context = sum(r.num_computed_tokens for r in decodes)
        self._budget = self.budget(len(decodes), context, self.prefill_tokens_in_pass)
        if self.config.budget_shares_prefill:  # the knee bounds the whole pass, prefill chunks included
            self._budget = max(0, self._budget - self.prefill_tokens_in_pass)
        self._depth, self._width = self.shape(len(decodes), self._budget)
        if self._behind and self.config.rate_fallback:
            # A requirement went unmet last time: give the fallback every static shape to choose from.
            self._depth = max(self._depth, self.config.fallback_depth)
            self._width = max(self._width, self.config.fallback_width)
        elif self._budget <= len(decodes):
            return []  # no room beyond the roots: plain decoding
        return [DraftEntry(r.request_id, self._depth, self._width) for r in decodes]

    def select(self, decodes, candidates, now):
        # ``now`` is after the speculation phase (the engine passes the clock after drafting),
        # so l_r already holds this iteration's draft time and only the verification pass is
        # still to come: A(r) = (l_r + t_verify)/TPOT - o_r (eq. 2 with t_spec = draft + verify).
        inputs = [SelectionInput(r.request_id, slo_requirement(r, now, self.t_verify.value), self._depth)
                  for r in decodes]
        self.last = select_trees(inputs, candidates, self._budget, self.config.n_max, self._cheap,
                                 self.config.min_prob_beyond_slack)
        self._behind = bool(self.last.infeasible)
        if self.last.infeasible:
            log.debug("SLO requirement unmet for %d/%d requests", len(self.last.infeasible), len(inputs))
            pass_time = self.pass_time(decodes) if self.config.rate_fallback else None
            if pass_time is not None and self._selection_can_help(self.last.infeasible, decodes, candidates,
                                                                   pass_time, now):
                self.last = select_for_rate(inputs, candidates, pass_time, self.t_draft.value)
                self._fell_back += 1
        return self.last.trees

    def _selection_can_help(self, unmet: set[str], decodes, candidates, pass_time: Callable[[int], float],
                            now: float) -> bool:
        """Whether a requirement left unmet is one a different selection should act on: a drafted request's
        (other sub-trees might meet it), or that of a request whose per-token target is shorter than the
        iteration without trees (it falls further behind in every iteration that does not speed it up, so
        the tokens the others bank ahead of their pace are needed too; prompt lookup at 0.6x the SLOs, 8 RPS,
        3 seeds: 38.4% attainment, 35.1% without this case, the static tree 35.6%). A request that is behind
        with no draft and a target longer than the iteration catches up by itself: falling back for it only
        lengthened passes (1.0x the SLOs: 95.3% against 97.2%)."""
        if any(len(candidates.get(rid) or ()) for rid in unmet):
            return True
        iteration = self.t_draft.value + pass_time(0)
        return any(r.request_id in unmet and (tpot := r.tpot_target(now)) is not None and tpot < iteration
                   for r in decodes)

    def pass_time(self, decodes) -> Callable[[int], float] | None:
        """Seconds of this iteration's verification pass as a function of its tree tokens (its decodes and
        prefill chunk included), from the latency curve or the fitted step cost; None before either exists."""
        base = len(decodes) + self.prefill_tokens_in_pass
        if self.latency_curve is not None:
            curve, cache = self.latency_curve, self._curve_cache

            def timed(k: int) -> float:
                n = base + k
                if n not in cache:  # the curve depends on the token count alone: one call per count
                    cache[n] = curve(n)
                return cache[n]
            return timed
        if self.step_cost.fitted and self.step_cost.gamma > 0:
            context = sum(r.num_computed_tokens for r in decodes)
            prompt = self.prefill_tokens_in_pass
            return lambda k: self.step_cost.predict(context, len(decodes) + k, prompt)
        return None

    def observe(self, decodes, selected, result, draft_latency_s, now):
        if not decodes:
            return
        self.t_spec.update(result.latency_s + draft_latency_s)
        self.t_verify.update(result.latency_s)
        self.t_draft.update(draft_latency_s)
        context = sum(r.num_computed_tokens for r in decodes)
        tokens = len(decodes) + sum(len(t) for t in selected.values())
        self.step_cost.observe(context, tokens, result.latency_s, self.prefill_tokens_in_pass)
        acc = sum(len(v) for v in result.accepted_nodes.values())
        self._accepted.update(1.0 + acc / len(decodes))

    def state(self):
        return {"policy": self.name, "budget": self._budget, "depth": self._depth, "width": self._width,
                "tokens_per_step": round(self._accepted.value, 3),
                "infeasible": len(self.last.infeasible) if self.last else 0, "rate_fallbacks": self._fell_back}
