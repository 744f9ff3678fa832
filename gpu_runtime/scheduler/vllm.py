"""vLLM's schedulers as baselines in coserve's engine and simulator.

``VLLMScheduler`` is vLLM v0's default: no chunking; waiting prompts run whole, in prefill-only
iterations that pause the decodes (prefill-prioritizing), FCFS. ``VLLMV1Scheduler`` is the v1
scheduler the vLLM backend runs untouched (``vllm-fcfs`` / ``vllm-priority`` there): one token
budget per step, running requests first (each decode one token and its drafts, a started prompt its next chunk),
then waiting prompts chunked into what is left, FCFS or by vLLM's priority; the simulator replays
engine runs of vLLM's own policies with it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gpu_runtime.scheduler.base import BaseScheduler, KVBudget
from gpu_runtime.scheduler.config import VLLMConfig, VLLMV1Config
from gpu_runtime.scheduler.interface import SchedulerOutput
from gpu_runtime.scheduler.priority import vllm_priority
from gpu_runtime.scheduler.request_queue import FCFSQueue, PriorityQueue, RequestQueue

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


class VLLMV1Scheduler(BaseScheduler):
    def __init__(self, config: VLLMV1Config | None = None, cost_model: CostModel | None = None,
                 executor: Executor | None = None) -> None:
        config = config or VLLMV1Config()
        if config.order not in ("fcfs", "priority"):
            raise ValueError(f"unknown vLLM scheduling order {config.order!r} (fcfs, priority)")
        self.config: VLLMV1Config = config
        super().__init__(config, cost_model, executor)

    def _make_queue(self) -> RequestQueue:
        if self.config.order == "fcfs":
            return FCFSQueue()
        return PriorityQueue(lambda r: (vllm_priority(r), r.arrival_time))  # type: ignore[arg-type,return-value]

    def _fill(self, out: SchedulerOutput, now: float, kv: KVBudget) -> None:
        # vLLM gives each decode 1 + its draft tokens of the step's budget (its scheduler counts the spec tokens)
        left = out.prefill_budget = max(0, self.config.max_num_batched_tokens - len(out.decodes) - self.step_drafts)
        # vLLM's running list holds the prompts it already started: they continue before any waiting one
        for req in self.waiting.in_order(self.started):
            if left <= 0:
                return
            self._remove_waiting(req.request_id)
            n = self._take_chunk(req, left, kv, out)
            if n == 0:
                self._push_waiting(req)
                return
            left -= n
        self._take_in_order(left, kv, out)
