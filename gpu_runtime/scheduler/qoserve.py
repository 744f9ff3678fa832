"""QoServe (Alg. 1): slack-driven chunk budget, hybrid priority, eager relegation,
selective preemption of prefills."""

from __future__ import annotations

import heapq
import logging
import math
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING

from gpu_runtime.costmodel.base import decode_step_time, saturation_tokens
from gpu_runtime.costmodel.features import BatchFeatures
from gpu_runtime.qos import QoSClass, Tier
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.scheduler.base import BaseScheduler, KVBudget
from gpu_runtime.scheduler.chunking import ChunkBudget, build_search_space
from gpu_runtime.scheduler.config import QoServeConfig
from gpu_runtime.scheduler.interface import SchedulerOutput
from gpu_runtime.scheduler.overload import PaidOverload
from gpu_runtime.scheduler.priority import (
    LoadAdaptiveAlpha,
    decode_remaining,
    first_deadline,
    hybrid_priority,
    tier_first_priority,
)
from gpu_runtime.scheduler.relegation import (
    PaidRelegation,
    WorkEstimate,
    expires_at,
    free_yields_until,
    predicted_finish,
    should_relegate,
)
from gpu_runtime.scheduler.request_queue import PriorityQueue, RequestQueue

if TYPE_CHECKING:
    from gpu_runtime.costmodel.base import CostModel
    from gpu_runtime.executor.base import Executor

log = logging.getLogger(__name__)


class QoServeScheduler(BaseScheduler):
    def __init__(self, config: QoServeConfig | None = None, cost_model: CostModel | None = None,
                 executor: Executor | None = None) -> None:
        config = config or QoServeConfig()
        self.alpha = LoadAdaptiveAlpha(config.alpha_low_ms, config.alpha_high_ms, adaptive=config.adaptive_alpha)
        super().__init__(config, cost_model, executor)
        self.config: QoServeConfig = config
        space = build_search_space(self.cost_model, config.chunk_floor, config.chunk_ceiling,
                                   saturation_fraction=config.saturation_fraction)
        self.chunking = ChunkBudget(self.cost_model, space, config.safety, config.kv_short_fraction)
        self.pinned: set[str] = set()  # resumed by an operator: never relegated again
        self.paid_relegation = PaidRelegation(config.paid_relegation)
        if config.free_yields_relegated_paid:  # relegated paid work runs first (and free work yields to it)
            self.relegated = PriorityQueue(lambda r: tier_first_priority(r, self.alpha.alpha_s))
        # (expiry time, request id) of every relegation; checked lazily (the job may have left the queue)
        self._expiry: list[tuple[float, str]] = []
        self._free_yield_until = -math.inf  # free jobs yield to any waiting paid job until then (free_yields_until)
        self._overload = PaidOverload()  # ... and while paid work alone fills the engine (free_yields_overload)
        top = space[-1]
        # A batch decode's pace is set beside the chunk where prefill throughput saturates, not beside a larger
        # ceiling (vLLM's step cap: 2048 tokens, ~8 s a pass on the CPU profile, made every batch job "hopeless")
        self._pace_chunk = min(top, saturation_tokens(self.cost_model, fraction=config.saturation_fraction,
                                                      floor=config.chunk_floor))
        self._top_chunk = top
        self._refresh_prices()
        self._targets: Counter[float] = Counter()  # TTFT/TTLT of unfinished requests -> how many
        self._target_of: dict[str, float] = {}
        self._min_first_target = math.inf  # tightest target unfinished: horizon of the load signal
        # Paid prefills by latest start (deadline - margin x remaining work): candidates for the paid guard,
        # with their prefill seconds (summed over the queue: the guard's walk stops once nothing can be late).
        self._paid_by_start = PriorityQueue(self._latest_start)
        self._paid_prefill_s: dict[str, float] = {}
        self._paid_prefill_total_s = 0.0
        self._yield_memo: dict[int, bool] = {}  # this iteration's free-yield verdicts by prefill iterations

    def _refresh_prices(self) -> None:
        """The cost model's prices the guard and the load signal use, read once an iteration: a model calibrated
        in place changes its level while the engine runs (gpu_runtime/costmodel/calibration.py). Values cached
        per waiting job keep the level they were pushed with."""
        self._sec_per_prefill_token = self.cost_model.predict(BatchFeatures.of_shape(self._top_chunk)) / self._top_chunk
        # A batch job's time per output token in the paid guard: a decode step alone, the fastest it can go. The
        # guard moves a job ahead of others, so it assumes the least the job needs; relegation, which takes a job
        # out of line, prices the same decode at a loaded engine's pace (_batch_pace). Both err toward the other
        # jobs. (A full decode batch, 1.7 s a token on the CPU profile, made every 35 s batch job due on arrival.)
        self._guard_decode_step_s = decode_step_time(self.cost_model, 1, 512)

    def _prefill_s(self, req: Request) -> float:
        return req.prefill_remaining * self._sec_per_prefill_token

    def _latest_start(self, req: Request) -> float:
        """Last moment the job's remaining prefill (and, for a batch job, its predicted decode) can start."""
        work = self._prefill_s(req)
        if req.qos.qos_class is QoSClass.BATCH:  # eq. 3: the last token, not the first, is due
            work += decode_remaining(req) * self._guard_decode_step_s
        return first_deadline(req) - self.config.risk_margin * work

    def _push_waiting(self, req: Request) -> None:
        super()._push_waiting(req)
        if req.qos.tier is Tier.PAID and self.config.paid_guard:
            self._paid_push(req)

    def _paid_push(self, req: Request) -> None:
        self._paid_pop(req.request_id)
        self._paid_by_start.push(req)
        self._paid_prefill_s[req.request_id] = w = self._prefill_s(req)
        self._paid_prefill_total_s += w

    def _paid_pop(self, request_id: str) -> None:
        self._paid_by_start.remove(request_id)
        self._paid_prefill_total_s -= self._paid_prefill_s.pop(request_id, 0.0)

    def _left_waiting(self, req: Request | None) -> Request | None:
        if req is not None:
            self._paid_pop(req.request_id)
        return super()._left_waiting(req)

    def _make_queue(self) -> RequestQueue:
        return PriorityQueue(lambda r: hybrid_priority(r, self.alpha.alpha_s))

    def add_request(self, request: Request) -> None:
        t = first_deadline(request) - request.arrival_time
        self._targets[t] += 1
        self._target_of[request.request_id] = t
        self._min_first_target = min(self._min_first_target, t)
        watch = self.config.free_yields_overload and request.qos.tier is Tier.PAID
        mean_output = self.history.mean(request.app_id) if watch else None
        if mean_output is not None:  # a paid job; unknown lengths are not guessed at
            tokens = request.prompt_len + min(request.sampling.max_tokens, mean_output)
            self._overload.paid_arrived(request.arrival_time, tokens, t)
        super().add_request(request)

    def schedule(self, now: float) -> SchedulerOutput:
        self._refresh_prices()
        out = super().schedule(now)
        if not self.config.free_yields_overload:
            return out
        # saturated: the budget or the KV ran out before the queue did (prompts still wait after this step)
        saturated = len(self.waiting) > 0
        tokens = sum(p.num_tokens for p in out.prefills) + len(out.decodes) if saturated else 0
        self._overload.step_began(now, tokens, saturated)
        return out

    def _on_leave(self, request_id: str) -> None:
        self.pinned.discard(request_id)
        t = self._target_of.pop(request_id, None)
        if t is None:
            return
        self._targets[t] -= 1
        if self._targets[t] <= 0:
            del self._targets[t]
            if t == self._min_first_target:  # the tightest class left: widen the horizon
                self._min_first_target = min(self._targets, default=math.inf)

    def resume(self, request_id: str) -> bool:
        ok = super().resume(request_id)
        if ok:
            self.pinned.add(request_id)
        return ok

    def _update_alpha(self) -> None:
        load = self.waiting_prefill_tokens * self._sec_per_prefill_token / max(1e-3, self._min_first_target)
        if self.alpha.update(load):
            self.waiting.rekey()
            self.relegated.rekey()

    def _expire(self, out: SchedulerOutput, now: float) -> None:
        """Relegated jobs past their expiry (``expires_at``) leave every queue as finished_expired."""
        while self._expiry and self._expiry[0][0] <= now:
            _, rid = heapq.heappop(self._expiry)
            req = self.relegated.get(rid)
            if req is None:
                continue  # resumed, or finished, since
            later = self._expires_at(req)
            if later > now:  # it streamed since it was relegated (ran with spare budget): mid-answer, a later end
                heapq.heappush(self._expiry, (later, rid))
                continue
            self.relegated.remove(rid)
            self.started.pop(rid, None)
            self._release(rid)
            self._on_leave(rid)
            req.status = RequestStatus.FINISHED_EXPIRED
            out.expired.append(req)
        if out.expired:
            log.info("%d relegated jobs expired", len(out.expired))

    def _relegate(self, req: Request, out: SchedulerOutput, now: float) -> None:
        self._free_yield_until = free_yields_until(self._free_yield_until, req, now)
        req.status = RequestStatus.RELEGATED
        req.relegation_count += 1
        self.relegated.push(req)  # not re-checked in this iteration
        out.relegated.append(req)
        if self.config.relegated_expiry is not None:
            heapq.heappush(self._expiry, (self._expires_at(req), req.request_id))

    def _expires_at(self, req: Request) -> float:
        factor = self.config.relegated_expiry
        assert factor is not None  # (no expiry is ever scheduled without it)
        return expires_at(req, factor, self.config.relegated_expiry_min_s)

    def _fill(self, out: SchedulerOutput, now: float, kv: KVBudget) -> None:
        self._expire(out, now)
        if len(self.waiting) + len(self.relegated) == 0:
            return
        self._yield_memo.clear()
        self._update_alpha()
        if self.config.free_yields_overload:
            self._overload.update(now)
        # Alg. 1 lines 5-7: budget C from the minimum decode slack; the chunk's attention starts where
        # the first prompt in line stopped (a continued long prompt costs more than a fresh one).
        head = self.waiting.peek() or self.relegated.peek()
        # counted past the largest chunk by the pace chunk: enough to tell whether the prompts other than a
        # batch job's own fill the pace chunk (_estimate_for)
        queued = self._queued_prefill(self._top_chunk + self._pace_chunk)
        # the engine's step cap: the decodes (and their drafts) take theirs first, the chunk is cut to the rest
        cap = self.config.step_tokens
        room = None if cap is None else cap - len(out.decodes) - self.step_drafts
        choice = self.chunking.choose(out.decodes, now, kv.unreserved_fraction,
                                      head.num_computed_tokens if head is not None else 0, queued, room)
        out.prefill_budget, out.predicted_latency_s = choice.budget, choice.predicted_s
        if math.isfinite(choice.min_slack_s):
            out.pass_time_budget_s = choice.min_slack_s / self.chunking.safety
        decodes, ctx = len(out.decodes), choice.context_tokens
        est = WorkEstimate(choice.predicted_s, out.prefill_budget, self._batch_pace(decodes, ctx, queued),
                           self._stream_pace(decodes, ctx))
        left = out.prefill_budget
        if self.config.preemption:
            left = self._run_unpreemptable(out, now, kv, left, est)
        if self.config.paid_guard and self.free_waiting:
            left = self._run_paid_at_risk(out, now, kv, left, est)
        # Alg. 1 lines 10-23: take jobs in priority order until the budget is spent.
        skipped: list[Request] = []
        while left > 0 and len(self.waiting):
            req = self._pop_waiting()
            assert req is not None
            if (self.config.relegation and req.request_id not in self.pinned
                    and (should_relegate(req, now, self._estimate_for(req, est, decodes, ctx, queued),
                                         self.free_waiting, self.paid_relegation)
                         or self._free_yields(req, now, est))):
                self._relegate(req, out, now)
                continue
            n = self._take_chunk(req, left, kv, out)
            if n == 0:
                skipped.append(req)
                left = self._continue_started(req, left, kv, out)
                break  # KV or admission exhausted: later new jobs need KV too
            left -= n
        for req in skipped:
            self._push_waiting(req)
        # Spare budget goes to relegated jobs (they sort after every other job).
        while left > 0 and len(self.relegated):
            req = self.relegated.pop()
            assert req is not None
            n = self._take_chunk(req, left, kv, out)
            if n == 0:
                self.relegated.push(req)
                # a pass that runs nothing would stall for good: only the started prompts behind the head can free
                # the KV it waits for (else relegated paid work keeps going first, free_yields_relegated_paid)
                if out.is_empty:
                    left = self._continue_started(req, left, kv, out, relegated=True)
                break
            left -= n
        self._mark_preempted(out)

    def _queued_prefill(self, cap: int) -> int:
        """The prompt tokens this pass may run (waiting, then relegated ones with spare budget), counted to ``cap``."""
        n = self.waiting_prefill_tokens
        if n < cap:
            for req in self.relegated:
                n += req.prefill_remaining
                if n >= cap:
                    break
        return n

    def _batch_pace(self, n: int, ctx: int, beside: int) -> float:
        """Time per output token a batch job may count on once decoding: one pass with ``n`` decodes holding
        ``ctx`` KV tokens beside a saturating chunk (the largest chunk, or the cost model's saturation point when
        the space reaches past it), or beside the ``beside`` prompt tokens that may run with it where fewer. Under
        a backlog, admitting it on a faster pace (a pure decode step) would make its slack pin every later chunk
        to the floor until it finished, collapsing prefill throughput under overload. With little queued, the
        saturating chunk's pace (0.22 s a token on the CPU profile, 0.2 s on the A100 one) relegated a lone job
        that alone would finish in a fraction of its deadline."""
        c = min(self._pace_chunk, beside)
        return self.cost_model.predict(BatchFeatures(c, n, c, ctx, 0, n + 1, c * c / 2))

    def _estimate_for(self, req: Request, est: WorkEstimate, n: int, ctx: int, queued: int) -> WorkEstimate:
        """``est`` as a batch job's relegation check sees it: its decode runs beside the prompts queued other than
        its own (its prompt is done by then), not beside every prompt queued."""
        others = queued - req.prefill_remaining
        if req.qos.qos_class is not QoSClass.BATCH or others >= self._pace_chunk:
            return est  # already priced beside the saturating chunk
        return replace(est, decode_step_s=self._batch_pace(n, ctx, max(0, others)))

    def _stream_pace(self, n: int, ctx: int) -> float:
        """The least time per token of an interactive stream joining ``n`` decodes that hold ``ctx`` KV tokens: a
        decode pass alone (eq. 2's pace is lost when it exceeds TBT, ``pace_loss``)."""
        return self.cost_model.predict(BatchFeatures(0, n + 1, 0, ctx, 0, n + 1, 0.0))

    def _free_yields(self, req: Request, now: float, est: WorkEstimate) -> bool:
        """A free job gives way when running its prompt first would make a paid job late (QoServe 3.4: the
        low-priority tier is affected first): it is relegated, before it is itself overdue, and runs with
        spare budget. Also when the paid queue is too long to show that within the guard's window, and to
        any waiting paid job while paid jobs are being lost to overload (``free_yields_until``) or paid work
        alone arrives as fast as the engine serves (``PaidOverload``). And to relegated paid work, late or
        bound to be: it runs first with spare budget, so no free job finishes on time ahead of it."""
        if not (self.config.free_yields and req.qos.tier is Tier.FREE):
            return False
        if self._paid_relegated():
            return True
        if not len(self._paid_by_start):
            return False
        if now < self._free_yield_until or self._overload.overloaded:
            return True
        iterations = math.ceil(req.prefill_remaining / max(1, est.budget))  # how long its prefill holds the budget
        verdict = self._yield_memo.get(iterations)  # one walk per distinct delay and iteration
        if verdict is None:
            _, must_run, cleared = self._walk_paid(now, est, iterations * est.iteration_s)
            verdict = self._yield_memo[iterations] = must_run > 0 or not cleared
        return verdict

    def _paid_relegated(self) -> bool:
        """A relegated paid job is still to be served (it heads the tier-ordered relegated queue)."""
        head = self.relegated.peek() if self.config.free_yields_relegated_paid else None
        return head is not None and head.qos.tier is Tier.PAID

    def _run_unpreemptable(self, out: SchedulerOutput, now: float, kv: KVBudget, left: int,
                           est: WorkEstimate) -> int:
        """Selective preemption: a started prefill may only be paused if it still meets its deadline
        after waiting one more iteration; the others keep their chunk first."""
        urgent = []
        for rid in self.started:
            req = self.waiting.get(rid)
            if req is None:
                continue
            if self._at_risk(req, now, est):
                urgent.append(req)
        urgent.sort(key=lambda r: hybrid_priority(r, self.alpha.alpha_s))
        return self._run_out_of_order(urgent, left, kv, out)

    def _run_out_of_order(self, reqs: list[Request], left: int, kv: KVBudget, out: SchedulerOutput) -> int:
        """Chunks for ``reqs`` in their order ahead of the priority order, until the budget or KV runs out."""
        for req in reqs:
            if left <= 0:
                break
            n = self._take_out_of_order(req, left, kv, out)
            if n == 0:
                break
            left -= n
        return left

    def _take_out_of_order(self, req: Request, left: int, kv: KVBudget, out: SchedulerOutput) -> int:
        """Runs a waiting job's chunk ahead of the priority order; 0 (job back in line) when it gets none."""
        self._remove_waiting(req.request_id)
        n = self._take_chunk(req, left, kv, out)
        if n == 0:
            self._push_waiting(req)
        return n

    def _at_risk(self, req: Request, now: float, est: WorkEstimate) -> bool:
        """Still able to meet its deadline, but not after waiting one more iteration; the estimate of the
        remaining time is stretched by ``risk_margin`` (it assumes the job gets the whole budget)."""
        deadline = first_deadline(req)
        if predicted_finish(req, now, est) > deadline:
            return False  # cannot be saved: relegation's business, not worth others' budget
        t = predicted_finish(req, now + est.iteration_s, est)
        return now + (t - now) * self.config.risk_margin > deadline

    def _run_paid_at_risk(self, out: SchedulerOutput, now: float, kv: KVBudget, left: int,
                           est: WorkEstimate) -> int:
        """Paid guard: paid prefills that would miss their deadlines by waiting go ahead of the priority
        order while free jobs wait (they are the ones to give way under overload, QoServe 3.4). If waiting
        one more iteration would make a prefix of the paid jobs late (``_walk_paid``), that whole prefix
        runs now, in latest-start order."""
        walked, must_run, _ = self._walk_paid(now, est, est.iteration_s)
        return self._run_out_of_order(walked[:must_run], left, kv, out)

    def _walk_paid(self, now: float, est: WorkEstimate, delay_s: float) -> tuple[list[Request], int, bool]:
        """EDF feasibility of the paid prefills if they all wait ``delay_s`` more: walked by latest start with
        their prefill time summed (job k is late unless the k jobs before it, itself included, finish prefill
        first), at most ``paid_guard_window`` of them. Returns the jobs walked, the length of the longest
        prefix that cannot wait, and whether every later paid job is shown able to wait."""
        margin = self.config.risk_margin
        horizon = now + delay_s * margin
        walked: list[Request] = []
        must_run = 0
        ahead_s = 0.0
        cleared = False
        while len(walked) < self.config.paid_guard_window:
            req = self._paid_by_start.peek()
            if req is None:
                cleared = True
                break
            start = self._latest_start(req)
            if start - margin * self._paid_prefill_total_s > horizon:
                cleared = True  # even behind every paid prompt queued this job and all later ones could wait
                break
            self._paid_pop(req.request_id)
            if req.request_id not in self.waiting or predicted_finish(req, now, est) > first_deadline(req):
                continue  # hopeless: left to relegation, no longer a candidate (until it is pushed again)
            if start - margin * ahead_s <= horizon:  # late after the delay behind the jobs ahead
                must_run = len(walked) + 1
            ahead_s += self._prefill_s(req)
            walked.append(req)
        for req in walked:
            self._paid_push(req)
        return walked, must_run, cleared

    def _mark_preempted(self, out: SchedulerOutput) -> None:
        """Started prefills left out of this batch are paused; their KV stays allocated."""
        chosen = {p.request.request_id for p in out.prefills}
        for rid in self.started:
            req = self.waiting.get(rid)
            if req is not None and rid not in chosen and not req.was_preempted:
                req.was_preempted = True
                out.preempted.append(req)
