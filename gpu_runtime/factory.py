"""One place that builds an ``Engine`` for a model: executor, scheduler, speculation, detokenizer.

Used by the GPU worker, the CLI and benchmarks so that they all run the same stack.
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any

from gpu_runtime.detokenizer import Detokenizer
from gpu_runtime.engine import Engine

if TYPE_CHECKING:
    from gpu_runtime.executor.base import Executor

log = logging.getLogger(__name__)


def _call_with_known(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Calls ``fn`` with the keyword arguments its signature accepts (registries differ in what they need)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def build_engine(model: str, device: str = "auto", scheduler_policy: str = "qoserve", spec_policy: str = "none",
                 kv_blocks: int | None = None, draft: str | None = None, tokenizer: Any = None) -> Engine:
    """A ready engine for ``model`` (bundled name or checkpoint directory) on ``device``."""
    from gpu_runtime.executor.torch import TorchExecutor
    from gpu_runtime.scheduler.registry import create_scheduler
    from gpu_runtime.speculation.registry import create_policy

    device = resolve_device(device)
    executor: Executor = _call_with_known(TorchExecutor.from_pretrained, model, device=device, kv_blocks=kv_blocks,
                                          draft=draft)
    scheduler = _call_with_known(create_scheduler, scheduler_policy, executor=executor)
    speculation = _call_with_known(create_policy, spec_policy, executor=executor)
    tok = tokenizer if tokenizer is not None else getattr(executor, "tokenizer", None)
    log.info("engine: model=%s device=%s scheduler=%s speculation=%s kv_blocks=%s", model, device,
             scheduler_policy, spec_policy, kv_blocks)
    return Engine(executor, scheduler, speculation, Detokenizer(tok) if tok is not None else None)
