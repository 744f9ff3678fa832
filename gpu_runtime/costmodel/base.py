"""The cost-model interface: batch features -> predicted batch latency (seconds).

Schedulers call ``predict`` on the hot path, so implementations keep it pure Python
and cheap; ``batch_time`` is the latency-vs-tokens curve the speculation policies use.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from gpu_runtime.costmodel.features import BatchFeatures

log = logging.getLogger(__name__)


@runtime_checkable
class CostModel(Protocol):
    name: str

    def predict(self, f: BatchFeatures) -> float:
        """Predicted wall time of one forward pass with these features (seconds)."""


def batch_time(model: CostModel, total_tokens: int, num_decodes: int = 0, decode_context: int = 512) -> float:
    """Batch time as a function of total tokens at a given decode count.

    ``num_decodes`` of the tokens are decodes attending ``decode_context`` tokens each;
    the rest are one prefill chunk (or tree tokens, which cost like chunk tokens)."""
    prefill = max(0, total_tokens - num_decodes)
    return model.predict(BatchFeatures.of_shape(prefill, 0, num_decodes, decode_context))


def decode_step_time(model: CostModel, batch_size: int = 1, context: int = 512) -> float:
    """Latency of a pure decode step (the profile's batch-1 figure scales the SLOs)."""
    return model.predict(BatchFeatures.of_shape(0, 0, batch_size, context))


def saturation_tokens(model: CostModel, max_tokens: int = 8192, fraction: float = 0.9, floor: int = 16) -> int:
    """Smallest prefill chunk whose throughput reaches ``fraction`` of the best seen (QoServe's 2500 on A100)."""
    sizes, n = [], floor
    while n <= max_tokens:
        sizes.append(n)
        n *= 2
    tput = [s / max(1e-9, model.predict(BatchFeatures.of_shape(s, 0, 0, 0))) for s in sizes]
    best = max(tput)
    for s, t in zip(sizes, tput, strict=True):
        if t >= fraction * best:
            return s
    return sizes[-1]
