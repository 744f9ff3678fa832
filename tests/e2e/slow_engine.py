"""Engine factory for overload tests: the usual engine, each step slowed down.

Used as ``COSERVE_ENGINE_FACTORY=tests.e2e.slow_engine:build`` (``COSERVE_STEP_DELAY_S``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from gpu_runtime.factory import build_engine


def build(model: str, **kwargs: Any) -> Any:
    engine = build_engine(model, **kwargs)
    delay = float(os.environ.get("COSERVE_STEP_DELAY_S", "0.05"))
    step = engine.executor.step

    def slow_step(plan):
        time.sleep(delay)
        return step(plan)

    engine.executor.step = slow_step
    return engine
