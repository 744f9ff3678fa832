"""Per-request serving metrics: TTFT, TBT percentiles, TTLT and SLO attainment."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from gpu_runtime.qos import QoSClass, token_deadline
from gpu_runtime.request import Request


@dataclass(frozen=True)
class RequestMetrics:
    ttft_s: float | None
    tbt_p50_s: float | None
    tbt_p99_s: float | None
    ttlt_s: float | None
    mean_tpot_s: float | None
    num_output_tokens: int
    slo_met: bool | None  # None while unfinished

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def request_metrics(req: Request) -> RequestMetrics:
    times = req.token_times
    ttft = times[0] - req.arrival_time if times else None
    gaps = np.diff(times) if len(times) > 1 else np.array([])
    ttlt = (req.finish_time - req.arrival_time) if req.finish_time is not None and times else None
    tpot = float((times[-1] - times[0]) / (len(times) - 1)) if len(times) > 1 else None
    slo = slo_met(req) if req.status.finished else None
    return RequestMetrics(
        ttft_s=ttft,
        tbt_p50_s=float(np.percentile(gaps, 50)) if gaps.size else None,
        tbt_p99_s=float(np.percentile(gaps, 99)) if gaps.size else None,
        ttlt_s=ttlt,
        mean_tpot_s=tpot,
        num_output_tokens=len(times),
        slo_met=slo,
    )


def slo_met(req: Request) -> bool:
    """Interactive: every token meets its eq. 1/2 deadline (as its QoS anchors them); batch: last token by eq. 3."""
    if not req.token_times:
        return False
    if req.qos.qos_class is QoSClass.INTERACTIVE:
        first_due = token_deadline(req.arrival_time, req.qos, 1, req.token_times[0])  # D_n = D_1 + (n-1) TBT
        tbt = req.qos.tbt_s
        return all(t <= first_due + i * tbt + 1e-9 for i, t in enumerate(req.token_times))  # type: ignore[operator]
    return req.token_times[-1] <= req.arrival_time + req.qos.ttlt_s + 1e-9  # type: ignore[operator]
