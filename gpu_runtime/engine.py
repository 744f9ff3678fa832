"""The step loop: scheduler -> speculation -> executor -> commit.

One ``Engine`` drives either a real model (TorchExecutor) or the simulator
(SimExecutor); the scheduler and speculation policy are the same objects in both.
``add_request``/``abort`` are thread-safe so a worker can feed the engine from another
thread while a dedicated thread calls ``step()``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpu_runtime.executor.base import BatchPlan, DecodeEntry, PrefillChunk, StepResult
from gpu_runtime.logprobs import TokenLogprob
from gpu_runtime.metrics import RequestMetrics, request_metrics
from gpu_runtime.qos import Tier
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.speculation.base import NoSpeculation, SpeculationPolicy
from gpu_runtime.speculation.counts import SpecDecodeCounts
from gpu_runtime.speculation.selection import SelectionInput, select_trees
from gpu_runtime.vllm.lora import NO_LORA

if TYPE_CHECKING:
    from gpu_runtime.detokenizer import Detokenizer
    from gpu_runtime.executor.base import Executor
    from gpu_runtime.scheduler.interface import Scheduler, SchedulerOutput

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What changed for one request in one iteration (streamed to clients)."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    status: RequestStatus = RequestStatus.WAITING
    event: str | None = None  # "relegated" | "resumed" | "preempted" | "recomputed" | "expired" | None
    metrics: RequestMetrics | None = None  # set when finished
    error: str | None = None  # event "rejected": what the engine refused in the request (None: it failed itself)
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, where the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token, once, where the request asked

    @property
    def finished(self) -> bool:
        return self.status.finished


@dataclass
class StepStats:
    """Counters of the last iteration, for metrics and the cost-model profile."""

    num_prefill_tokens: int = 0
    num_decodes: int = 0
    num_tree_tokens: int = 0
    num_accepted: int = 0
    step_latency_s: float = 0.0
    draft_latency_s: float = 0.0
    prefill_budget: int = 0


class Engine:
    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler,
        speculation: SpeculationPolicy | None = None,
        detokenizer: Detokenizer | None = None,
    ) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.speculation = speculation or NoSpeculation()
        self.speculation.bind(executor)
        self.detokenizer = detokenizer
        self.requests: dict[str, Request] = {}
        self.last_stats = StepStats()
        self.spec_decode = SpecDecodeCounts()  # since it started: vLLM's spec_decode_* counters
        self.num_recomputes = 0  # requests whose KV was released under memory pressure (recompute preemption)
        self.idle = False  # the last step scheduled nothing (work admitted, none schedulable): the caller may wait
        self.lora_limits = dict(NO_LORA)  # it serves no LoRA adapters (vLLM's backend does), as its heartbeat says
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._resumes: deque[str] = deque()
        self._promotions: deque[tuple[str, Tier]] = deque()
        self._lock = threading.Lock()
        # prompts not (re)started, probed each step for a longer cached prefix (an executor with a prefix cache);
        # a dict: probed in admission order, the same in every process (a set's order follows string hashes)
        self._unstarted: dict[str, None] = {}
        self._prefix_caching = bool(getattr(executor, "prefix_caching", False))
        # the most KV slots the executor gives a request over its life, which admission reserves (``_tree_room``)
        self._footprint_slots = getattr(executor, "footprint_slots", None)
        # tree tokens each decode verified in the last pass: the scheduler budgets them as its next pass's drafts
        # (vLLM's drafter proposes before the step is scheduled; this engine drafts after, so the last pass tells)
        self._verified: dict[str, int] = {}

    # ---- thread-safe entry points ----
    def add_request(self, request: Request) -> None:
        total = request.prompt_len + request.sampling.max_tokens
        if request.prompt_len == 0:
            raise ValueError("prompt is empty")
        if request.lora_name is not None:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: adapters are served on the vLLM backend only")
        if total > self.executor.max_model_len:
            raise ValueError(
                f"prompt ({request.prompt_len} tokens) + max_tokens ({request.sampling.max_tokens}) "
                f"exceeds the {self.executor.max_model_len} tokens this engine serves (its max_model_len: the "
                "model's context, or what its KV cache holds where that is less): shorten the prompt or lower "
                "max_tokens")
        if refused := request.sampling.own_engine_refusal():
            raise ValueError(refused[1])
        with self._lock:
            self._inbox.append(request)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def resume(self, request_id: str) -> None:
        """Operator action (thread-safe): bring a relegated request back at the next step."""
        with self._lock:
            self._resumes.append(request_id)

    def promote(self, request_id: str, tier: Tier) -> None:
        """Operator action (thread-safe): change a request's tier at the next step (the scheduler's tier
        counts follow; the engine thread is the only writer of its requests)."""
        with self._lock:
            self._promotions.append((request_id, tier))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets the executor's cached prefixes, where it keeps any (between steps, from the engine thread)."""
        reset = getattr(self.executor, "reset_prefix_cache", None)
        return bool(reset(reset_running_requests)) if reset is not None else True

    @property
    def has_work(self) -> bool:
        """Requests to add or to abort, or admitted and unfinished: an abort of a request its scheduler no longer
        holds (a step that raised midway) is work too, the step that takes it lets the request go."""
        return bool(self._inbox) or bool(self._aborts) or self.scheduler.num_unfinished > 0

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        outputs = self._take_inbox()
        if self._prefix_caching:
            self._note_cached_prefixes()
        now = self.executor.now()
        if hasattr(self.scheduler, "decode_drafts"):
            running = self.scheduler.running  # type: ignore[attr-defined]
            # no more than the tree the next pass may verify (``_tree_room``)
            self.scheduler.decode_drafts = {rid: min(k, self._tree_room(running[rid])) for rid, k in
                                            self._verified.items() if rid in running}
        sched = self.scheduler.schedule(now)
        outputs += self._events(sched)
        if self._prefix_caching:
            for p in sched.prefills:
                self._unstarted.pop(p.request.request_id, None)
            self._unstarted.update(dict.fromkeys(r.request_id for r in sched.recomputed))
        self.idle = sched.is_empty
        if sched.is_empty:
            self.speculation.maintain(self.executor, self.scheduler.queue_depths().get("prefill", 0))
            return outputs

        plan, selected, draft_latency = self._build_plan(sched, now)
        self._verified = {d.request_id: len(d.tree) for d in plan.decodes if d.tree is not None}
        result = self.executor.step(plan)
        now = self.executor.now()
        outputs += self._commit(sched, result, now)
        self.spec_decode.observe(self._verified, result.accepted_nodes)
        decodes = sched.decodes
        self.speculation.observe(decodes, selected, result, draft_latency, now)
        self.scheduler.update_from_output(sched, now)
        self.speculation.maintain(self.executor, self.scheduler.queue_depths().get("prefill", 0))
        self.last_stats = StepStats(
            num_prefill_tokens=plan.num_prefill_tokens, num_decodes=len(plan.decodes),
            num_tree_tokens=plan.num_tree_tokens,
            num_accepted=sum(len(v) for v in result.accepted_nodes.values()),
            step_latency_s=result.latency_s, draft_latency_s=draft_latency,
            prefill_budget=sched.prefill_budget)
        return outputs

    def run_until_idle(self, max_steps: int | None = None) -> list[RequestOutput]:
        """Step until every admitted request finished (tests, benchmarks, the CLI)."""
        outputs: list[RequestOutput] = []
        steps = 0
        while self.has_work and (max_steps is None or steps < max_steps):
            outputs += self.step()
            steps += 1
        return outputs

    # ---- pieces of one iteration ----
    def _take_inbox(self) -> list[RequestOutput]:
        outputs = []
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = list(self._aborts), deque()
            resumes, self._resumes = list(self._resumes), deque()
            promotions, self._promotions = list(self._promotions), deque()
        for req in new:
            try:
                self.executor.add_request(req.request_id, req.sampling, category=req.app_id, cache_salt=req.cache_salt)
            except Exception as exc:  # e.g. a seed the generator rejects: fail this request, not the step
                log.warning("request %s rejected at admission: %s", req.request_id, exc)
                self.executor.free(req.request_id)
                req.status, req.finish_time = RequestStatus.FINISHED_ABORTED, self.executor.now()
                outputs.append(RequestOutput(req.request_id, status=req.status, event="rejected", error=str(exc)))
                continue
            self.requests[req.request_id] = req
            self.scheduler.add_request(req)
            if self._prefix_caching:
                self._unstarted[req.request_id] = None
        for rid in aborts:
            self.scheduler.abort_request(rid)
            # whatever the engine still holds goes, whatever its status: a step that raised between setting a
            # request finished and ``_finish`` left it held (its KV, its slot), and nothing else lets it go
            req = self.requests.get(rid)
            if req is None:  # never admitted, or finished and reported already: nothing held, nothing to report
                continue
            req.status = RequestStatus.FINISHED_ABORTED
            req.finish_time = self.executor.now()
            outputs.append(self._finish(req))
        for rid, tier in promotions:
            self.scheduler.change_tier(rid, tier)
        for rid in resumes:  # reported as "resumed" by the next schedule()
            if not self.scheduler.resume(rid):
                log.info("resume %s: not relegated (any more)", rid)
        return outputs

    def _note_cached_prefixes(self) -> None:
        """Prompts not (re)started whose prefix the executor's cache holds further than known (computed for
        another request since, or for this one before its KV was released) start with it shared, and the
        scheduler plans them for what is left (as ``gpu_runtime/vllm/scheduler.py`` does inside vLLM)."""
        for rid in list(self._unstarted):
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                del self._unstarted[rid]
                continue
            hit = self.executor.cached_prefix(rid, req.prompt_token_ids, req.num_computed_tokens)
            if hit > req.num_computed_tokens:
                self.executor.share_prefix(rid, hit)
                req.num_cached_tokens = hit
                self.scheduler.note_cached_prefix(req, hit)

    def _events(self, sched: SchedulerOutput) -> list[RequestOutput]:
        out = [RequestOutput(r.request_id, status=r.status, event="relegated") for r in sched.relegated]
        for r in sched.expired:  # relegated past their expiry: the scheduler let them go, their KV goes too
            r.finish_time = self.executor.now()
            done = self._finish(r)
            done.event = "expired"
            out.append(done)
        out += [RequestOutput(r.request_id, status=r.status, event="resumed") for r in sched.resumed]
        out += [RequestOutput(r.request_id, status=r.status, event="preempted") for r in sched.preempted]
        out += [RequestOutput(r.request_id, status=r.status, event="recomputed") for r in sched.recomputed]
        self.num_recomputes += len(sched.recomputed)
        return out

    def _build_plan(self, sched: SchedulerOutput, now: float) -> tuple[BatchPlan, dict, float]:
        prefills = []
        for p in sched.prefills:
            req, start = p.request, p.request.num_computed_tokens
            # The last chunk of a prompt samples the first token; a recompute after released KV samples
            # nothing (its last output is fed by the next decode step, and the executor's drafts follow it).
            last = start + p.num_tokens >= req.prefill_target
            prefills.append(PrefillChunk(req.request_id, start, req.prefill_token_ids(start, p.num_tokens),
                                         sample=last and not req.num_output_tokens,
                                         pending_token_id=req.last_token_id if last and req.num_output_tokens
                                         else None))
        decodes = [DecodeEntry(r.request_id, r.num_computed_tokens, r.last_token_id) for r in sched.decodes]
        selected: dict = {}
        draft_latency = 0.0
        self.speculation.prefill_tokens_in_pass = sum(len(c.token_ids) for c in prefills)  # observe reads it too
        self.speculation.pass_spare_s = sched.pass_spare_s
        if decodes and self.executor.has_draft:
            entries = self.speculation.draft_plan(sched.decodes, now)
            if entries:
                drafted = self.executor.draft(entries, self.speculation.keep_drafting)
                draft_latency = drafted.latency_s
                selected = self.speculation.select(sched.decodes, drafted.trees, self.executor.now())
                selected = self._fit_trees_to_kv(self._trees_in_footprints(selected, sched.decodes), prefills,
                                                 len(decodes))
                for d in decodes:
                    tree = selected.get(d.request_id)
                    d.tree = tree if tree is not None and len(tree) else None
        return BatchPlan(prefills, decodes), selected, draft_latency

    def _tree_room(self, req: Request) -> int:
        """Nodes a decode of ``req`` may verify in its next pass: the slots past its pending token up to the most
        the executor gives it over its life (``footprint_slots`` of prompt + max_tokens), which KV admission
        reserves. A tree past them would take KV that no footprint holds, and the scheduler would release (and
        recompute) a job to make room for it even where admission reserved max_tokens."""
        if self._footprint_slots is None:
            return 1 << 30
        return max(0, self._footprint_slots(req.prompt_len + req.sampling.max_tokens) - req.num_computed_tokens - 1)

    def _trees_in_footprints(self, selected: dict, decodes: list[Request]) -> dict:
        """Each decode's tree cut to its ``_tree_room``: its most probable nodes that fit (AdaServe's throughput
        selection on that tree alone), none where no slot is left."""
        kept = dict(selected)
        for req in decodes:
            tree, room = kept.get(req.request_id), self._tree_room(req)
            if tree is None or len(tree) <= room:
                continue
            cut = select_trees([SelectionInput(req.request_id, 0.0, max(tree.depths()))], {req.request_id: tree},
                               room + 1).trees  # the budget counts the root (the pending token) too
            if req.request_id in cut:
                kept[req.request_id] = cut[req.request_id]
            else:
                del kept[req.request_id]
        return kept

    def _fit_trees_to_kv(self, selected: dict, prefills: list[PrefillChunk], num_decodes: int) -> dict:
        """Drops the largest token trees until their slots fit the free KV blocks.

        Admission reserves a request's trees only up to its footprint (``_tree_room``), and a predicted
        reserve less than max_tokens, so under memory pressure a selected tree may not fit: it is decoded
        without speculation this step rather than failing the batch."""
        cap = self.executor.capacity()
        bs = cap.block_size
        spare = cap.free_blocks - num_decodes - sum(-(-len(p.token_ids) // bs) + 1 for p in prefills)
        cost = {rid: -(-len(t) // bs) + 1 for rid, t in selected.items() if t is not None and len(t)}
        if sum(cost.values()) <= spare:
            return selected
        kept = dict(selected)
        for rid in sorted(cost, key=lambda r: len(selected[r]), reverse=True):
            if sum(cost[r] for r in kept if r in cost) <= spare:
                break
            kept.pop(rid)
        log.info("KV short (%d spare blocks): %d of %d trees dropped this step", spare,
                 len(selected) - len(kept), len(selected))
        return kept

    def _commit(self, sched: SchedulerOutput, result: StepResult, now: float) -> list[RequestOutput]:
        outputs = []
        touched: list[tuple[Request, list[int]]] = []
        for p in sched.prefills:
            req = p.request
            req.num_computed_tokens += p.num_tokens
            if req.request_id in result.cached_tokens:  # found cached as the pass ran (an executor's prefix cache)
                req.num_cached_tokens = result.cached_tokens[req.request_id]
            new = result.tokens.get(req.request_id, [])
            if not req.in_prefill and new:
                req.status = RequestStatus.DECODING if req.status is RequestStatus.WAITING else req.status
                touched.append((req, new[:1]))
        for req in sched.decodes:
            new = result.tokens.get(req.request_id, [])
            req.num_computed_tokens += 1 + len(result.accepted_nodes.get(req.request_id, []))
            touched.append((req, new))
        for req, new in touched:
            outputs.append(self._append_tokens(req, new, now))
        return outputs

    def _append_tokens(self, req: Request, new: list[int], now: float) -> RequestOutput:
        eos = None if req.sampling.ignore_eos else self.executor.eos_token_id
        kept: list[int] = []
        finish: RequestStatus | None = None
        for tok in new:
            kept.append(tok)
            req.output_token_ids.append(tok)
            req.token_times.append(now)
            if eos is not None and tok == eos:
                finish = RequestStatus.FINISHED_STOPPED
                break
            if req.num_output_tokens >= req.sampling.max_tokens:
                finish = RequestStatus.FINISHED_LENGTH
                break
        text = ""
        if self.detokenizer is not None:
            text, hit = self.detokenizer.update(req, finished=finish is not None)
            if hit is not None:
                finish, req.stop_reason = RequestStatus.FINISHED_STOPPED, hit
                # tokens accepted in the same step after the one that completed the stop string are not output
                if past := self.detokenizer.tokens_past_stop(req, len(kept)):
                    del req.output_token_ids[-past:], req.token_times[-past:], kept[-past:]
        if finish is not None:
            req.status = finish
            req.finish_time = now
            out = self._finish(req, emit_text=False)
            out.new_token_ids, out.new_text = kept, text
            return out
        return RequestOutput(req.request_id, kept, text, req.status)

    def _finish(self, req: Request, emit_text: bool = True) -> RequestOutput:
        self.executor.free(req.request_id)
        self.requests.pop(req.request_id, None)
        if self.detokenizer is not None:
            self.detokenizer.forget(req.request_id)
        return RequestOutput(req.request_id, status=req.status, metrics=request_metrics(req))
