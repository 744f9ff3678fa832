"""QoServe's hybrid priority (eq. 4/5) and the load-adaptive interpolation factor alpha.

Lower priority values run first. alpha (seconds per token) interpolates between EDF
(alpha = 0) and shortest-remaining-prompt-first (alpha large).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gpu_runtime.qos import QoSClass, Tier
from gpu_runtime.request import Request

log = logging.getLogger(__name__)


def first_deadline(req: Request) -> float:
    """The deadline that orders the prefill queue: D_first (eq. 1) or D_total (eq. 3). An interactive
    request that has streamed tokens already (recomputing its KV after a preemption, or a rerun going on from an
    earlier attempt's tokens): its next token's (eq. 2)."""
    q = req.qos
    if q.qos_class is QoSClass.INTERACTIVE:
        if req.first_token_out:
            return req.next_token_deadline()
        return req.arrival_time + q.ttft_s  # type: ignore[operator]
    return req.arrival_time + q.ttlt_s  # type: ignore[operator]


def vllm_priority(req: Request) -> int:
    """How a vLLM user maps coserve's classes to vLLM's priority policy (lower runs first): paid interactive,
    paid batch, free interactive, free batch."""
    return (req.qos.tier is Tier.FREE) * 2 + (req.qos.qos_class is QoSClass.BATCH)


def decode_remaining(req: Request) -> int:
    predicted = req.predicted_output_len or req.sampling.max_tokens
    return max(0, predicted - req.num_output_tokens)


def hybrid_priority(req: Request, alpha_s: float) -> float:
    """Eq. 4 (interactive): t_arr + TTFT + a*prefill_rem; eq. 5 (batch): t_arr + TTLT + a*(prefill_rem + decode_rem)."""
    if req.qos.qos_class is QoSClass.INTERACTIVE:
        return first_deadline(req) + alpha_s * req.prefill_remaining
    return first_deadline(req) + alpha_s * (req.prefill_remaining + decode_remaining(req))


def tier_first_priority(req: Request, alpha_s: float) -> tuple[bool, float]:
    """Paid before free (the low tier is shed first, QoServe 3.4), then the hybrid key (eq. 4/5)."""
    return req.qos.tier is Tier.FREE, hybrid_priority(req, alpha_s)


def remaining_work(req: Request) -> float:
    """Sarathi-SRPF key: prompt tokens left only (QoServe 4.1.2: shortest remaining prefill first)."""
    return float(req.prefill_remaining)


@dataclass
class LoadAdaptiveAlpha:
    """alpha ~1 ms/token (close to EDF) at low load, larger (SRPF-like) under overload (QoServe 3.6).

    Load = queued prefill work (seconds, from the cost model) over the tightest first-token
    target waiting; hysteresis keeps alpha from flapping."""

    low_ms: float = 1.0
    high_ms: float = 8.0
    overload_at: float = 1.0  # load above which alpha switches to high
    underload_at: float = 0.5  # load below which it switches back to low
    adaptive: bool = True
    overloaded: bool = False

    @property
    def alpha_s(self) -> float:
        if not self.adaptive:
            return self.high_ms / 1000.0
        return (self.high_ms if self.overloaded else self.low_ms) / 1000.0

    def update(self, load: float) -> bool:
        """Feed the current load; returns True when alpha changed (queues must be re-keyed)."""
        if not self.adaptive:
            return False
        before = self.overloaded
        if not self.overloaded and load > self.overload_at:
            self.overloaded = True
        elif self.overloaded and load < self.underload_at:
            self.overloaded = False
        if before != self.overloaded:
            log.debug("alpha -> %.1f ms/token (load %.2f)", self.alpha_s * 1000, load)
        return before != self.overloaded
