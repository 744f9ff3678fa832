"""Random-forest latency model (QoServe 3.6.1's predictor), scikit-learn under the hood.

Predicting one row through scikit-learn costs ~10 ms, too slow for a scheduler's inner
loop, so predictions are memoised on the (rounded) features.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpu_runtime.costmodel.features import FEATURE_NAMES, BatchFeatures

log = logging.getLogger(__name__)


def _vector(f: BatchFeatures) -> list[float]:
    return [float(getattr(f, n)) for n in FEATURE_NAMES]


@dataclass
class RandomForestCostModel:
    forest: Any
    name: str = "random-forest"
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def fit(cls, feats: list[BatchFeatures], latency: list[float], n_estimators: int = 60,
            seed: int = 0) -> RandomForestCostModel:
        from sklearn.ensemble import RandomForestRegressor

        forest = RandomForestRegressor(n_estimators=n_estimators, min_samples_leaf=2, random_state=seed, n_jobs=1)
        forest.fit(np.asarray([_vector(f) for f in feats]), np.log(np.asarray(latency)))
        return cls(forest)

    def predict(self, f: BatchFeatures) -> float:
        key = tuple(round(v, -1) for v in _vector(f))
        hit = self._cache.get(key)
        if hit is None:
            hit = float(np.exp(self.forest.predict(np.asarray([_vector(f)]))[0]))
            if len(self._cache) > 100_000:
                self._cache.clear()
            self._cache[key] = hit
        return hit

    def predict_many(self, feats: list[BatchFeatures]) -> np.ndarray:
        return np.exp(self.forest.predict(np.asarray([_vector(f) for f in feats])))
