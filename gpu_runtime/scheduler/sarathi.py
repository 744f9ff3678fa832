"""Sarathi-Serve baselines: a fixed token budget per iteration (decodes first, prefill chunks in
the rest), prompts ordered FCFS, EDF or SRPF."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gpu_runtime.scheduler.base import BaseScheduler, KVBudget
from gpu_runtime.scheduler.config import SarathiConfig
from gpu_runtime.scheduler.interface import SchedulerOutput
from gpu_runtime.scheduler.priority import remaining_work
from gpu_runtime.scheduler.request_queue import RequestQueue, create_queue

if TYPE_CHECKING:
    from gpu_runtime.costmodel.base import CostModel
    from gpu_runtime.executor.base import Executor

log = logging.getLogger(__name__)

_QUEUE_OF_ORDER = {"fcfs": "fcfs", "edf": "deadline", "srpf": "priority"}


class SarathiScheduler(BaseScheduler):
    def __init__(self, config: SarathiConfig | None = None, cost_model: CostModel | None = None,
                 executor: Executor | None = None) -> None:
        config = config or SarathiConfig()
        if config.order not in _QUEUE_OF_ORDER:
            raise ValueError(f"unknown Sarathi order {config.order!r}")
        self.config: SarathiConfig = config
        super().__init__(config, cost_model, executor)

    def _make_queue(self) -> RequestQueue:
        return create_queue(_QUEUE_OF_ORDER[self.config.order], remaining_work)

    def _fill(self, out: SchedulerOutput, now: float, kv: KVBudget) -> None:
        # Sarathi-Serve's chunk size is a token budget: each decode takes one token of it first, and the
        # prefill chunks get what is left (so a batch of chunk_size decodes admits no prefill); drafts count too.
        out.prefill_budget = max(0, self.config.chunk_size - len(out.decodes) - self.step_drafts)
        self._take_in_order(out.prefill_budget, kv, out)
