"""Per-request serving metrics: TTFT, TBT percentiles, TTLT and SLO attainment.

"SLO met" has one definition, here: an interactive request meets its SLO when every output token n
came out by its deadline D_n (eq. 1 for the first, eq. 2 for the rest, anchored as its QoS says);
a batch request when its last token came out by its completion deadline (eq. 3). Deadlines are
cumulative, so TBT percentiles do not decide it: slack banked by fast tokens absorbs a slow gap,
and gaps each a little over TBT add up to a miss. ``first_missed_deadline`` says which deadline a
request missed first, and by how much.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from gpu_runtime.qos import QoSClass, first_token_deadline, token_deadline
from gpu_runtime.request import Request


@dataclass(frozen=True)
class DeadlineMiss:
    """The first deadline a finished request missed. Times are seconds after its arrival."""

    token: int  # the output token (1-based) that came late; a batch job's last token
    due_s: float  # its deadline
    at_s: float | None  # when it came out (None: no token came out at all)

    @property
    def late_s(self) -> float | None:
        return None if self.at_s is None else self.at_s - self.due_s

    def as_dict(self) -> dict[str, object]:
        late = self.late_s
        return {"token": self.token, "due_s": self.due_s, "at_s": self.at_s,
                "late_ms": None if late is None else round(late * 1e3, 3)}


@dataclass(frozen=True)
class RequestMetrics:
    ttft_s: float | None
    tbt_p50_s: float | None
    tbt_p99_s: float | None
    ttlt_s: float | None
    mean_tpot_s: float | None
    num_output_tokens: int
    slo_met: bool | None  # None while unfinished
    slo_miss: DeadlineMiss | None = None  # the first deadline missed, when slo_met is False
    queue_s: float | None = None  # arrival to its first prompt chunk (vLLM's queue time); None: never scheduled
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage's cached_tokens)
    num_cache_write_tokens: int = 0  # prompt tokens written to the prefix cache (Responses' cache_write_tokens)

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["slo_miss"] = self.slo_miss.as_dict() if self.slo_miss is not None else None
        return out


def answer_token_times(req: Request) -> list[tuple[int, float]]:
    """(n, t) pairs: output token n (1-based) of the answer reached the client at clock time t. A rerun that went on
    from ``qos.delivered`` tokens of an earlier attempt is one answer: those tokens first (the first at
    ``qos.first_token_s``, the rest at ``delivered_times``; only the first where their times are not known), then its
    own as tokens delivered+1, ..."""
    q, d = req.qos, req.qos.delivered
    pairs = list(enumerate(req.delivered_times, 1)) if len(req.delivered_times) == d else []
    if d and q.first_token_s is not None:  # the first token's time as the job's row holds it (first_token_at)
        pairs[:1] = [(1, req.arrival_time + q.first_token_s)]
    return pairs + [(d + i, t) for i, t in enumerate(req.token_times, 1)]


def request_metrics(req: Request) -> RequestMetrics:
    """The answer's metrics as its client saw them: a rerun's TTFT is its earlier attempt's first token, its TBT
    counts the gaps over the whole stream (``answer_token_times``). ``num_output_tokens``: this attempt's."""
    pairs = answer_token_times(req)
    ttft = pairs[0][1] - req.arrival_time if pairs and pairs[0][0] == 1 else None
    gaps = np.array([t2 - t1 for (n1, t1), (n2, t2) in zip(pairs, pairs[1:]) if n2 == n1 + 1])
    ttlt = (req.finish_time - req.arrival_time) if req.finish_time is not None and pairs else None
    tpot = float((pairs[-1][1] - pairs[0][1]) / (pairs[-1][0] - pairs[0][0])) if len(pairs) > 1 else None
    miss = first_missed_deadline(req) if req.status.finished else None
    return RequestMetrics(
        ttft_s=ttft,
        tbt_p50_s=float(np.percentile(gaps, 50)) if gaps.size else None,
        tbt_p99_s=float(np.percentile(gaps, 99)) if gaps.size else None,
        ttlt_s=ttlt,
        mean_tpot_s=tpot,
        num_output_tokens=len(req.token_times),
        slo_met=miss is None if req.status.finished else None,
        slo_miss=miss,
        queue_s=None if req.scheduled_time is None else req.scheduled_time - req.arrival_time,
        num_cached_tokens=req.num_cached_tokens,
        num_cache_write_tokens=req.num_cache_write_tokens,
    )


def slo_met(req: Request) -> bool:
    """Interactive: every token meets its eq. 1/2 deadline (as its QoS anchors them); batch: last token by eq. 3."""
    return first_missed_deadline(req) is None


def first_missed_deadline(req: Request) -> DeadlineMiss | None:
    """The first deadline ``req`` missed (None: its SLO is met). Token n of an interactive request is due
    at D_n = D_1 + (n-1) TBT, D_1 as ``token_deadline`` anchors it; a batch request's last token at
    arrival + TTLT. A request that produced no token missed its first deadline. A rerun's tokens count over the
    whole answer (``answer_token_times``)."""
    pairs, arrival = answer_token_times(req), req.arrival_time
    if not pairs:
        return DeadlineMiss(1, first_token_deadline(arrival, req.qos) - arrival, None)
    if req.qos.qos_class is QoSClass.INTERACTIVE:
        first_due = token_deadline(arrival, req.qos, 1, pairs[0][1] if pairs[0][0] == 1 else None)  # D_n = D_1 + ...
        tbt = req.qos.tbt_s
        for n, t in pairs:
            due = first_due + (n - 1) * tbt  # type: ignore[operator]
            if t > due + 1e-9:
                return DeadlineMiss(n, due - arrival, t - arrival)
        return None
    due = arrival + req.qos.ttlt_s  # type: ignore[operator]
    n, last = pairs[-1]
    if last > due + 1e-9:
        return DeadlineMiss(n, due - arrival, last - arrival)
    return None
