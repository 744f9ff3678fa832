"""One place that builds an ``Engine`` for a model: executor, scheduler, speculation, detokenizer.

Used by the GPU worker, the CLI and benchmarks so that they all run the same stack.
"""

from __future__ import annotations

import inspect
import logging
import re
from typing import TYPE_CHECKING, Any

from gpu_runtime.detokenizer import Detokenizer
from gpu_runtime.devices import DEVICE_CHOICES, DEVICE_PATTERN
from gpu_runtime.engine import Engine

if TYPE_CHECKING:
    from gpu_runtime.costmodel.base import CostModel
    from gpu_runtime.executor.base import Executor

log = logging.getLogger(__name__)


def _call_with_known(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Calls ``fn`` with the keyword arguments its signature accepts (registries differ in what they need)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def resolve_device(device: str) -> str:
    """``device`` as the engine takes it: 'auto' becomes 'cuda' where torch sees a GPU, else 'cpu'."""
    # anything else used to pass through, and an unknown name such as 'tpu' ran on the CPU without a word
    if not re.fullmatch(DEVICE_PATTERN, device):
        raise ValueError(f"unknown device {device!r}; use {DEVICE_CHOICES}")
    if device != "auto":
        return device
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def load_profile_for(device: str, cost_profile: str | None) -> CostModel | None:
    """The measured cost model the engine schedules with: ``cost_profile`` (a path or shipped
    name), or with "auto" the shipped profile of the default model on the CPU. None when
    there is none ("none", or "auto" on a GPU): the caller falls back to the conservative
    model, and a warning says to run ``coserve profile``."""
    from gpu_runtime.costmodel.profile import CPU_PROFILE, SCHEDULING_MODEL, fit_report, scheduling_cost_model

    if cost_profile in (None, "", "none"):
        return None
    if cost_profile == "auto":
        if device != "cpu" or not CPU_PROFILE.exists():
            log.warning("no measured profile for %s: scheduling with a conservative cost model; run "
                        "`coserve profile --device %s` and set COSERVE_COST_PROFILE", device, device)
            return None
        cost_profile = str(CPU_PROFILE)
    # Piecewise-linear: ~1 us per prediction and sane outside the profiled grid (costmodel.profile).
    log.info("cost model from profile %s: %s; %s", cost_profile, SCHEDULING_MODEL, fit_report(cost_profile).summary())
    return scheduling_cost_model(cost_profile)


def build_engine(model: str, device: str = "auto", scheduler_policy: str = "qoserve", spec_policy: str = "none",
                 kv_blocks: int | None = None, draft: str | None = None, tokenizer: Any = None,
                 cost_profile: str | None = "auto", kv_reserve: str = "predicted",
                 scheduler_config: dict[str, Any] | None = None) -> Engine:
    """A ready engine for ``model`` (bundled name or checkpoint directory) on ``device``; ``scheduler_config``
    overrides fields of the policy's config (unknown ones are errors)."""
    from gpu_runtime.executor.torch import TorchExecutor
    from gpu_runtime.scheduler.registry import create_scheduler
    from gpu_runtime.speculation.registry import create_policy

    device = resolve_device(device)
    executor: Executor = _call_with_known(TorchExecutor.from_pretrained, model, device=device, kv_blocks=kv_blocks,
                                          draft=draft)
    cost_model = load_profile_for(device, cost_profile)
    if cost_model is not None:
        executor.cost_model = cost_model  # the executor's own latency profile: speculation budgets read it
    else:
        from gpu_runtime.costmodel.profile import conservative_cost_model

        cost_model = conservative_cost_model()
    scheduler = create_scheduler(scheduler_policy, cost_model=cost_model, executor=executor,
                                 **{"kv_reserve": kv_reserve, **(scheduler_config or {})})
    speculation = _call_with_known(create_policy, spec_policy, executor=executor)
    tok = tokenizer if tokenizer is not None else getattr(executor, "tokenizer", None)
    log.info("engine: model=%s device=%s scheduler=%s speculation=%s kv_blocks=%s cost model=%s", model, device,
             scheduler_policy, spec_policy, kv_blocks, getattr(cost_model, "name", "conservative default"))
    return Engine(executor, scheduler, speculation, Detokenizer(tok) if tok is not None else None)
