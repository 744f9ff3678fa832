"""Dynamic chunking: the prefill budget C of one iteration (QoServe 3.2, Alg. 1 lines 5-7).

C is the largest size from a discrete search space whose predicted batch time, times a
safety factor, fits the minimum slack of the running decodes. The space is derived from
the cost model: from a small floor up to the chunk where prefill throughput saturates;
when KV memory is short only its lower half is searched.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

from gpu_runtime.costmodel.base import CostModel, saturation_tokens
from gpu_runtime.costmodel.features import BatchFeatures
from gpu_runtime.qos import QoSClass, TbtAnchor
from gpu_runtime.request import Request
from gpu_runtime.scheduler.priority import decode_remaining

log = logging.getLogger(__name__)


def decode_slack(req: Request, now: float, lost_below_s: float = 0.0) -> float:
    """Time left before the request's next token is due (QoServe 3.2: slack to the next deadline).

    Interactive: max(D_n (eq. 2, anchored as its QoS says), t_last + TBT) - now. Batch: the per-token time its TTLT
    still allows, (D_total - now) / predicted tokens left (eq. 3). A job that is already
    violated or relegated cannot be saved by smaller chunks, so it must not pin the budget
    to the floor (that collapses prefill throughput and cascades under overload): an
    interactive one keeps one TBT of slack (it still streams at its pace), a batch one
    leaves the minimum (infinite slack). So does a batch job whose pace is below ``lost_below_s``, the
    shortest pass the engine can run: it misses its deadline however small the chunks."""
    q = req.qos
    if q.qos_class is QoSClass.INTERACTIVE:
        d_n = req.next_token_deadline()
        due = max(d_n, req.token_times[-1] + q.tbt_s) if req.token_times else d_n  # type: ignore[operator]
        s = due - now
        if due > d_n + 1e-9 or d_n < now or req.relegation_count:  # behind schedule: floor at one TBT
            s = max(s, q.tbt_s)  # type: ignore[type-var]
        return s
    deadline = req.completion_deadline()
    assert deadline is not None
    if deadline <= now or req.relegation_count:
        return math.inf
    pace = (deadline - now) / max(1, decode_remaining(req))
    return math.inf if pace < lost_below_s else pace


def min_slack(decodes: Iterable[Request], now: float, lost_below_s: float = 0.0) -> float:
    """min over decodes of ``decode_slack`` (inlined for on-time interactive ones: this runs every iteration). A rerun
    (``qos.delivered``) counts its tokens over the whole answer (``Request.next_token_deadline``): not inlined."""
    best = math.inf
    interactive, first_token = QoSClass.INTERACTIVE, TbtAnchor.FIRST_TOKEN
    for r in decodes:
        q = r.qos
        if q.qos_class is interactive and not r.relegation_count and not q.delivered:
            tbt = q.tbt_s
            times = r.token_times
            start = r.arrival_time + q.ttft_s  # type: ignore[operator]
            if times and q.tbt_anchor is first_token and times[0] < start:  # stream pace (TbtAnchor)
                start = times[0]
            d_n = start + len(r.output_token_ids) * tbt  # type: ignore[operator]  # eq. 2
            if now <= d_n and (not times or times[-1] + tbt <= d_n + 1e-9):  # on schedule
                s = d_n - now
            else:
                s = decode_slack(r, now)
        else:
            s = decode_slack(r, now, lost_below_s)
        if s < best:
            best = s
    return best


def build_search_space(cost_model: CostModel, floor: int = 16, ceiling: int | None = None,
                       growth: float = 1.25, saturation_fraction: float = 0.95, max_tokens: int = 8192) -> list[int]:
    """Geometric grid (multiples of 16) from ``floor`` to the throughput-saturation chunk (or ``ceiling``), never
    outside them: a floor off the grid (17) is its own first size, and rounding never passes the top (201 -> 208)."""
    top = ceiling if ceiling is not None else saturation_tokens(cost_model, max_tokens, saturation_fraction, floor)
    top = max(top, floor)
    space, s = [], float(floor)
    while s < top:
        space.append(min(top, max(floor, int(round(s / 16) * 16))))
        s *= growth
    space.append(top)
    return sorted(set(space))


@dataclass
class BudgetChoice:
    budget: int  # prefill tokens allowed this iteration
    predicted_s: float  # predicted batch time at that budget (of the prompt tokens queued, where fewer)
    min_slack_s: float  # tightest decode slack (inf without decodes)
    context_tokens: int = 0  # KV tokens of the decodes the choice was made for (their attention's work)


class ChunkBudget:
    def __init__(self, cost_model: CostModel, space: list[int], safety: float = 1.2,
                 kv_short_fraction: float = 0.1) -> None:
        if not space:
            raise ValueError("empty chunk search space")
        self.cost_model = cost_model
        self.space = sorted(space)
        self.safety = safety  # predicted time x safety must fit the slack (errs toward small chunks)
        self.kv_short_fraction = kv_short_fraction  # free-KV share below which the space is halved

    def choose(self, decodes: list[Request], now: float, kv_free_fraction: float = 1.0,
               prefill_start: int = 0, queued_tokens: int | None = None, step_room: int | None = None
               ) -> BudgetChoice:
        """Alg. 1 lines 5-7. ``prefill_start``: tokens already computed of the prompt the chunk goes to
        (its attention covers them: a continued long prompt costs more than a fresh one). ``queued_tokens``: the
        prompt tokens waiting for a chunk. The pass predicted runs no more of them than wait: a 47-token prompt
        alone is a 47-token pass, not one of the budget (with vLLM's 4096-token step cap on the CPU, 6.7 s
        predicted against 63 ms, which relegated every interactive job that met an idle engine). ``step_room``:
        the prompt tokens the engine's step cap leaves beside the decodes (None: no cap); the budget is cut to it,
        and the pass predicted is the one cut."""
        n_dec = len(decodes)
        ctx = sum(r.num_computed_tokens for r in decodes)
        space = self.space
        if kv_free_fraction < self.kv_short_fraction:  # memory-aware: smaller chunks keep KV growth slow
            space = space[:max(1, (len(space) + 1) // 2)]
        predict, start = self.cost_model.predict, prefill_start

        def time_at(c: int) -> float:
            if not c:  # the decodes alone
                return predict(BatchFeatures(0, n_dec, 0, ctx, 0, n_dec, 0.0))
            return predict(BatchFeatures(c, n_dec, start + c, ctx, 0, n_dec + 1, c * (start + c / 2)))

        def chosen(c: int, slack: float) -> BudgetChoice:
            if step_room is not None:
                c = min(c, max(0, step_room))
            return BudgetChoice(c, time_at(c if queued_tokens is None else min(c, queued_tokens)), slack, ctx)

        # A batch decode that cannot keep its pace even beside the smallest chunk is lost: cutting every chunk
        # to the floor for it would only collapse prefill throughput (and cascade under overload).
        slack = min_slack(decodes, now, time_at(space[0]) * self.safety)
        if slack == math.inf:
            return chosen(space[-1], slack)
        # Largest c with time_at(c) * safety <= slack; time grows with c, so bisect on the space.
        lo, hi = 0, len(space)
        while lo < hi:
            mid = (lo + hi) // 2
            if time_at(space[mid]) * self.safety <= slack:
                lo = mid + 1
            else:
                hi = mid
        return chosen(space[lo - 1] if lo > 0 else space[0], slack)  # nothing fits: the smallest still progresses


def largest_fitting_chunk(cost_model: CostModel, target_s: float, num_decodes: int, decode_context: int,
                          space: list[int]) -> int:
    """Largest chunk of ``space`` whose batch with ``num_decodes`` decodes fits ``target_s`` (baseline tuning)."""
    fits = [c for c in space if cost_model.predict(
        BatchFeatures(c, num_decodes, c, num_decodes * decode_context, 0, num_decodes + 1, c * c / 2)) <= target_s]
    return fits[-1] if fits else space[0]


__all__ = ["BudgetChoice", "ChunkBudget", "build_search_space", "decode_slack", "largest_fitting_chunk",
           "min_slack"]
