"""Goodput by capacity search: the highest QPS whose violation rate stays within a target; and
the default QPS sweep of ``coserve simulate``, a bracket around that capacity."""

from __future__ import annotations

import bisect
import heapq
import logging
import math
from collections.abc import Callable, Iterable

from gpu_runtime.costmodel.base import CostModel, decode_step_time, saturation_tokens
from gpu_runtime.costmodel.features import BatchFeatures

log = logging.getLogger(__name__)


def capacity_search(violation_at: Callable[[float], float], lo: float, hi: float, target: float = 0.01,
                    iters: int = 6, shrink: float = 3.0, max_shrinks: int = 4) -> float:
    """Binary search on QPS (violation rate grows with load). Returns the best QPS found with
    violations <= ``target``. If ``lo`` already violates, the bracket moves down by ``shrink`` up
    to ``max_shrinks`` times (a slow profile's capacity can lie far below a guessed range); 0.0
    when even the lowest rate tried violates."""
    while violation_at(lo) > target:
        if max_shrinks <= 0:
            return 0.0
        hi, lo, max_shrinks = lo, lo / shrink, max_shrinks - 1
        log.debug("capacity search: moving down to %.4g QPS", lo)
    if violation_at(hi) <= target:
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        if violation_at(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def backlog_growth(jobs: Iterable[tuple[float, float | None]]) -> float:
    """How much the jobs in the system grew over the second half of the arrivals, per job that arrived in it.

    ``jobs``: (arrival, finish or None) pairs; a job leaves the system when it finishes, however it ended
    (an expired job was shed). A replica that keeps up ends the span with about as many jobs in it as it
    had at its middle (0 here, give or take the queue's own noise); one behind its arrivals grows by
    1 - service rate / arrival rate. A run with deadlines far longer than its backlog (QoServe's 30-minute
    batch tier) can end with a growing queue and few violations: its rate is not sustainable however few
    jobs were late yet."""
    jobs = list(jobs)
    if len(jobs) < 2:
        return 0.0
    arrivals = sorted(a for a, _ in jobs)
    finishes = sorted(f for _, f in jobs if f is not None)
    mid, end = (arrivals[0] + arrivals[-1]) / 2, arrivals[-1]

    def in_system(t: float) -> int:
        return bisect.bisect_right(arrivals, t) - bisect.bisect_right(finishes, t)

    arrived = bisect.bisect_right(arrivals, end) - bisect.bisect_right(arrivals, mid)
    return (in_system(end) - in_system(mid)) / max(1, arrived)


def keeps_up(jobs: Iterable[tuple[float, float | None]], tolerance: float = 0.02) -> bool:
    """The backlog did not grow (``backlog_growth``) by more than ``tolerance`` of the arrivals, or by more
    than two standard deviations of their Poisson count (short runs: ~10% for 360 arrivals)."""
    jobs = list(jobs)
    return backlog_growth(jobs) <= max(tolerance, 2.0 / math.sqrt(max(1, len(jobs) / 2)))


def sustained_violation_rate(violation_rate: float, jobs: Iterable[tuple[float, float | None]]) -> float:
    """What a capacity search should see of a run: its violation rate if the replica kept up with the
    arrivals (``keeps_up``), else 1.0 (the rate is past capacity even if its deadlines hid it)."""
    return violation_rate if keeps_up(jobs) else 1.0


def throughput_guess(cost_model: CostModel, mean_prompt: float, mean_output: float, decode_batch: int = 32) -> float:
    """A first guess at capacity from the cost model alone: the QPS that keeps one replica busy
    all the time if it prefills in saturating chunks and decodes ``decode_batch`` requests per
    step. SLOs and queueing move the real knee away from it (either way), so it only seeds
    ``find_capacity``."""
    chunk = saturation_tokens(cost_model)
    prefill_per_token = cost_model.predict(BatchFeatures.of_shape(chunk)) / chunk
    context = int(mean_prompt + mean_output / 2)
    decode_per_token = decode_step_time(cost_model, decode_batch, context) / decode_batch
    return 1.0 / max(1e-9, mean_prompt * prefill_per_token + mean_output * decode_per_token)


def find_capacity(violation_at: Callable[[float], float], guess: float, target: float = 0.01, grow: float = 3.0,
                  max_steps: int = 4, iters: int = 4) -> float:
    """``capacity_search`` without a range: from ``guess``, step by ``grow`` up (or down) until the
    violation rate crosses ``target``, then bisect that step ``iters`` times. Each rate is run
    once. Returns the highest rate tried when even ``guess * grow**max_steps`` stays within target,
    and 0.0 when even ``guess / grow**max_steps`` violates."""
    seen: dict[float, float] = {}

    def viol(qps: float) -> float:
        if qps not in seen:
            seen[qps] = violation_at(qps)
        return seen[qps]

    if viol(guess) > target:
        return capacity_search(viol, guess / grow, guess, target, iters, grow, max_steps - 1)
    lo = guess
    for _ in range(max_steps):
        hi = lo * grow
        if viol(hi) > target:
            return capacity_search(viol, lo, hi, target, iters)
        lo = hi
    return lo


def sweep_around(capacity: float, points: int = 8, first: float = 0.25) -> list[float]:
    """``points`` evenly spaced rates starting near ``first`` x ``capacity`` (0.25x to 2x with the
    defaults), so a violation curve shows flat ground, the knee and the rise after it. The step
    is a round number (1, 2, 2.5 or 5 x 10^k) so the rates read well in a table."""
    if capacity <= 0:
        raise ValueError("capacity must be > 0")
    step = _round_step(capacity * first)
    return [float(f"{step * k:.6g}") for k in range(1, points + 1)]


def _round_step(x: float) -> float:
    """The 1-2-2.5-5 x 10^k number nearest ``x`` on a log scale."""
    exp = math.floor(math.log10(x))
    candidates = [m * 10.0 ** e for e in (exp, exp + 1) for m in (1.0, 2.0, 2.5, 5.0)]
    return min(candidates, key=lambda c: abs(math.log(c / x)))


def late_floor(jobs: list[tuple[float, float]], goodput: float) -> float:
    """Share of ``jobs`` (arrival, first deadline) late even for a fluid server that serves each in
    1/``goodput`` seconds, earliest deadline first, and drops a job the moment it cannot make its
    deadline: the lateness capacity forces on this run, drain included (every job priced as the
    average one)."""
    jobs = sorted(jobs)
    if not jobs:
        return 0.0
    work = 1.0 / goodput
    pending: list[float] = []  # deadlines of arrived jobs not yet served
    t, i, on_time = 0.0, 0, 0
    while i < len(jobs) or pending:
        if not pending:
            t = max(t, jobs[i][0])
        while i < len(jobs) and jobs[i][0] <= t:
            heapq.heappush(pending, jobs[i][1])
            i += 1
        due = heapq.heappop(pending)
        if t + work <= due:
            t += work
            on_time += 1
    return 1.0 - on_time / len(jobs)
