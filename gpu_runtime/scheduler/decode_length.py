"""Per-application decode-length history: predicted output length = running mean + 2 std.

QoServe 3.6 keeps "a running history of token generation patterns per application" to
estimate a batch job's remaining work (eq. 5); DESIGN.md fixes the estimate at mean + 2
std. Welford's update keeps it O(1) per finished request.

A job that outlives its prediction has not got zero tokens left: ``predict_beyond``
re-estimates from the app's recent lengths longer than what it has generated (mean + 2 std
of those), or doubles its length when too few are known. Without it such a job's decode
slack looks infinite and it decodes at the pace of full prefill chunks past its deadline.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class RunningStats:
    n: int = 0
    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations (Welford)

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else 0.0


@dataclass
class DecodeLengthHistory:
    min_samples: int = 3  # below this the request's max_tokens is the estimate
    recent_size: int = 2048  # finished lengths kept per app for re-estimates past the prediction
    stats: dict[str, RunningStats] = field(default_factory=dict)
    recent: dict[str, deque[int]] = field(default_factory=dict)

    def record(self, app_id: str | None, num_output_tokens: int) -> None:
        key = app_id or ""
        self.stats.setdefault(key, RunningStats()).add(float(num_output_tokens))
        self.recent.setdefault(key, deque(maxlen=self.recent_size)).append(num_output_tokens)

    def predict_beyond(self, app_id: str | None, generated: int, max_tokens: int) -> int:
        """Predicted total length of a job that has already generated ``generated`` tokens, at least
        its prediction: mean + 2 std of the app's recent lengths above it, else twice ``generated``."""
        longer = [x for x in self.recent.get(app_id or "", ()) if x > generated]
        if len(longer) >= self.min_samples:
            s = RunningStats()
            for x in longer:
                s.add(float(x))
            guess = math.ceil(s.mean + 2 * s.std)
        else:
            guess = 2 * generated
        return max(generated + 1, min(max_tokens, guess)) if generated < max_tokens else max_tokens

    def mean(self, app_id: str | None) -> float | None:
        """The app's mean finished decode length (None below ``min_samples``)."""
        s = self.stats.get(app_id or "")
        return s.mean if s is not None and s.n >= self.min_samples else None

    def predict_rest(self, app_id: str | None, delivered: int, max_tokens: int) -> int:
        """Predicted outputs of an attempt that goes on after ``delivered`` tokens of the answer (a rerun), at most
        ``max_tokens`` (what is left of the job's): the prediction for an answer that long, less those tokens."""
        if not delivered:
            return self.predict(app_id, max_tokens)
        return self.predict_beyond(app_id, delivered, delivered + max_tokens) - delivered

    def predict(self, app_id: str | None, max_tokens: int) -> int:
        """Mean + 2 std of the app's finished decode lengths, capped at ``max_tokens``."""
        s = self.stats.get(app_id or "")
        if s is None or s.n < self.min_samples:
            return max_tokens
        return max(1, min(max_tokens, math.ceil(s.mean + 2 * s.std)))
