"""Simulation summaries: TTFT/TBT/TTLT percentiles, SLO violations per tier, goodput."""

from __future__ import annotations

import bisect
import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gpu_runtime.metrics import slo_met
from gpu_runtime.qos import Tier
from gpu_runtime.request import Request, RequestStatus

log = logging.getLogger(__name__)


@dataclass
class TierSummary:
    tier: str
    n: int
    violations: int  # unfinished requests count as violations

    @property
    def violation_rate(self) -> float:
        return self.violations / self.n if self.n else 0.0


@dataclass
class RunSummary:
    n: int
    violations: int
    ttft_p50: float
    ttft_p99: float
    tbt_p99: float
    ttlt_p50: float
    ttlt_p99: float
    tiers: dict[str, TierSummary]

    @property
    def violation_rate(self) -> float:
        return self.violations / self.n if self.n else 0.0


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def tier_key(req: Request, by: str = "tier") -> str:
    """Group key: the QoS tier (paid/free) or the application bucket (e.g. Q1 of ``trace-Q1`` or ``trace-Q1-paid``)."""
    if by == "bucket" and req.app_id:
        parts = req.app_id.split("-")
        return parts[1] if len(parts) > 1 else req.app_id
    return str(req.qos.tier)


def summarize(requests: list[Request], by: str = "tier") -> RunSummary:
    ttft, tbt, ttlt = [], [], []
    groups: dict[str, list[bool]] = defaultdict(list)
    viol = 0
    for r in requests:
        ok = r.status.finished and slo_met(r)
        viol += not ok
        groups[tier_key(r, by)].append(not ok)
        if r.token_times:
            ttft.append(r.token_times[0] - r.arrival_time)
            if len(r.token_times) > 1:
                tbt.extend(np.diff(r.token_times).tolist())
        if r.finish_time is not None:
            ttlt.append(r.finish_time - r.arrival_time)
    tiers = {k: TierSummary(k, len(v), sum(v)) for k, v in groups.items()}
    return RunSummary(len(requests), viol, _pct(ttft, 50), _pct(ttft, 99), _pct(tbt, 99), _pct(ttlt, 50),
                      _pct(ttlt, 99), tiers)


@dataclass
class RelegationSummary:
    """What eager relegation did in a run: how many jobs it set aside and whether they came back."""

    relegated: int  # requests relegated at least once
    relegated_paid: int  # of those, paid tier (only once violated and no free job was left)
    finished: int  # relegated ones that finished anyway (resumed, served with spare budget)
    finished_in_low: int  # of those, finished while the arrival rate was low (bursty runs; arrivals still coming)
    unfinished: int  # relegated ones still unfinished when the run ended
    expired: int = 0  # relegated ones the scheduler gave up on (finished_expired: not in ``finished``)
    finished_after_arrivals: int = 0  # of ``finished``, those that finished after the last arrival (the drain)

    @property
    def finished_share(self) -> float:
        return self.finished / self.relegated if self.relegated else float("nan")


def relegation_summary(requests: list[Request], low_phase: Callable[[float], bool] | None = None) -> RelegationSummary:
    """``low_phase(t)``: whether time ``t`` lies in a low-rate phase (bursty arrivals); a finish after the last arrival
    is in neither phase but the drain."""
    rel = [r for r in requests if r.relegation_count]
    expired = sum(1 for r in rel if r.status is RequestStatus.FINISHED_EXPIRED)
    done = [r for r in rel if r.status.finished and r.finish_time is not None
            and r.status is not RequestStatus.FINISHED_EXPIRED]
    last_arrival = max((r.arrival_time for r in requests), default=0.0)
    drained = [r for r in done if r.finish_time > last_arrival]  # type: ignore[operator]
    in_low = sum(1 for r in done if low_phase is not None and r.finish_time <= last_arrival  # type: ignore[operator]
                 and low_phase(r.finish_time))  # type: ignore[arg-type]
    return RelegationSummary(len(rel), sum(1 for r in rel if r.qos.tier is Tier.PAID), len(done), in_low,
                             len(rel) - len(done) - expired, expired, len(drained))


def free_on_time_while_paid_late(reqs: list[Request], whole_service: bool = False) -> int:
    """Free jobs that met their SLO although a paid job that ended late was waiting (arrived, not finished) while
    the free job's prompt was computed (first prefill chunk to first token): the free job took prefill capacity a
    late paid job lacked. ``whole_service``: while it was served at all, its decode to the last token included
    (stricter: the scheduler, like vLLM's, never preempts a running decode for a job that arrives later)."""
    late_paid = [(r.arrival_time, math.inf if r.finish_time is None else r.finish_time) for r in reqs
                 if r.qos.tier is Tier.PAID and not (r.status.finished and slo_met(r))]
    spans = [(r.arrival_time if r.scheduled_time is None else r.scheduled_time,
              r.finish_time if whole_service else r.first_token_time) for r in reqs
             if r.qos.tier is Tier.FREE and r.status.finished and slo_met(r) and r.first_token_time is not None]
    return spans_while_waiting(spans, late_paid)  # type: ignore[arg-type]


def spans_while_waiting(spans: list[tuple[float, float]], waiting: list[tuple[float, float]]) -> int:
    """How many ``(start, end)`` spans overlap at least one ``(arrival, end)`` waiting window."""
    waiting = sorted(waiting)
    arrivals = [a for a, _ in waiting]
    latest_end: list[float] = []  # latest end among the windows opened so far
    for _, e in waiting:
        latest_end.append(max(e, latest_end[-1]) if latest_end else e)
    n = 0
    for start, end in spans:
        i = bisect.bisect_right(arrivals, end)  # windows opened before the span ended ...
        n += i > 0 and latest_end[i - 1] > start  # ... one of them still open once it began
    return n
