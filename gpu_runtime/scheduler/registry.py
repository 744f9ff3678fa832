"""Scheduling policies by configuration name (``qoserve``, ``sarathi-fcfs``, ...)."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from gpu_runtime.scheduler.config import QoServeConfig, SarathiConfig, VLLMConfig, VLLMV1Config
from gpu_runtime.scheduler.interface import Scheduler
from gpu_runtime.scheduler.qoserve import QoServeScheduler
from gpu_runtime.scheduler.sarathi import SarathiScheduler
from gpu_runtime.scheduler.vllm import VLLMScheduler, VLLMV1Scheduler

if TYPE_CHECKING:
    from gpu_runtime.costmodel.base import CostModel
    from gpu_runtime.executor.base import Executor

log = logging.getLogger(__name__)

# name -> (scheduler class, config class, config overrides that define the variant)
REGISTRY: dict[str, tuple[type, type, dict[str, Any]]] = {
    "qoserve": (QoServeScheduler, QoServeConfig, {}),
    "sarathi-fcfs": (SarathiScheduler, SarathiConfig, {"order": "fcfs"}),
    "sarathi-edf": (SarathiScheduler, SarathiConfig, {"order": "edf"}),
    "sarathi-srpf": (SarathiScheduler, SarathiConfig, {"order": "srpf"}),
    "vllm-fcfs": (VLLMScheduler, VLLMConfig, {}),  # v0: whole prompts, prefill-prioritizing
    "vllm-v1-fcfs": (VLLMV1Scheduler, VLLMV1Config, {"order": "fcfs"}),  # what the vLLM backend's vllm-fcfs runs
    "vllm-v1-priority": (VLLMV1Scheduler, VLLMV1Config, {"order": "priority"}),  # ... and its vllm-priority
}


def available() -> list[str]:
    return sorted(REGISTRY)


def config_fields(name: str) -> set[str]:
    """Names of the config fields policy ``name`` takes."""
    try:
        return {f.name for f in dataclasses.fields(REGISTRY[name][1])}
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; choose from {', '.join(available())}") from None


def create_scheduler(name: str, cost_model: CostModel | None = None, executor: Executor | None = None,
                     **config: Any) -> Scheduler:
    """Build the policy ``name``; ``config`` sets fields of its config dataclass (unknown keys are errors)."""
    try:
        cls, cfg_cls, variant = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; choose from {', '.join(available())}") from None
    known = {f.name for f in dataclasses.fields(cfg_cls)}
    bad = set(config) - known
    if bad:
        raise ValueError(f"{name}: unknown config keys {sorted(bad)}")
    cfg = cfg_cls(**{**variant, **config})
    return cls(cfg, cost_model=cost_model, executor=executor)
