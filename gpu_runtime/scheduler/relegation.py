"""Eager relegation (QoServe 3.4, Alg. 1 lines 12-15): who leaves normal scheduling under overload,
and when a relegated job is given up on.

A job that has violated, or will violate, its first deadline (TTFT, eq. 1) or completion deadline
(TTLT, eq. 3) is relegated. Free-tier jobs go first: a free job is relegated as soon as it is
predicted to miss (and, in the scheduler, when running it would make a paid job late). A paid job
is relegated once it cannot meet its deadline even if it ran at the head of the queue from now on
(``PaidRelegation.HOPELESS``, the paper's WILL_VIOLATE applied to every job): left in line it
would take capacity from paid jobs that can still make it, and under sustained overload that
cascade leaves most paid jobs late (issue 18: 42.8% late against a capacity floor of ~17%).
Relegating it costs no free job anything, so the tier order (free first) still holds: free work
is shed before a paid job that could be saved. ``PaidRelegation.VIOLATED`` is the paper's text
read literally: a paid job only once its deadline passed and no free job waits.

A relegated job runs with spare budget and resumes when load drops. Relegated paid jobs run before
relegated free ones, and while one waits, free jobs yield to it (``free_yields_relegated_paid``).
One that is still relegated long after its deadline expires (``expires_at``): the engine finishes it
with the status ``finished_expired`` instead of leaving it queued for ever. Under overload that never
ends spare budget never comes, so this is every relegated job's end: one that already streamed tokens
too (its client's stream open meanwhile), later than shed work and with what it streamed (issue 18:
every relegated job finished or expired with a clear status).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from enum import StrEnum

from gpu_runtime.qos import QoSClass, Tier
from gpu_runtime.request import Request
from gpu_runtime.scheduler.priority import decode_remaining, first_deadline

log = logging.getLogger(__name__)


class PaidRelegation(StrEnum):
    """When a paid job is relegated."""

    VIOLATED = "violated"  # its deadline passed and no free job is waiting (QoServe 3.4 as printed)
    HOPELESS = "hopeless"  # it will miss its deadline even at the head of the queue (Alg. 1 WILL_VIOLATE)


@dataclass(frozen=True)
class WorkEstimate:
    """How fast work drains this iteration (from the cost model)."""

    iteration_s: float  # predicted time of this iteration's batch
    budget: int  # prefill tokens per iteration
    decode_step_s: float  # time per output token a batch job can count on once it decodes
    interactive_step_s: float = 0.0  # the least time per token of an interactive stream: a pure decode pass
    # of the running decodes and one more


def pace_loss(req: Request, est: WorkEstimate) -> float:
    """How far an interactive job's last token falls behind its first token's lateness (eq. 2: token n is due
    TBT after token n-1's deadline): a stream whose every pass takes longer than TBT loses the difference per
    token, so an on-time first token only keeps the job on time if it came that much early."""
    tbt = req.qos.tbt_s
    if tbt is None or est.interactive_step_s <= tbt:
        return 0.0
    return max(0, decode_remaining(req) - 1) * (est.interactive_step_s - tbt)


def predicted_finish(req: Request, now: float, est: WorkEstimate) -> float:
    """Best-case time the job meets its first deadline's condition if it ran from now on: its prefill
    with the whole budget every iteration, then (batch, eq. 3) its predicted decode at ``decode_step_s``,
    or (interactive, eq. 1-2) the ground its stream will lose to a pace slower than TBT."""
    prefill_iters = math.ceil(req.prefill_remaining / max(1, est.budget))
    t = now + prefill_iters * est.iteration_s
    if req.qos.qos_class is QoSClass.BATCH:
        t += max(0, decode_remaining(req) - 1) * est.decode_step_s
    else:
        t += pace_loss(req, est)
    return t


def is_violated(req: Request, now: float) -> bool:
    """The deadline ordering this job (TTFT or TTLT) has already passed."""
    if req.qos.qos_class is QoSClass.INTERACTIVE and (req.token_times or req.qos.delivered):
        return False  # first token already out (this attempt's or an earlier one's): TTFT is settled
    return now > first_deadline(req)


def will_violate(req: Request, now: float, est: WorkEstimate) -> bool:
    return is_violated(req, now) or predicted_finish(req, now, est) > first_deadline(req)


def should_relegate(req: Request, now: float, est: WorkEstimate, free_jobs_waiting: int,
                    paid: PaidRelegation = PaidRelegation.HOPELESS) -> bool:
    """Free tier: violated or will violate. Paid tier: by ``paid`` (see ``PaidRelegation``)."""
    if req.qos.tier is Tier.FREE or paid is PaidRelegation.HOPELESS:
        return will_violate(req, now, est)
    return free_jobs_waiting == 0 and is_violated(req, now)


def free_yields_until(until: float, req: Request, now: float) -> float:
    """Until when free work yields to every waiting paid job, after ``req`` was relegated at ``now``.

    A paid job relegated means paid demand outran capacity over the span of its target (TTFT or TTLT):
    for that long, every prefill token a free job takes is one a waiting paid job will miss later, even
    if no paid job in line is due soon (the check that it "can wait" sees the queue, not the paid jobs
    still to arrive). So free work is shed first (QoServe 3.4) until one target after the paid loss."""
    return max(until, now + target_s(req)) if req.qos.tier is Tier.PAID else until


def target_s(req: Request) -> float:
    """The job's own first target: TTFT (interactive, eq. 1) or TTLT (batch, eq. 3), seconds."""
    q = req.qos
    return q.ttft_s if q.qos_class is QoSClass.INTERACTIVE else q.ttlt_s  # type: ignore[return-value]


def expires_at(req: Request, factor: float, min_grace_s: float = 0.0) -> float:
    """When a relegated job is given up on: its deadline (eq. 1 / eq. 3) plus a grace of ``factor`` times its own
    target, at least ``min_grace_s`` (a job with a millisecond target still gets its chance once load drops). With
    factor 2 and a minute's grace: an interactive job with a 6 s TTFT a minute after its deadline, a batch job with a
    600 s TTLT after 30 minutes (QoServe saw relegated jobs finish up to ~3900 s late).

    A job that already streamed tokens (relegated while recomputing its KV after a preemption, or a rerun going on
    from an earlier attempt's) is mid-answer: its client holds part of the answer, which an expiry cuts short. It gets
    twice the grace, after the later of that deadline and its next token's (eq. 2): later than shed work, but not
    never, since under overload that never ends the spare budget it waits for never comes."""
    t = target_s(req)
    deadline, grace = req.arrival_time + t, max(factor * t, min_grace_s)
    if not req.first_token_out:
        return deadline + grace
    return max(deadline, first_deadline(req)) + 2 * grace
