"""Latency profiles (JSON): measured or synthetic batch shapes with their latency.

A profile is what ``coserve profile`` writes and what cost models are fitted from.
``load_cost_model`` fits the model chosen by held-out error; ``default_cost_model``
uses the shipped CPU profile, or a conservative analytic model when none is shipped.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from gpu_runtime.costmodel.base import CostModel, decode_step_time
from gpu_runtime.costmodel.features import BatchFeatures
from gpu_runtime.costmodel.linear import AdaSpecFit, PiecewiseLinearCostModel

log = logging.getLogger(__name__)

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
CPU_PROFILE = PROFILE_DIR / "cpu-smollm2-135m.json"
A100_PROFILE = PROFILE_DIR / "synthetic-a100-llama3-8b.json"


@dataclass
class Profile:
    name: str
    samples: list[tuple[BatchFeatures, float]]  # (features, seconds)
    synthetic: bool = False  # generated from a formula, not measured
    meta: dict = field(default_factory=dict)  # model, device, block size, kv blocks, notes

    def save(self, path: str | Path) -> None:
        rows = [dict(f.as_dict(), latency_s=t) for f, t in self.samples]
        Path(path).write_text(json.dumps({"name": self.name, "synthetic": self.synthetic, "meta": self.meta,
                                          "samples": rows}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        samples = [(BatchFeatures.from_dict(r), float(r["latency_s"])) for r in data["samples"]]
        return cls(data["name"], samples, bool(data.get("synthetic", False)), data.get("meta", {}))


@dataclass
class FitReport:
    chosen: str
    mape: dict[str, float]  # held-out mean absolute percentage error per candidate


def mape(model: CostModel, samples: list[tuple[BatchFeatures, float]]) -> float:
    errs = [abs(model.predict(f) - t) / t for f, t in samples]
    return float(np.mean(errs)) if errs else float("nan")


def fit_cost_model(profile: Profile, candidates: tuple[str, ...] = ("piecewise-linear", "random-forest"),
                   holdout: float = 0.25, seed: int = 0) -> tuple[CostModel, FitReport]:
    """Fit each candidate on 75% of the samples, keep the one with the lowest held-out MAPE, refit on all."""
    from gpu_runtime.costmodel.forest import RandomForestCostModel

    fitters = {"piecewise-linear": PiecewiseLinearCostModel.fit, "random-forest": RandomForestCostModel.fit}
    rows = list(profile.samples)
    random.Random(seed).shuffle(rows)
    cut = max(1, int(len(rows) * (1 - holdout)))
    train, test = rows[:cut], rows[cut:] or rows[:1]
    scores = {}
    for name in candidates:
        m = fitters[name]([f for f, _ in train], [t for _, t in train])
        scores[name] = mape(m, test)
    chosen = min(scores, key=scores.__getitem__)
    model = fitters[chosen]([f for f, _ in rows], [t for _, t in rows])
    log.info("cost model for %s: %s (held-out MAPE %s)", profile.name, chosen,
             {k: round(v, 4) for k, v in scores.items()})
    return model, FitReport(chosen, scores)


def adaspec_fit(profile: Profile) -> AdaSpecFit:
    """AdaSpec's T = alpha*N_c + gamma*N_b + delta from a profile."""
    return AdaSpecFit.fit([f for f, _ in profile.samples], [t for _, t in profile.samples])


@lru_cache(maxsize=8)
def _load_cached(path: str, mtime: float, candidates: tuple[str, ...]) -> CostModel:
    return fit_cost_model(Profile.load(path), candidates)[0]


def load_cost_model(path: str | Path, candidates: tuple[str, ...] = ("piecewise-linear", "random-forest")) -> CostModel:
    p = Path(path)
    if not p.exists() and (PROFILE_DIR / p.name).exists():
        p = PROFILE_DIR / p.name
    if not p.exists() and (PROFILE_DIR / f"{p.name}.json").exists():
        p = PROFILE_DIR / f"{p.name}.json"
    return _load_cached(str(p), p.stat().st_mtime, tuple(candidates))


def conservative_cost_model() -> PiecewiseLinearCostModel:
    """A pessimistic CPU-like model (40 ms base, 0.8 ms/token) for when no profile exists."""
    return PiecewiseLinearCostModel([0.04, 2e-4, 8e-4, 0.0, 2e-7, 1e-8], 0.0, name="conservative-default")


def default_cost_model() -> CostModel:
    """The shipped CPU profile (piecewise-linear: cheap to evaluate), else the conservative model."""
    if CPU_PROFILE.exists():
        try:
            return load_cost_model(CPU_PROFILE, ("piecewise-linear",))
        except (OSError, ValueError, KeyError) as exc:
            log.warning("cannot load %s (%s); using the conservative default", CPU_PROFILE, exc)
    return conservative_cost_model()


def slo_scale(model: CostModel, reference_step_s: float = 0.0125) -> float:
    """Batch-1 decode step of ``model`` over the paper's 12.5 ms (8B on A100): the SLO multiplier."""
    return decode_step_time(model, 1, 512) / reference_step_s
