"""Bookkeeping shared by every policy: queues, KV admission, moving requests between queues.

A policy implements ``_fill`` only: given the decodes that can run, choose the prefill
chunks (and the budget) of this iteration.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import TYPE_CHECKING

from gpu_runtime.qos import QoSClass, Tier
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.scheduler.config import SchedulerConfig
from gpu_runtime.scheduler.decode_length import DecodeLengthHistory
from gpu_runtime.scheduler.interface import ScheduledPrefill, Scheduler, SchedulerOutput
from gpu_runtime.scheduler.request_queue import RequestQueue

if TYPE_CHECKING:
    from gpu_runtime.costmodel.base import CostModel
    from gpu_runtime.executor.base import Executor

log = logging.getLogger(__name__)


class KVBudget:
    """Free KV blocks left while one batch is formed (unbounded without an executor).

    Admission reserves a request's whole footprint (prompt + max_tokens): a prompt is
    started only if it fits beside what every admitted request may still grow to, so
    running decodes can never be starved of blocks (no deadlock, no recompute)."""

    def __init__(self, executor: Executor | None, watermark: float, footprint_blocks: int = 0) -> None:
        self.executor = executor
        if executor is None:
            self.free, self.total, self.reserve, self.outstanding, self.block_size = 1 << 60, 1 << 60, 0, 0, 1
            return
        cap = executor.capacity()
        self.free, self.total, self.block_size = cap.free_blocks, cap.total_blocks, cap.block_size
        self.reserve = int(watermark * cap.total_blocks)
        # Blocks admitted requests may still claim: their reserved footprints minus what they hold.
        self.outstanding = max(0, footprint_blocks - (cap.total_blocks - cap.free_blocks))

    @property
    def free_fraction(self) -> float:
        return self.free / self.total if self.total else 1.0

    @property
    def unreserved_fraction(self) -> float:
        """Share of blocks neither held nor reserved by admitted requests' footprints (real KV headroom)."""
        return max(0, self.free - self.outstanding) / self.total if self.total else 1.0

    def need(self, req: Request, n: int) -> int:
        return 0 if self.executor is None else self.executor.blocks_needed(req.request_id, n)

    def take(self, req: Request, n: int, admit: bool) -> int:
        """Tokens of ``n`` that fit now; 0 for a new prompt whose footprint cannot be reserved."""
        if self.executor is None or n <= 0:
            return max(0, n)
        if admit:
            footprint = self.footprint(req)
            alone = self.outstanding == 0 and self.free == self.total  # nothing else holds KV
            if footprint > self.free - self.outstanding - self.reserve and not alone:
                return 0  # (alone: a footprint larger than the whole cache still gets to run)
            self.outstanding += footprint
        need = self.need(req, n)
        if need > self.free:
            return 0
        self.free -= need
        self.outstanding -= need
        return n

    def footprint(self, req: Request) -> int:
        """Blocks for the whole prompt + max_tokens (+1 block of slack for a partial first block)."""
        return -(-(req.prompt_len + req.sampling.max_tokens) // self.block_size) + 1


class BaseScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, cost_model: CostModel | None = None,
                 executor: Executor | None = None) -> None:
        self.config = config
        self.executor = executor
        if cost_model is None:
            from gpu_runtime.costmodel.profile import default_cost_model

            cost_model = default_cost_model()
        self.cost_model = cost_model
        self.waiting: RequestQueue = self._make_queue()  # prompts not fully computed
        self.relegated: RequestQueue = self._make_queue()  # run only with spare budget
        self.running: dict[str, Request] = {}  # decoding, insertion order
        self.started: set[str] = set()  # prefills with KV already allocated (mid-prompt)
        self.history = DecodeLengthHistory()
        self.free_waiting = 0  # free-tier jobs in ``waiting`` (relegation rule)
        self.waiting_prefill_tokens = 0  # prompt tokens left in ``waiting`` (load signal), kept O(1)
        self._queued_tokens: dict[str, int] = {}  # what each waiting request added to that sum
        self._resumed: list[Request] = []  # reported by the next schedule()
        self._new_admits = 0  # prompts started in the batch being formed
        self._footprint = 0  # KV blocks reserved by every request holding KV (admission control)
        self._holders: dict[str, int] = {}  # request -> its blocks counted in ``_footprint``

    @abstractmethod
    def _make_queue(self) -> RequestQueue:
        """The ordering of this policy's prefill queue."""

    @abstractmethod
    def _fill(self, out: SchedulerOutput, now: float, kv: KVBudget) -> None:
        """Choose this iteration's prefill chunks (``out.decodes`` already holds the decodes)."""

    # ---- queue membership ----
    def _push_waiting(self, req: Request) -> None:
        self._remove_waiting(req.request_id)
        if req.qos.tier is Tier.FREE:
            self.free_waiting += 1
        self._queued_tokens[req.request_id] = n = req.prefill_remaining
        self.waiting_prefill_tokens += n
        self.waiting.push(req)

    def _left_waiting(self, req: Request | None) -> Request | None:
        if req is not None:
            if req.qos.tier is Tier.FREE:
                self.free_waiting -= 1
            self.waiting_prefill_tokens -= self._queued_tokens.pop(req.request_id, 0)
        return req

    def _pop_waiting(self) -> Request | None:
        return self._left_waiting(self.waiting.pop())

    def _remove_waiting(self, request_id: str) -> Request | None:
        return self._left_waiting(self.waiting.remove(request_id))

    # ---- Scheduler interface ----
    def add_request(self, request: Request) -> None:
        if request.qos.qos_class is QoSClass.BATCH and request.predicted_output_len is None:
            request.predicted_output_len = self.history.predict(request.app_id, request.sampling.max_tokens)
        self._push_waiting(request)

    def abort_request(self, request_id: str) -> Request | None:
        self._on_leave(request_id)
        self._release(request_id)
        self.started.discard(request_id)
        req = self._remove_waiting(request_id) or self.relegated.remove(request_id) or \
            self.running.pop(request_id, None)
        return req

    def resume(self, request_id: str) -> bool:
        req = self.relegated.remove(request_id)
        if req is None:
            return False
        req.status = RequestStatus.WAITING
        self._push_waiting(req)
        self._resumed.append(req)
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.relegated) + len(self.running)

    def queue_depths(self) -> dict[str, int]:
        return {"prefill": len(self.waiting), "decode": len(self.running), "relegated": len(self.relegated)}

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        out.resumed, self._resumed = self._resumed, []
        self._new_admits = 0
        kv = KVBudget(self.executor, self.config.kv_watermark, self._footprint)
        if kv.free - kv.outstanding >= len(self.running) or self.executor is None:
            out.decodes = list(self.running.values())  # footprints reserved: every decode fits
        else:
            out.decodes = [r for r in self.running.values() if kv.take(r, 1, admit=False) == 1]
        if len(out.decodes) < len(self.running):
            log.debug("KV exhausted: %d of %d decodes wait a step", len(self.running) - len(out.decodes),
                        len(self.running))
        self._fill(out, now, kv)
        for p in out.prefills:
            if p.request.request_id not in self.started:
                self.started.add(p.request.request_id)
                fp = kv.footprint(p.request) if self.executor is not None else 0
                self._footprint += fp
                self._holders[p.request.request_id] = fp
        return out

    def update_from_output(self, output: SchedulerOutput, now: float) -> None:
        for p in output.prefills:
            req = p.request
            if req.status.finished:
                self._forget(req)
            elif not req.in_prefill:
                self.started.discard(req.request_id)
                if req.status is RequestStatus.RELEGATED:  # served with spare budget: back in normal service
                    self._resumed.append(req)
                req.status = RequestStatus.DECODING
                self.running[req.request_id] = req
            elif req.status is RequestStatus.RELEGATED:
                self.relegated.push(req)  # pop before re-push: its key changed with the chunk
            else:
                self._push_waiting(req)
        for req in output.decodes:
            if req.status.finished:
                self._forget(req)
            elif req.predicted_output_len is not None and req.num_output_tokens >= req.predicted_output_len:
                # Outlived its predicted length: re-estimate what is left (its slack and priority read it).
                req.predicted_output_len = self.history.predict_beyond(req.app_id, req.num_output_tokens,
                                                                       req.sampling.max_tokens)

    def _release(self, request_id: str) -> None:
        self._footprint -= self._holders.pop(request_id, 0)

    def _on_leave(self, request_id: str) -> None:
        """Hook: a request left the scheduler (finished or aborted); policies drop their per-request state."""

    def _forget(self, req: Request) -> None:
        self._on_leave(req.request_id)
        self._release(req.request_id)
        self.running.pop(req.request_id, None)
        self._remove_waiting(req.request_id)
        self.relegated.remove(req.request_id)
        self.started.discard(req.request_id)
        if req.status is not RequestStatus.FINISHED_ABORTED:
            self.history.record(req.app_id, req.num_output_tokens)

    # ---- helpers for policies ----
    def _admit_room(self) -> int:
        """How many more requests may start holding KV (max_num_seqs)."""
        return self.config.max_num_seqs - len(self.running) - len(self.started)

    def _take_chunk(self, req: Request, n: int, kv: KVBudget, out: SchedulerOutput) -> int:
        """Add up to ``n`` prompt tokens of ``req`` to ``out`` if KV and admission allow; returns tokens taken."""
        admit = req.request_id not in self.started
        if admit and self._admit_room() <= self._new_admits:
            return 0
        n = kv.take(req, min(n, req.prefill_remaining), admit=admit)
        if n > 0:
            out.prefills.append(ScheduledPrefill(req, n))
            self._new_admits += admit
        return n
