"""Goodput by capacity search: the highest QPS whose violation rate stays within a target."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def capacity_search(violation_at: Callable[[float], float], lo: float, hi: float, target: float = 0.01,
                    iters: int = 6) -> float:
    """Binary search on QPS (violation rate grows with load). Returns the best QPS found
    with violations <= ``target`` (``lo`` is assumed feasible; 0.0 if it is not)."""
    if violation_at(lo) > target:
        return 0.0
    if violation_at(hi) <= target:
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        if violation_at(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo
