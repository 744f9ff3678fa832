"""Step-latency models the speculation policies reason with.

``LinearStepCost`` is AdaSpec's time model T = alpha*N_c + gamma*N_b + delta (section
4.1), fitted online by least squares from observed passes (or seeded from the cost
model's profile). A co-serving pass also carries prompt chunks, whose tokens cost less each
than decode and draft tokens (a chunk runs as large matrix products, and its tokens attend to
their prompt's prefix rather than to a whole context): they get their own price, gamma_p * N_p.
Lumped into N_b, the chunks pulled the fitted price of a draft token down (vLLM on CPU, batch 16,
chat prompts: 0.79 ms a token, against 1.49 ms with the chunks apart), and AdaSpec verified chains
that cost more than they gained (0.85-0.90x no speculation at batch 8-32).

``knee_budget`` turns a latency-vs-tokens curve into AdaServe's verification budget B: the
largest batch whose latency stays within a tolerance of the one-token pass (the roofline knee,
preprint section 5; DESIGN.md: from the profile).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

log = logging.getLogger(__name__)


@dataclass
class LinearStepCost:
    """T(N_c, N_b, N_p) = alpha*N_c + gamma*N_b + gamma_p*N_p + delta (AdaSpec eq. 1, with a pass's prompt
    tokens N_p priced apart), fitted online."""

    alpha: float = 0.0  # seconds per context token attended
    gamma: float = 0.0  # seconds per decode or draft token in the batch
    delta: float = 0.0  # fixed cost of a pass
    gamma_prompt: float | None = None  # seconds per prompt token; None (no pass with one observed yet): gamma
    window: int = 256  # observations kept for the fit
    min_samples: int = 8
    _obs: deque = field(default_factory=deque, repr=False)

    def predict(self, num_context: float, num_batch: float, num_prompt: float = 0.0) -> float:
        per_prompt_token = self.gamma if self.gamma_prompt is None else self.gamma_prompt
        return max(0.0, self.alpha * num_context + self.gamma * num_batch + per_prompt_token * num_prompt + self.delta)

    @property
    def fitted(self) -> bool:
        return len(self._obs) >= self.min_samples or self.gamma > 0 or self.delta > 0

    def observe(self, num_context: float, num_batch: float, latency_s: float, num_prompt: float = 0.0) -> None:
        self._obs.append((float(num_context), float(num_batch), float(num_prompt), float(latency_s)))
        while len(self._obs) > self.window:
            self._obs.popleft()
        if len(self._obs) >= self.min_samples:
            self._fit()

    def _fit(self) -> None:
        data = np.asarray(self._obs)
        ones = np.ones(len(data))
        if not data[:, 2].any():  # no prompt tokens in the window: nothing to price them by
            self.alpha, self.gamma, self.delta = nonnegative_fit(np.column_stack([data[:, 0], data[:, 1], ones]),
                                                                 data[:, 3])
            self.gamma_prompt = None
            return
        self.alpha, self.gamma, self.gamma_prompt, self.delta = nonnegative_fit(
            np.column_stack([data[:, 0], data[:, 1], data[:, 2], ones]), data[:, 3])

    @classmethod
    def from_points(cls, points: list[tuple[float, float, float]]) -> LinearStepCost:
        """Fit from profile rows (N_c, N_b, seconds)."""
        model = cls(min_samples=min(8, max(3, len(points))))
        for row in points:
            model.observe(*row)
        return model


def nonnegative_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, ...]:
    """Least squares with every coefficient >= 0 (time never shrinks with work): scipy's NNLS.

    Clipping the negative coefficients of one unconstrained fit instead leaves the others
    compensating for them: with one request the context barely varies and N_b is constant,
    so a fit of alpha = -37 us/token and delta = +29 ms clipped to alpha = 0 predicted a
    0.05 ms prompt-lookup step at 59 ms."""
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # conditioning: contexts ~1e3, counts ~1
    coef, _residual = nnls(x / scale, y)
    return tuple(float(c) for c in coef / scale)


def knee_budget(latency: Callable[[int], float], max_tokens: int = 1024, tolerance: float = 0.25,
                min_tokens: int = 1) -> int:
    """Largest token count n <= max_tokens with latency(n) <= (1+tolerance) * latency(min_tokens).

    Below the knee a pass is bound by reading the weights, so extra verified tokens are
    almost free; past it latency grows linearly with tokens (roofline).
    """
    base = latency(min_tokens)
    best = min_tokens
    n = min_tokens
    while n <= max_tokens:
        if latency(n) <= (1.0 + tolerance) * base:
            best = n
        else:
            break
        n = n + 1 if n < 16 else int(n * 1.125) + 1
    if best < max_tokens and n > max_tokens and latency(max_tokens) <= (1.0 + tolerance) * base:
        best = max_tokens
    return best


class Ema:
    """Exponential moving average with a prior used until the first sample."""

    def __init__(self, prior: float, weight: float = 0.2) -> None:
        self.value = prior
        self.weight = weight
        self.count = 0

    def update(self, x: float) -> float:
        self.value = x if self.count == 0 else (1 - self.weight) * self.value + self.weight * x
        self.count += 1
        return self.value


def slack_tokens(curve: Callable[[int], float], num_requests: int, prefill_tokens: int, spare_s: float,
                 ceiling: int) -> int:
    """Most tokens of a pass's decodes and trees (roots included, <= ceiling) whose time beyond the
    pass without trees fits the scheduler's spare time ``spare_s``."""
    base = curve(prefill_tokens + num_requests)
    lo, hi = num_requests, max(num_requests, ceiling)  # the curve grows with tokens: bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if curve(prefill_tokens + mid) - base <= spare_s:
            lo = mid
        else:
            hi = mid - 1
    return lo
