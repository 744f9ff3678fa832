"""vLLM (v0 default) baseline: no chunking; waiting prompts run whole, in prefill-only
iterations that pause the decodes (prefill-prioritizing), FCFS."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gpu_runtime.scheduler.base import BaseScheduler, KVBudget
from gpu_runtime.scheduler.config import VLLMConfig
from gpu_runtime.scheduler.interface import SchedulerOutput
from gpu_runtime.scheduler.request_queue import FCFSQueue, RequestQueue

if TYPE_CHECKING:
    from gpu_runtime.costmodel.base import CostModel
    from gpu_runtime.executor.base import Executor

log = logging.getLogger(__name__)


class VLLMScheduler(BaseScheduler):
    def __init__(self, config: VLLMConfig | None = None, cost_model: CostModel | None = None,
                 executor: Executor | None = None) -> None:
        config = config or VLLMConfig()
        self.config: VLLMConfig = config
        super().__init__(config, cost_model, executor)

    def _make_queue(self) -> RequestQueue:
        return FCFSQueue()

    def _fill(self, out: SchedulerOutput, now: float, kv: KVBudget) -> None:
        left = out.prefill_budget = self.config.max_num_batched_tokens
        while len(self.waiting):
            req = self.waiting.peek()
            assert req is not None
            if out.prefills and req.prefill_remaining > left:
                break  # whole prompts only
            self._pop_waiting()
            n = self._take_chunk(req, req.prefill_remaining, kv, out)
            if n == 0:  # a prompt that does not fit whole waits (KV or admission)
                self._push_waiting(req)
                break
            left -= n
        if out.prefills:
            out.decodes = []  # prefill-prioritizing: decodes wait for the prompts
