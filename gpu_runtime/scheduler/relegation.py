"""Eager relegation (QoServe 3.4): who leaves normal scheduling under overload.

A job that has violated, or will violate in this iteration, its first deadline (TTFT)
or completion deadline (TTLT) is relegated. Free-tier jobs go first; a paid job only
once its deadline has already passed and no free-tier job is left in the queue.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from gpu_runtime.qos import QoSClass, Tier
from gpu_runtime.request import Request
from gpu_runtime.scheduler.priority import decode_remaining, first_deadline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkEstimate:
    """How fast work drains this iteration (from the cost model)."""

    iteration_s: float  # predicted time of this iteration's batch
    budget: int  # prefill tokens per iteration
    decode_step_s: float  # time of one decode iteration (for a batch job's remaining tokens)


def predicted_finish(req: Request, now: float, est: WorkEstimate) -> float:
    """Best-case time the job meets its first deadline's condition if it ran from now on."""
    prefill_iters = math.ceil(req.prefill_remaining / max(1, est.budget))
    t = now + prefill_iters * est.iteration_s
    if req.qos.qos_class is QoSClass.BATCH:
        t += max(0, decode_remaining(req) - 1) * est.decode_step_s
    return t


def is_violated(req: Request, now: float) -> bool:
    """The deadline ordering this job (TTFT or TTLT) has already passed."""
    if req.qos.qos_class is QoSClass.INTERACTIVE and req.token_times:
        return False  # first token already out: TTFT is settled
    return now > first_deadline(req)


def will_violate(req: Request, now: float, est: WorkEstimate) -> bool:
    return is_violated(req, now) or predicted_finish(req, now, est) > first_deadline(req)


def should_relegate(req: Request, now: float, est: WorkEstimate, free_jobs_waiting: int) -> bool:
    """Free tier: violated or will violate. Paid tier: violated and no free job left to relegate."""
    if req.qos.tier is Tier.FREE:
        return will_violate(req, now, est)
    return free_jobs_waiting == 0 and is_violated(req, now)
