"""Bookkeeping shared by every policy: queues, KV admission, moving requests between queues.

A policy implements ``_fill`` only: given the decodes that can run, choose the prefill
chunks (and the budget) of this iteration.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import abstractmethod
from collections.abc import Callable, Container
from typing import TYPE_CHECKING

from gpu_runtime.qos import Tier
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.scheduler.config import SchedulerConfig
from gpu_runtime.scheduler.decode_length import DecodeLengthHistory
from gpu_runtime.scheduler.interface import ScheduledPrefill, Scheduler, SchedulerOutput
from gpu_runtime.scheduler.priority import first_deadline
from gpu_runtime.scheduler.request_queue import RequestQueue

if TYPE_CHECKING:
    from gpu_runtime.costmodel.base import CostModel
    from gpu_runtime.executor.base import Executor

log = logging.getLogger(__name__)


class KVBudget:
    """Free KV blocks left while one batch is formed (unbounded without an executor).

    Admission reserves a request's footprint (prompt + the output it is expected to reach,
    ``output_reserve``): a prompt is started only if it fits beside what every admitted
    request may still grow to. With max_tokens as the reserve running decodes can never be
    starved of blocks; with a predicted reserve a job that outlives it is re-reserved, and
    the scheduler releases (and later recomputes) the KV of the least urgent job if the
    cache still runs out."""

    def __init__(self, executor: Executor | None, watermark: float, footprint_blocks: int,
                 output_reserve: Callable[[Request], int], slots: Callable[[int], int] | None = None) -> None:
        self.executor = executor
        self.output_reserve = output_reserve
        self.slots = slots  # the executor's KV slots of a request's life (``footprint_blocks``)
        if executor is None:
            self.free, self.total, self.reserve, self.outstanding, self.block_size = 1 << 60, 1 << 60, 0, 0, 1
            return
        cap = executor.capacity()
        self.total, self.block_size = cap.total_blocks, cap.block_size
        self.reserve = int(watermark * cap.total_blocks)
        self.refresh(cap.free_blocks, footprint_blocks)

    def refresh(self, free_blocks: int, footprint_blocks: int) -> None:
        """Free blocks now, and the blocks admitted requests may still claim (reserved footprints minus held)."""
        self.free = free_blocks
        self.outstanding = max(0, footprint_blocks - (self.total - free_blocks))

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
        return footprint_blocks(req, self.output_reserve(req), self.block_size, self.slots)


def footprint_blocks(req: Request, reserved_output: int, block_size: int,
                     slots: Callable[[int], int] | None = None) -> int:
    """Blocks for the prompt + the reserved output, at least what it holds (+1 block of slack for a partial
    first block). ``slots``: the most KV slots the executor allocates over the life of a request of that many
    tokens, where it knows them exactly (vLLM: a draft step and the drafter's lookahead past the last decode's
    token, capped at the context, ``VLLMKVView.footprint_slots``; the own engine and the simulator: its tokens and a
    block for a draft tree, ``lifetime_slots``): its blocks, no slack."""
    tokens = req.prompt_len + max(reserved_output, req.num_output_tokens + 1)
    if slots is None:
        return -(-tokens // block_size) + 1
    return -(-slots(tokens) // block_size)


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
        # prefills with KV already allocated (mid-prompt), in the order they started: a dict, not a set, so that
        # whatever walks them (pauses, releases, continuations) meets them in the same order in every process (a set
        # of strings iterates in the order of the process's string hashes, PYTHONHASHSEED)
        self.started: dict[str, None] = {}
        self._seats_aside = 0  # seats of running requests set aside for the schedule that keep them (set_aside)
        # draft tokens each running decode verifies in the next step (the engine's drafter proposed them; set by the
        # engine before each schedule, missing: none): a decode takes 1 + its drafts of the step's tokens and KV
        self.decode_drafts: dict[str, int] = {}
        # the planned decodes' drafts (set by schedule): a budget that counts the step's tokens (Sarathi's
        # chunk_size, QoServe's step_tokens) leaves them
        self.step_drafts = 0
        self.history = DecodeLengthHistory()
        self.free_waiting = 0  # free-tier jobs in ``waiting`` (relegation rule)
        self.waiting_prefill_tokens = 0  # prompt tokens left in ``waiting`` (load signal), kept O(1)
        self._queued_tokens: dict[str, int] = {}  # what each waiting request added to that sum
        self._resumed: list[Request] = []  # reported by the next schedule()
        self._new_admits = 0  # prompts started in the batch being formed
        self._footprint = 0  # KV blocks reserved by every request holding KV (admission control)
        self._holders: dict[str, int] = {}  # request -> its blocks counted in ``_footprint``
        # the executor's KV slots over a request's life where they pass its tokens (vLLM's drafts and lookahead)
        self._footprint_slots: Callable[[int], int] | None = getattr(executor, "footprint_slots", None)
        if config.kv_reserve not in ("predicted", "max_tokens"):
            raise ValueError(f"kv_reserve must be 'predicted' or 'max_tokens', not {config.kv_reserve!r}")
        self._reserve_predicted = config.kv_reserve == "predicted"
        # An executor with a prefix cache names each prompt's cacheable blocks (``prompt_blocks``). vLLM caches a
        # block when it allocates it, so a prompt planned after another in the same pass finds the blocks they
        # share: ``_pass_blocks`` holds the names planned so far this pass.
        caching = config.plan_shared_prefixes and executor is not None and getattr(executor, "prefix_caching", False)
        self._prompt_blocks = getattr(executor, "prompt_blocks", None) if caching else None
        self._block_size = executor.capacity().block_size if self._prompt_blocks is not None else 1
        self._pass_blocks: set = set()

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
        # Every class gets the prediction: batch deadlines read it (eq. 5), KV admission reserves it.
        if request.predicted_output_len is None:
            request.predicted_output_len = self.history.predict_rest(request.app_id, request.qos.delivered,
                                                                     request.sampling.max_tokens)
        self._push_waiting(request)

    def _reserved_output(self, req: Request) -> int:
        """Output tokens a request's KV footprint reserves (``kv_reserve``)."""
        if self._reserve_predicted and req.predicted_output_len is not None:
            return req.predicted_output_len
        return req.sampling.max_tokens

    def abort_request(self, request_id: str) -> Request | None:
        self._on_leave(request_id)
        self._release(request_id)
        self.started.pop(request_id, None)
        req = self._remove_waiting(request_id) or self.relegated.remove(request_id) or \
            self.running.pop(request_id, None)
        return req

    def set_aside(self, request_ids: list[str], holding: Container[str] = ()) -> list[tuple[Request, str]]:
        """Takes requests the engine cannot run now out of the policy's queues, for one ``schedule`` (the vLLM
        adapter: a prompt whose adapter finds no LoRA slot, a decode with its token in flight): a prompt is not
        planned, a decode neither planned nor made KV room for; returns what ``put_back`` restores. The running
        requests in ``holding`` keep their seat (max_num_seqs): the engine counts them among its running requests
        until their token in flight is in."""
        aside = []
        for rid in request_ids:
            if (req := self._remove_waiting(rid)) is not None:
                aside.append((req, "waiting"))
            elif (req := self.relegated.remove(rid)) is not None:
                aside.append((req, "relegated"))
            elif (req := self.running.pop(rid, None)) is not None:
                seated = rid in holding
                aside.append((req, "seated" if seated else "running"))
                self._seats_aside += seated
        return aside

    def put_back(self, aside: list[tuple[Request, str]]) -> None:
        for req, queue in aside:
            if queue == "relegated":
                self.relegated.push(req)
            elif queue in ("running", "seated"):  # (after the others: its token comes with the step in flight)
                self.running[req.request_id] = req
                self._seats_aside -= queue == "seated"
            else:
                self._push_waiting(req)

    def resume(self, request_id: str) -> bool:
        req = self.relegated.remove(request_id)
        if req is None:
            return False
        req.status = RequestStatus.WAITING
        self._push_waiting(req)
        self._resumed.append(req)
        return True

    def change_tier(self, request_id: str, tier: Tier) -> Request | None:
        """Operator action (promote), on the engine thread: the request's tier changes and the queues' tier
        counts follow it (a waiting request is taken out and pushed back under its new tier)."""
        req = self._remove_waiting(request_id)
        if req is not None:
            req.qos = dataclasses.replace(req.qos, tier=tier)
            self._push_waiting(req)
            return req
        req = self.relegated.get(request_id) or self.running.get(request_id)
        if req is not None:
            req.qos = dataclasses.replace(req.qos, tier=tier)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.relegated) + len(self.running)

    def queue_depths(self) -> dict[str, int]:
        return {"prefill": len(self.waiting), "decode": len(self.running), "relegated": len(self.relegated)}

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        out.resumed, self._resumed = self._resumed, []
        self._new_admits = 0
        self._pass_blocks.clear()
        kv = KVBudget(self.executor, self.config.kv_watermark, self._footprint, self._reserved_output,
                      self._footprint_slots)
        drafts = self.decode_drafts
        if self.executor is not None and kv.free - kv.outstanding < self._decode_blocks_bound(kv.block_size):
            self._make_room_for_decodes(kv, out)
        if self.executor is None or kv.free - kv.outstanding >= self._decode_blocks_bound(kv.block_size):
            out.decodes = list(self.running.values())  # footprints reserved: every decode fits
        else:  # each with its drafts: vLLM allocates their slots too, and preempts where they do not fit
            out.decodes = [r for r in self.running.values()
                           if kv.take(r, n := 1 + drafts.get(r.request_id, 0), admit=False) == n]
        if len(out.decodes) < len(self.running):
            log.debug("KV exhausted: %d of %d decodes wait a step", len(self.running) - len(out.decodes),
                        len(self.running))
        self.step_drafts = sum(drafts.get(r.request_id, 0) for r in out.decodes) if drafts else 0
        aside = self.set_aside(self._not_restartable(out.recomputed)) if out.recomputed else []
        try:
            self._fill(out, now, kv)
        finally:
            self.put_back(aside)
        for p in out.prefills:
            if p.request.request_id not in self.started:
                if p.request.scheduled_time is None:
                    p.request.scheduled_time = now
                self.started[p.request.request_id] = None
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
                self.started.pop(req.request_id, None)
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
                continue
            if req.predicted_output_len is not None and req.num_output_tokens >= req.predicted_output_len:
                # Outlived its predicted length: re-estimate what is left (its slack and priority read it) and,
                # when admission reserved the prediction, reserve up to the new one (new prompts wait for it).
                d = req.qos.delivered  # a rerun's answer began with an earlier attempt's tokens
                req.predicted_output_len = self.history.predict_beyond(req.app_id, req.answer_tokens,
                                                                       d + req.sampling.max_tokens) - d
                if self._reserve_predicted:
                    self._reserve_again(req)

    def _reserve_again(self, req: Request) -> None:
        held = self._holders.get(req.request_id)
        if held is not None and self.executor is not None:
            fp = footprint_blocks(req, self._reserved_output(req), self.executor.capacity().block_size,
                                  self._footprint_slots)
            self._footprint += fp - held
            self._holders[req.request_id] = fp

    def _decode_blocks_bound(self, block_size: int) -> int:
        """The most KV blocks the running decodes' next step can take: one each (its token and drafts within one
        block past what it holds), more for a decode whose drafts pass a whole block."""
        if not self.decode_drafts:
            return len(self.running)
        return len(self.running) + sum(-(-(1 + k) // block_size) - 1 for k in self.decode_drafts.values())

    def _make_room_for_decodes(self, kv: KVBudget, out: SchedulerOutput) -> None:
        """Recompute preemption (vLLM's default): when the free blocks cannot hold every running decode's next
        token and its drafts, release the KV of paused prefills, then of the least urgent decodes, until they can.
        Their prefill is recomputed later (prompt + outputs); tokens already streamed stay."""
        drafts = self.decode_drafts
        need = sum(kv.need(r, 1 + drafts.get(r.request_id, 0)) for r in self.running.values())
        if need <= kv.free:
            return
        paused = [r for rid in self.started if (r := self.waiting.get(rid) or self.relegated.get(rid)) is not None]
        victims = sorted(paused, key=self.victim_key) + sorted(self.running.values(), key=self.victim_key)
        for req in victims:
            if need <= kv.free or (req.request_id in self.running and len(self.running) == 1):
                break
            if req.request_id in self.running:
                need -= kv.need(req, 1 + drafts.get(req.request_id, 0))
            self._release_kv(req)
            out.recomputed.append(req)
            kv.refresh(self.executor.capacity().free_blocks, self._footprint)  # type: ignore[union-attr]
        if out.recomputed:
            log.info("KV exhausted: released the KV of %d requests (recomputed later)", len(out.recomputed))

    @staticmethod
    def victim_key(req: Request) -> tuple:
        """Least urgent first: relegated, then free tier, then the latest deadline, then the newest (the engine's own
        preemption, where it must preempt, follows it too: the vLLM adapter's ``_least_urgent_last``)."""
        return (req.relegation_count == 0, req.qos.tier is not Tier.FREE, -first_deadline(req), -req.arrival_time)

    def _release_kv(self, req: Request) -> None:
        assert self.executor is not None
        self.executor.release_kv(req.request_id)
        self.note_kv_released(req)

    def _not_restartable(self, released: list[Request]) -> list[str]:
        """The requests this pass released that the executor cannot recompute in the same step (vLLM under async
        scheduling: one whose step was in flight, until that step's output is in): planned, their chunk would be
        skipped, its tokens lost to the step or run by a chunk planned after it."""
        restartable = getattr(self.executor, "restartable", None)
        if restartable is None:
            return []
        return [r.request_id for r in released if not restartable(r.request_id)]

    def note_kv_released(self, req: Request) -> None:
        """Bookkeeping after ``req``'s KV was freed (by this scheduler's choice or by the engine's own
        preemption, as vLLM's does): it goes back to the prefill queue to recompute prompt + outputs."""
        rid = req.request_id
        self._release(rid)
        self.started.pop(rid, None)
        req.release_kv()
        if self.running.pop(rid, None) is not None:
            req.status = RequestStatus.WAITING
        self._requeue(req)

    def note_not_started(self, req: Request) -> None:
        """The engine did not start a prompt this pass planned a first chunk of (its step ran out of tokens, KV
        or slots first): it holds no KV, so it neither reserves a footprint nor takes an admission slot."""
        if req.request_id in self.started:
            self._release(req.request_id)
            self.started.pop(req.request_id, None)

    def note_cached_prefix(self, req: Request, tokens: int) -> None:
        """The engine's prefix cache holds the first ``tokens`` of a prompt it has not (re)started (computed for
        another request since, or for this one before a preemption): they count as computed, and its place in its
        queue follows its shorter remaining prefill."""
        req.num_computed_tokens = tokens
        self._requeue(req)

    def _requeue(self, req: Request) -> None:
        """A request whose remaining prefill changed takes its new place: in the relegated queue if it is there,
        else in the prefill queue (both key on what is left)."""
        if self.relegated.remove(req.request_id) is not None:
            self.relegated.push(req)
        else:
            self._push_waiting(req)

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
        self.started.pop(req.request_id, None)
        if req.status is not RequestStatus.FINISHED_ABORTED:
            self.history.record(req.app_id, req.answer_tokens)  # the whole answer's length, a rerun's too

    # ---- helpers for policies ----
    def _admit_room(self) -> int:
        """How many more requests may start holding KV (max_num_seqs)."""
        return self.config.max_num_seqs - len(self.running) - len(self.started) - self._seats_aside

    def _take_in_order(self, left: int, kv: KVBudget, out: SchedulerOutput) -> int:
        """Chunks of waiting prompts in queue order until ``left`` tokens are spent or KV or admission runs out;
        returns the tokens left."""
        while left > 0 and len(self.waiting):
            req = self._pop_waiting()
            assert req is not None
            n = self._take_chunk(req, left, kv, out)
            if n == 0:  # KV or admission exhausted
                left = self._continue_started(req, left, kv, out)
                self._push_waiting(req)
                break
            left -= n
        return left

    def _continue_started(self, blocked: Request, left: int, kv: KVBudget, out: SchedulerOutput,
                          relegated: bool = False) -> int:
        """Where ``blocked``, a prompt not started, cannot be admitted, the started prompts behind it in the queue
        (the waiting one, or the relegated one that spare budget walks) continue (by priority) with the budget
        ``left``: their reservations are what it waits for, so holding them back would stall both for ever (vLLM,
        too, runs the requests it started before any new one)."""
        if blocked.request_id in self.started:
            return left
        queue = self.relegated if relegated else self.waiting
        take, put = (queue.remove, queue.push) if relegated else (self._remove_waiting, self._push_waiting)
        for req in queue.in_order(self.started):
            if left <= 0:
                break
            take(req.request_id)
            n = self._take_chunk(req, left, kv, out)
            if n == 0:
                put(req)
                break
            left -= n
        return left

    def _take_chunk(self, req: Request, n: int, kv: KVBudget, out: SchedulerOutput) -> int:
        """Add up to ``n`` prompt tokens of ``req`` to ``out`` if KV and admission allow; returns tokens taken."""
        admit = req.request_id not in self.started
        if admit and self._admit_room() <= self._new_admits:
            return 0
        names = self._prompt_blocks(req.request_id) if self._prompt_blocks is not None else ()
        if admit and names:
            self._join_pass_prefix(req, names)
        n = kv.take(req, min(n, req.prefill_remaining), admit=admit)
        if n > 0:
            out.prefills.append(ScheduledPrefill(req, n))
            self._new_admits += admit
            if names:
                self._pass_blocks.update(names[:(req.num_computed_tokens + n) // self._block_size])
        return n

    def _join_pass_prefix(self, req: Request, names) -> None:  # noqa: ANN001 - the executor's block names
        """A prompt about to start counts as computed the blocks after its known hit that prompts planned earlier
        in this pass will have cached, so it is planned for what is left (vLLM computes that much of it)."""
        known = req.num_computed_tokens // self._block_size
        shared = known
        while shared < len(names) and names[shared] in self._pass_blocks:
            shared += 1
        if shared > known:
            req.num_computed_tokens = shared * self._block_size
