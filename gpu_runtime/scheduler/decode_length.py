"""Per-application decode-length history: predicted output length = running mean + 2 std.

QoServe 3.6 keeps "a running history of token generation patterns per application" to
estimate a batch job's remaining work (eq. 5); DESIGN.md fixes the estimate at mean + 2
std. Welford's update keeps it O(1) per finished request.
"""

from __future__ import annotations

import logging
import math
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
    stats: dict[str, RunningStats] = field(default_factory=dict)

    def record(self, app_id: str | None, num_output_tokens: int) -> None:
        self.stats.setdefault(app_id or "", RunningStats()).add(float(num_output_tokens))

    def predict(self, app_id: str | None, max_tokens: int) -> int:
        """Mean + 2 std of the app's finished decode lengths, capped at ``max_tokens``."""
        s = self.stats.get(app_id or "")
        if s is None or s.n < self.min_samples:
            return max_tokens
        return max(1, min(max_tokens, math.ceil(s.mean + 2 * s.std)))
