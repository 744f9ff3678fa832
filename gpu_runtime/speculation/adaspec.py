"""AdaSpec: adaptive chain length with an SLO-aware efficiency estimator (SoCC'25, section 5).

* Efficiency model (section 4): T = alpha*N_c + gamma*N_b + delta for the draft (per
  step) and the target pass, fitted online from observed latencies (or seeded).
* Adaptive drafter (Alg. 1, predict-execute-correct): predict each next draft step's
  confidence from history and draft one more step only while the estimated goodput
  rises; a step time above the tightest TPOT target scores -1 (where a plain step meets it).
* Confidence-prior verifier (Alg. 2): drop the lowest-acceptance (tail) draft tokens of
  the batch while the estimated goodput rises. Drafts stay prefixes; the bonus token
  counts as accepted (DESIGN.md decisions).

With a draft model, the first step is decided on the predicted confidence and the drafter
asks ``keep_drafting`` after each further depth, which answers with the real confidences
of the steps drafted so far (Alg. 1's predict-execute-correct). With a draft whose steps
are (nearly) free, e.g. prompt lookup, the chain is drafted to ``max_length`` and Alg. 1's
stop rule runs on the real confidences in ``select``.

Alg. 3's TPOT constraint is per request the larger of its per-token target and the time left to
its next token's deadline: coserve's deadlines are cumulative (token n is due at a fixed time), so
a request that speculation got ahead of its schedule can take a longer step and still deliver on
time; with the per-token target alone, a pass of 35 decodes with 2 draft tokens each already broke a
coding request's 18.3 ms and capped every chain at one token.

A co-serving pass also runs the iteration's prefill chunks: the target's fit counts every
token of the pass, the chunks' tokens at a price of their own (fitted on decode tokens alone, the
chunks' time made each tree token look several times dearer than it is; fitted with the chunks'
tokens as decode tokens, it looked half as dear as it is: ``LinearStepCost``), the goodput's time is
the whole pass, and Alg. 3's TPOT check reads the decode part.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from gpu_runtime.executor.base import DraftEntry
from gpu_runtime.qos import QoSClass
from gpu_runtime.speculation.base import SpeculationPolicy
from gpu_runtime.speculation.cost import Ema, LinearStepCost
from gpu_runtime.speculation.selection import likely_beyond_slack
from gpu_runtime.speculation.token_tree import TokenTree

log = logging.getLogger(__name__)


@dataclass
class AdaSpecConfig:
    max_length: int = 8  # longest chain the drafter may build
    prior_confidence: float = 0.6  # confidence assumed at a depth never drafted yet
    warmup_steps: int = 12  # steps cycling lengths 1..max_length so both time models fit
    confidence_weight: float = 0.1  # EMA weight of the per-depth confidence history
    calibrate: bool = True  # rescale draft confidences by observed accepted/predicted
    free_draft_ratio: float = 0.02  # draft step below this share of a target pass: draft max_length, stop on real conf.
    # With the chain length at 0 nothing is drafted, so the confidences would never change
    # again and speculation could never come back: every this many steps a 1-token chain is
    # drafted anyway to refresh them (0: never).
    probe_every: int = 16
    # Co-serving (AdaServe's rule): after Alg. 2, the tokens whose extra pass time fits the scheduler's spare
    # time stay, beyond them only tokens with path probability >= this. 0: no limit.
    min_prob_beyond_slack: float = 0.2
    # Alg. 3's TPOT constraint on a speculative step: "step" (the paper's) bounds the step's time, so that a request
    # that accepts no draft still gets its token in time; "per-token" bounds a request's expected time per token
    # (the step over the tokens it is expected to yield), the pace a TPOT target measures and what coserve's
    # cumulative deadlines hold a stream to. Draft model (assumed acceptance), 14 / 18 RPS, 3 seeds: attained
    # 94.2 / 79.6% with "step" at 1.0x the SLOs, 98.7 / 85.5% with "per-token" (chain-4 99.2 / 86.1%); prompt lookup
    # within 0.4 point (docs/BENCHMARKS.md, stop 41).
    tpot_check: Literal["step", "per-token"] = "per-token"
    # As AdaServe's: the spare time of a pass that carries a prefill chunk is not free (the queued prompts wait for
    # the pass too). Measured against True: +0.2 to +0.9 points of attainment with a draft model, -0.2 to +0.2 with
    # prompt lookup (docs/BENCHMARKS.md, stop 41).
    spare_free_beside_prefill: bool = False


@dataclass
class ChainEstimate:
    length: int
    expected_tokens: float  # NAT: accepted + bonus tokens over the batch
    step_time_s: float
    goodput: float  # tokens/s, -1 when the step breaks the tightest TPOT target


class AdaSpec(SpeculationPolicy):
    name = "adaspec"

    @classmethod
    def drafting_up_to(cls, longest: int, chains_only: bool = False) -> dict[str, int]:
        return {"max_length": longest}

    def __init__(self, config: AdaSpecConfig | None = None, target_cost: LinearStepCost | None = None,
                 draft_cost: LinearStepCost | None = None, **overrides) -> None:
        self.config = config or AdaSpecConfig(**overrides)
        self.target_cost = target_cost or LinearStepCost()
        self.draft_cost = draft_cost or LinearStepCost()
        self.confidence = [Ema(self.config.prior_confidence, self.config.confidence_weight)
                           for _ in range(self.config.max_length)]
        self.scale = 1.0  # observed / predicted accepted tokens (confidence calibration)
        self._pred_acc = Ema(0.0, 0.05)
        self._real_acc = Ema(0.0, 0.05)
        self._steps = 0
        self._idle_steps = 0  # consecutive steps planned at length 0
        self._length = 0
        self._verified: dict[str, int] = {}
        self._free_draft = False  # this step drafted max_length: Alg. 1 stops on real confidences in select
        # A draft model's step: (requests, context tokens, tightest TPOT) for ``keep_drafting``, and the
        # expected tokens (bonus included) and verified tokens of the depths drafted so far.
        self._step_plan: tuple[int, int, float | None] | None = None
        self._step_tokens = 0.0
        self._step_verified = 0

    # ---- the efficiency estimator (Alg. 3) ----
    def _acceptance(self, cond: list[float]) -> list[float]:
        """AR_j = scale * prod_{k<=j} c_k (section 4.2), capped at 1."""
        out, acc = [], 1.0
        for c in cond:
            acc *= c
            out.append(min(1.0, acc * self.scale))
        return out

    def estimate(self, n: int, context: int, draft_steps: int, rates: list[list[float]],
                 tpot_limit: float | None, draft_time_s: float | None = None) -> ChainEstimate:
        """Goodput of one step: n requests, verified tokens given by their acceptance rates."""
        verified = sum(len(r) for r in rates)
        tokens = n + sum(sum(r) for r in rates)  # bonus token counts
        t_draft = draft_time_s if draft_time_s is not None else draft_steps * self.draft_cost.predict(context, n)
        t, t_decode = self._step_times(context, n, verified, t_draft)
        good = tokens / t if t > 0 else float(tokens)
        if draft_steps > 0 and self._breaks_tpot(context, n, t_decode, tokens, tpot_limit):
            good = -1.0  # Alg. 3: a step slower than the TPOT SLO is rejected
        return ChainEstimate(draft_steps, tokens, t, good)

    def _breaks_tpot(self, context: int, n: int, t_decode: float, tokens: float, tpot_limit: float | None) -> bool:
        """Alg. 3's constraint on a speculative step whose decode part takes ``t_decode`` and yields ``tokens``
        (bonus tokens included) over ``n`` requests: within the TPOT target, as ``AdaSpecConfig.tpot_check`` reads
        it. It binds only where a plain decode step meets the target; where even that breaks it, a request can meet
        its target only by accepting drafts, and the length that maximizes goodput is the best it can do (with the
        constraint, every chain was refused there: 7-8% of requests attained at 0.6x the SLOs with a draft model,
        80% with chain-4)."""
        if tpot_limit is None:
            return False
        pace = t_decode * n / tokens if self.config.tpot_check == "per-token" else t_decode
        return pace > tpot_limit and self._step_times(context, n, 0, 0.0)[1] <= tpot_limit

    def _step_times(self, context: int, n: int, verified: int, draft_s: float) -> tuple[float, float]:
        """(whole step, its decode part): drafting plus the target pass with and without the pass's prefill
        chunks (Alg. 3's TPOT check reads the decode part)."""
        attended = _attended(context, n, verified)
        decode = self.target_cost.predict(attended, n + verified)
        return draft_s + self.target_cost.predict(attended, n + verified, self.prefill_tokens_in_pass), draft_s + decode

    def plan_length(self, n: int, context: int, tpot_limit: float | None) -> int:
        """Alg. 1: extend the chain while the predicted goodput rises (first local maximum)."""
        cond = [e.value for e in self.confidence]
        best = self.estimate(n, context, 0, [[] for _ in range(n)], tpot_limit)
        length = 0
        for sl in range(1, self.config.max_length + 1):
            rates = self._acceptance(cond[:sl])
            est = self.estimate(n, context, sl, [rates] * n, tpot_limit)
            if est.goodput <= best.goodput:
                break
            best, length = est, sl
        return length

    # ---- the policy ----
    def draft_plan(self, decodes, now):
        if not decodes:
            return []
        self._steps += 1
        cfg = self.config
        self._free_draft = False
        self._step_plan = None
        warmup = self._warmup_length(self._steps)
        if warmup is not None:
            self._length = warmup
        else:
            context, n = sum(r.num_computed_tokens for r in decodes), len(decodes)
            if self.draft_cost.predict(context, n) <= cfg.free_draft_ratio * self.target_cost.predict(context, n):
                self._free_draft, self._length = True, cfg.max_length  # Alg. 1 runs in select on real confidences
            else:
                tpot = _tightest_tpot(decodes, now)
                self._length = self.plan_length(n, context, tpot)  # Alg. 1's first step: predicted c_1
                if self._length == 0:
                    self._idle_steps += 1
                    if cfg.probe_every and self._idle_steps % cfg.probe_every == 0:
                        self._length = 1  # probe: refresh the confidences (see AdaSpecConfig.probe_every)
                else:  # further steps: the drafter asks keep_drafting with the real confidences
                    self._idle_steps = 0
                    self._step_plan, self._step_tokens, self._step_verified = (n, context, tpot), float(n), 0
                    self._length = cfg.max_length
        if self._length == 0:
            return []
        return [DraftEntry(r.request_id, self._length, 1) for r in decodes]

    def most_kept(self, decodes: int) -> int | None:
        """A warm-up step's length, else ``max_length`` (Alg. 1 and 2 choose on the drafted chains' confidences)."""
        warmup = self._warmup_length(self._steps + 1)
        return self.config.max_length if warmup is None else warmup

    def _warmup_length(self, step: int) -> int | None:
        """The chain length of planned step ``step`` (counted from 1) while the time models are still fitted, lengths
        1..max_length in turn so that the fit is identifiable; None past the warm-up."""
        cfg = self.config
        if step <= cfg.warmup_steps or not (self.target_cost.fitted and self.draft_cost.fitted):
            return 1 + (step - 1) % cfg.max_length
        return None

    def keep_drafting(self, depth: int, path_probs: dict[str, float]) -> bool:
        """Alg. 1 (predict-execute-correct) after ``depth`` drafted steps: one more while the estimated
        goodput rises, from the real path probabilities so far and the predicted confidence of the next step;
        a step that would break the tightest TPOT target is not taken (Alg. 3)."""
        if self._step_plan is None:
            return True  # warm-up, a probe or a free draft: the planned length
        n, context, tpot = self._step_plan
        self._step_tokens += sum(min(1.0, self.scale * p) for p in path_probs.values())  # AR at this depth
        self._step_verified += len(path_probs)
        confidence = self.confidence[depth].value if depth < self.config.max_length else 0.0
        more = sum(min(1.0, self.scale * p * confidence) for p in path_probs.values())
        step_s, verified = self.draft_cost.predict(context, n), self._step_verified
        t_now, _ = self._step_times(context, n, verified, depth * step_s)
        t_more, decode_more = self._step_times(context, n, verified + len(path_probs), (depth + 1) * step_s)
        go = (self._step_tokens + more) / t_more > self._step_tokens / t_now and not self._breaks_tpot(
            context, n, decode_more, self._step_tokens + more, tpot)
        self._length = depth + 1 if go else depth
        return go

    def select(self, decodes, candidates, now):
        chains: dict[str, tuple[TokenTree, list[float]]] = {}
        for r in decodes:
            tree = candidates.get(r.request_id)
            if tree is None or not len(tree):
                if self._length > 0:
                    self.confidence[0].update(0.0)  # the drafter proposed nothing (lookup miss)
                continue
            path = _chain_nodes(tree)
            cond = _conditionals([tree.path_probs[i] for i in path])
            for j, c in enumerate(cond[:self.config.max_length]):
                self.confidence[j].update(c)
            chains[r.request_id] = (tree.subtree(path), self._acceptance(cond))
        if not chains or self._steps <= self.config.warmup_steps:
            self._verified = {rid: sum(ar) for rid, (_, ar) in chains.items()}
            return {rid: t for rid, (t, _) in chains.items()}
        # Alg. 2: drop the batch's lowest-AR tail token while the estimated goodput rises.
        context = sum(r.num_computed_tokens for r in decodes)
        keep = {rid: len(t) for rid, (t, _) in chains.items()}
        rates = {rid: ar for rid, (_, ar) in chains.items()}
        draft_time = self._length * self.draft_cost.predict(context, len(decodes))

        def goodput() -> float:
            rs = [rates[rid][:k] for rid, k in keep.items()]
            rs += [[] for _ in range(len(decodes) - len(rs))]
            return self.estimate(len(decodes), context, self._length, rs, None, draft_time).goodput

        if self._free_draft:
            self._stop_on_real_confidences(keep, rates, len(decodes), context, _tightest_tpot(decodes, now))
        best = goodput()
        while True:
            tails = [(rates[rid][k - 1], rid) for rid, k in keep.items() if k > 0]
            if not tails:
                break
            _, rid = min(tails)
            keep[rid] -= 1
            g = goodput()
            if g > best:
                best = g
            else:
                keep[rid] += 1
                break
        out = {rid: chains[rid][0].subtree(list(range(k))) for rid, k in keep.items() if k > 0}
        prompt = self.prefill_tokens_in_pass
        spare = self.free_spare_s(prompt, self.config.spare_free_beside_prefill)
        if self.config.min_prob_beyond_slack > 0 and spare is not None and out:
            n = len(decodes)
            out = likely_beyond_slack(out, lambda tokens: self.target_cost.predict(
                _attended(context, n, tokens - prompt - n), tokens - prompt, prompt), n, prompt, spare,
                self.config.min_prob_beyond_slack)
            keep = {rid: len(out.get(rid, ())) for rid in keep}
        self._verified = {rid: sum(rates[rid][:k]) for rid, k in keep.items()}
        return out

    def _stop_on_real_confidences(self, keep: dict[str, int], rates: dict[str, list[float]], n: int,
                                  context: int, tpot_limit: float | None) -> None:
        """Alg. 1 with the drafted chains' own confidences: one more step while goodput rises."""
        step_s = self.draft_cost.predict(context, n)

        def goodput(sl: int) -> float:
            rs = [rates[rid][:min(k, sl)] for rid, k in keep.items()]
            rs += [[] for _ in range(n - len(rs))]
            return self.estimate(n, context, sl, rs, tpot_limit, sl * step_s).goodput

        length, best = 0, goodput(0)
        for sl in range(1, max(keep.values(), default=0) + 1):
            g = goodput(sl)
            if g <= best:
                break
            length, best = sl, g
        for rid in keep:
            keep[rid] = min(keep[rid], length)

    def observe(self, decodes, selected, result, draft_latency_s, now):
        if not decodes:
            return
        n = len(decodes)
        context = sum(r.num_computed_tokens for r in decodes)
        verified = sum(len(t) for t in selected.values())
        # every token of the pass; the prompt tokens as the engine set them for this pass, also when it had no drafts
        # and draft_plan did not run (a value kept from the last draft_plan made 1.6 s passes that carried a prompt
        # chunk look like plain decode passes, and the fit put every pass's time into delta)
        self.target_cost.observe(_attended(context, n, verified), n + verified, result.latency_s,
                                 self.prefill_tokens_in_pass)
        if self._length > 0:  # a draft timed at 0 is free: vLLM's n-gram drafter runs inside the pass it verifies
            self.draft_cost.observe(context, n, draft_latency_s / self._length)
        if self.config.calibrate and selected:
            predicted = sum(self._verified.get(rid, 0.0) for rid in selected)
            real = sum(len(result.accepted_nodes.get(rid, [])) for rid in selected)
            if predicted > 0:
                self._pred_acc.update(predicted)
                self._real_acc.update(real)
                if self._pred_acc.value > 0:
                    self.scale = min(2.0, max(0.2, self._real_acc.value / self._pred_acc.value))
        self._verified = {}

    def state(self):
        return {"policy": self.name, "length": self._length, "scale": round(self.scale, 3),
                "confidence": [round(e.value, 3) for e in self.confidence]}


def _attended(context: float, n: int, verified: float) -> float:
    """N_c of the time model: the context tokens the pass attends to. Each decode reads its context once and each
    verified draft token reads its request's context again (the batch's mean context stands for it). With N_c the
    contexts alone, a draft token's price was gamma only, and the fit, where N_c and N_b grow together with the
    batch, gave it about half of what it costs (vLLM on CPU, batch 8, chat prompts: 0.79 ms fitted, ~1.5 ms measured
    a token): AdaSpec kept 4 n-gram tokens a request at 0.42 first-position acceptance, 0.83-0.86x no speculation."""
    return context + max(0.0, verified) * context / max(1, n)


def _tightest_tpot(decodes, now) -> float | None:
    """Alg. 3's TPOT constraint for this step: the tightest over the batch of each request's per-token target,
    for an interactive request the time left to its next token's deadline when that is longer (deadlines
    are cumulative: a request that got ahead can take a longer step and still deliver on time); a batch
    job keeps the rate its completion deadline needs."""
    targets = []
    for r in decodes:
        target = r.tpot_target(now)
        if target is None:
            continue
        if r.qos.qos_class is QoSClass.INTERACTIVE:
            target = max(target, r.next_token_deadline() - now)
        targets.append(target)
    return min(targets) if targets else None


def _chain_nodes(tree: TokenTree) -> list[int]:
    """The most probable root-to-leaf chain of a (possibly wider) candidate tree."""
    path, node = [], -1
    while True:
        kids = tree.children(node)
        if not kids:
            return path
        node = max(kids, key=lambda k: tree.path_probs[k])
        path.append(node)


def _conditionals(path_probs: list[float]) -> list[float]:
    out, prev = [], 1.0
    for p in path_probs:
        out.append(p / prev if prev > 0 else 0.0)
        prev = p
    return out
