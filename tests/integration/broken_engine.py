"""Engine factory for a worker whose device is lost: the usual engine, every step that runs the model raises.

Used as ``COSERVE_ENGINE_FACTORY=tests.integration.broken_engine:build``.
"""

from __future__ import annotations

from typing import Any

from gpu_runtime.factory import build_engine


def build(model: str, **kwargs: Any) -> Any:
    engine = build_engine(model, **kwargs)

    def lost_device(plan):
        raise RuntimeError("device lost")

    engine.executor.step = lost_device
    return engine
