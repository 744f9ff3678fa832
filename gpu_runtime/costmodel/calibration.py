"""A profile's cost model, scaled to what the engine's steps take where it serves.

A grid profile times steps in a quiet process. Inside the serving stack the same steps take
longer: on a 2-core machine the API, Celery, Redis and the client share the cores with the engine,
and its steps took 1.8x (4 QPS) to 2.2x (10 QPS) the grid's prediction (docs/BENCHMARKS.md, stop
24). A policy that plans with the quiet figures sizes chunks that overrun the decodes' slack.

``ScaledCostModel`` multiplies the profile's prediction by one factor, and ``InPlaceCalibration``
keeps that factor at the median ratio of measured to predicted cost over the engine's recent busy
steps (each step's latency plus the host time before the next). The profile keeps the shape (how
cost grows with chunk, decodes and context); the engine measures the level. The median over a
window, refreshed every few steps, moves with the load and ignores single outliers.
"""

from __future__ import annotations

import statistics
from collections import deque

from gpu_runtime.costmodel.base import CostModel
from gpu_runtime.costmodel.features import BatchFeatures


class ScaledCostModel:
    """``base``'s predictions times ``scale`` (the CostModel protocol)."""

    def __init__(self, base: CostModel, scale: float = 1.0) -> None:
        self.base = base
        self.scale = scale
        self.name = base.name

    def predict(self, f: BatchFeatures) -> float:
        return self.scale * self.base.predict(f)


class InPlaceCalibration:
    """Feeds a ``ScaledCostModel`` the engine's measured step costs."""

    def __init__(self, model: ScaledCostModel, window: int = 256, min_steps: int = 32, every: int = 32,
                 bounds: tuple[float, float] = (0.2, 10.0)) -> None:
        self.model = model
        self.ratios: deque[float] = deque(maxlen=window)  # measured / the profile's prediction, recent steps
        self.min_steps = min_steps  # steps measured before the scale moves from 1
        self.every = every  # steps between updates of the scale
        self.bounds = bounds  # the scale stays within these (a stalled step must not wreck planning)
        self.steps = 0

    def observe(self, features: BatchFeatures, seconds: float) -> bool:
        """One busy step: its features and what it cost in place (latency plus the host gap to the next).
        True when the scale moved by more than 10%."""
        predicted = self.model.base.predict(features) if seconds > 0 and features.total_tokens else 0.0
        if predicted <= 0:
            return False
        self.ratios.append(seconds / predicted)
        self.steps += 1
        if self.steps < self.min_steps or self.steps % self.every:
            return False
        lo, hi = self.bounds
        before, self.model.scale = self.model.scale, min(hi, max(lo, statistics.median(self.ratios)))
        return abs(self.model.scale - before) > 0.1 * before

    def state(self) -> dict[str, float]:
        return {"scale": round(self.model.scale, 3), "steps": self.steps}
