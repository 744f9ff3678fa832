"""Workloads from the Azure LLM traces: token counts, arrival processes, QoS tier mixes.

Prompts are placeholder token lists of the trace's ContextTokens length. Requests ask for
a realistic ``max_tokens`` (what a client sends, not the answer's length); the simulated
model emits EOS after GeneratedTokens (``SimRequest.stop_after``), so the decode-length
predictor, KV footprints and eq. 5 never see the true output length. Arrivals are Poisson
at a chosen QPS, the trace's own timestamps rescaled, or bursty (alternating between two
rates every period).
"""

from __future__ import annotations

import csv
import logging
import random
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from gpu_runtime.data import trace_path
from gpu_runtime.qos import QoSClass, QoSSpec, TbtAnchor, Tier
from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceRow:
    timestamp: float  # seconds since the first row
    prompt_len: int
    output_len: int


@lru_cache(maxsize=4)
def load_trace(name: str, path: str | None = None) -> tuple[TraceRow, ...]:
    """``conv`` or ``code`` (or a CSV path) -> rows with TIMESTAMP, ContextTokens, GeneratedTokens."""
    p = Path(path) if path else trace_path(name)
    rows, t0 = [], None
    with p.open() as f:
        for r in csv.DictReader(f):
            ts = datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp()
            t0 = ts if t0 is None else t0
            rows.append(TraceRow(ts - t0, max(1, int(r["ContextTokens"])), max(1, int(r["GeneratedTokens"]))))
    return tuple(rows)


@dataclass(frozen=True)
class TierSpec:
    """One QoS bucket of the mix (QoServe Q1/Q2/Q3)."""

    name: str
    share: float
    qos: QoSSpec


def paper_tiers(scale: float = 1.0, free_share: float = 0.0,
                tbt_anchor: TbtAnchor = TbtAnchor.ARRIVAL) -> list[TierSpec]:
    """Q1 TTFT 6 s / TBT 50 ms, Q2 TTLT 600 s, Q3 TTLT 1800 s, equal thirds; SLOs x ``scale``.

    ``free_share`` of each bucket is free tier (the bursty experiment's low-priority jobs);
    ``tbt_anchor``: where Q1's TBT deadlines start (QoServe's eq. 2 by default)."""
    base = [("Q1", QoSClass.INTERACTIVE, dict(ttft_s=6.0 * scale, tbt_s=0.05 * scale, tbt_anchor=tbt_anchor)),
            ("Q2", QoSClass.BATCH, dict(ttlt_s=600.0 * scale)),
            ("Q3", QoSClass.BATCH, dict(ttlt_s=1800.0 * scale))]
    tiers = []
    for name, cls, kw in base:
        if free_share > 0:
            tiers.append(TierSpec(f"{name}-paid", (1 - free_share) / 3, QoSSpec(cls, Tier.PAID, **kw)))
            tiers.append(TierSpec(f"{name}-free", free_share / 3, QoSSpec(cls, Tier.FREE, **kw)))
        else:
            tiers.append(TierSpec(name, 1 / 3, QoSSpec(cls, Tier.PAID, **kw)))
    return tiers


def poisson_times(n: int, qps: float, rng: random.Random, start: float = 0.0) -> list[float]:
    t, out = start, []
    for _ in range(n):
        t += rng.expovariate(qps)
        out.append(t)
    return out


def bursty_times(duration_s: float, low_qps: float, high_qps: float, period_s: float,
                 rng: random.Random) -> list[float]:
    """Poisson arrivals alternating between ``low_qps`` and ``high_qps`` every ``period_s``."""
    t, out = 0.0, []
    while True:
        rate = low_qps if int(t // period_s) % 2 == 0 else high_qps
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(t)


def trace_times(rows: tuple[TraceRow, ...], n: int, qps: float) -> list[float]:
    """The trace's own inter-arrival pattern, rescaled to average ``qps``.

    Past the trace's end the pattern repeats, shifted by one whole span (plus a mean gap) per
    lap, so times stay non-decreasing."""
    ts = sorted(r.timestamp for r in rows)
    t0, m = ts[0], len(ts)
    lap = (ts[-1] - t0) * (1 + 1 / max(1, m - 1)) if m > 1 else 1.0
    raw = [ts[i % m] - t0 + (i // m) * lap for i in range(n)]
    scale = (n / qps) / raw[-1] if n and raw[-1] > 0 else 1.0
    return [t * scale for t in raw]


@dataclass(eq=False)
class SimRequest(Request):
    """A trace request. ``sampling.max_tokens`` is what the client asked for; ``stop_after`` (the
    trace's GeneratedTokens) is where the simulated model says EOS, hidden from schedulers."""

    stop_after: int | None = field(default=None)


def build_requests(rows: tuple[TraceRow, ...], times: list[float], tiers: list[TierSpec], rng: random.Random,
                   max_prompt: int = 8192, max_tokens: int = 4096, app_id: str = "trace") -> list[SimRequest]:
    """One request per arrival time: token counts sampled from the trace, tier by the mix shares.

    Every request asks for ``max_tokens``; it stops at the trace's output length (EOS)."""
    shares = [t.share for t in tiers]
    out = []
    sampling = SamplingParams(max_tokens=max_tokens)
    for i, t in enumerate(times):
        row = rows[rng.randrange(len(rows))]
        tier = rng.choices(tiers, weights=shares)[0]
        req = SimRequest(f"sim-{i}", [1] * min(row.prompt_len, max_prompt), sampling, tier.qos, t,
                         app_id=f"{app_id}-{tier.name}", stop_after=min(row.output_len, max_tokens))
        out.append(req)
    return out
