"""The engine thread: the only caller of the engine and the only writer of what it produced.

Each iteration it applies the inbox's commands in order (add, abort, resume, promote,
learned lengths, prefix cache resets, the runtime adapters to retire by), runs one engine
step, and turns the step's outputs into outbox records:
token deltas (each with its character offset, so a reader can tell a gap from a pause),
first-token times, relegations and resumptions, completions and rejections, and what a job
the API cancelled had produced (its text and token counts stay on it). It never does I/O
itself. It also keeps the worker honest:

* the engine knows each attempt of a job by its own request id (``Lease.request_id``), and what
  it says of an attempt this worker no longer serves (set aside, or replaced by a rerun) writes
  nothing;
* reconcile: every ``reconcile_s`` a job the worker holds that the engine no longer knows
  (lost without an output) is given back to the queue instead of being renewed forever, and a
  job whose abort the engine has not confirmed for a lease is set aside (``abandon``): an abort
  frees a request's room in vLLM, so the worker stops counting it. An engine that still holds an
  aborted request ``KEPT_ABORT_LEASES`` leases after its abort leaks its slots: the worker gives it
  up (``on_kept_abort``) and stops, its running jobs finishing within the stop grace;
* an operator's promote that comes before its job's add (written just after the lease read the tier, while the
  intake had not added the job) is kept and applied on the add, so the attempt runs at the tier SQL holds; one whose
  attempt is not added within a lease is dropped;
* an idle engine (work admitted but nothing schedulable) is not spun: the thread sleeps on
  its inbox, backing off from 1 ms to 50 ms;
* a step that raises gives every job back to the queue (the last allowed attempt fails, told the
  error's kind but not its text, which may quote another tenant's request) and
  sends those jobs again at once (their messages once their stream events are published); each
  one the engine held is set aside (``abandon``): a rerun that comes back here is added beside
  its aborted request, under its own request id;
* an engine whose steps raise ``engine_error_limit`` times with no token made between them is
  broken (a lost device fails every step): the thread stops stepping and calls ``on_broken``,
  so the worker stops instead of failing every job it takes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.db.models import INVALID_REQUEST, Job, JobStatus
from app.observability.engine_metrics import OwnEngineSeries
from app.services.dispatch import mark_dispatched, send_back, send_back_all
from app.services.streaming import USAGE, StreamEvent
from app.services.transitions import as_utc, transition, utcnow
from app.settings import Settings
from app.wire import storable
from gpu_runtime.request import RequestStatus
from workers import lease as leases
from workers.active_job import ActiveJob, ActiveJobs
from workers.inbox import (Abort, Add, Command, Inbox, JobCommand, Learn, Promote, ResetPrefixCache, Resume,
                           RetireLoras, Supersede)
from workers.outbox import Outbox, Record, StepRecords
from workers.sweeper import back_to_queues

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # no work at all: wait this long for the inbox
IDLE_BACKOFF_S = (0.001, 0.05)  # work admitted but nothing schedulable: first and longest sleep
KEPT_ABORT_LEASES = 5  # an aborted request the engine still holds this many leases after its abort: a leak


def refusal_code(exc: BaseException) -> str | None:
    """``INVALID_REQUEST`` where admitting a job raised over its own parameters (the client's to fix), else None."""
    return INVALID_REQUEST if isinstance(exc, ValueError | TypeError) else None


def back_to_queued(session: Session, job_ids: list[str], dispatched_by: datetime) -> None:
    """The dispatched jobs whose messages this worker sent (or handed back) and the broker never took, back to queued,
    where the next sweep sends them: each where no worker took it and no sweeper resent it since ``dispatched_by``
    (a resend marks ``dispatched_at`` anew)."""
    for job_id in job_ids:
        transition(session, job_id, JobStatus.DISPATCHED, JobStatus.QUEUED,
                   where=[Job.worker_id.is_(None), Job.dispatched_at <= dispatched_by],
                   detail="broker unavailable; the sweeper will send it")


def failed_attempt(lease: leases.Lease, error: str, code: str | None = None) -> tuple[dict[str, Any], StreamEvent]:
    """What a failed attempt writes on its job (``leases.finish``) and the event that ends its stream."""
    return ({"error": error, "error_code": code},
            StreamEvent("end", lease.attempt, status="failed", data={"error": error, "code": code}))


def relegation_detail(job: ActiveJob) -> str:
    """Why the engine shed the job, as far as its target says (the operator's job history): its tier, and whether its
    deadline had passed or was predicted to (QoServe 3.4: free work first, paid work that will miss anyway)."""
    req = job.request
    if req is None or job.created_at is None:
        return "engine relegated it"
    tier, q = req.qos.tier.value, req.qos
    if q.ttlt_s is None and job.first_token_recorded:
        return f"engine relegated it ({tier} tier): its stream fell behind its {q.tbt_s * 1e3:.0f} ms TBT"
    target, name = (q.ttlt_s, "TTLT") if q.ttlt_s is not None else (q.ttft_s, "TTFT")
    if target is None:
        return f"engine relegated it ({tier} tier)"
    due_in = (as_utc(job.created_at) + timedelta(seconds=target) - utcnow()).total_seconds()
    when = f"passed {-due_in:.1f} s ago" if due_in < 0 else f"predicted to be missed, due in {due_in:.1f} s"
    return f"engine relegated it ({tier} tier): its {target:g} s {name} deadline {when}"


def engine_state(engine: Any) -> dict[str, Any]:
    """A snapshot of the engine for the worker's row (KV, queues, speculation, last step), its counters since the
    worker started among them: the API's ``/metrics`` exports them per worker."""
    state: dict[str, Any] = {}
    try:
        cap = engine.executor.capacity()
        state.update(kv_total_blocks=cap.total_blocks, kv_free_blocks=cap.free_blocks,
                     kv_usage=round(cap.usage, 4), kv_recomputes=engine.num_recomputes)
        state["queues"] = engine.scheduler.queue_depths()
        calibration = getattr(engine.scheduler, "calibration_state", None)  # the vLLM backend's
        if calibration is not None:
            state["cost_calibration"] = calibration()
        state["speculation"] = engine.speculation.state()
        state["draft_on_device"] = bool(engine.executor.draft_on_device)
        drafter = getattr(engine.executor, "drafter", None)
        state["drafter"] = type(drafter).__name__ if drafter is not None else None
        if (pool_short := getattr(drafter, "num_pool_short", None)) is not None:  # a draft model's own KV pool
            state["draft_pool_short"] = pool_short  # requests it drafted shallower trees for, or none
        stats = engine.last_stats
        state["last_step"] = {"latency_s": stats.step_latency_s, "decodes": stats.num_decodes,
                              "prefill_tokens": stats.num_prefill_tokens}
    except Exception as exc:  # the dashboard gets less detail, the heartbeat still beats
        state["state_error"] = str(exc)
    return state


def step_error(exc: Exception) -> str:
    """What each job a step that raised fails is told: the error's kind, not its text. The step ran many tenants'
    requests, and the text may quote one of them (its prompt, its schema, its id); the worker's log has it whole."""
    return f"engine error: a step of the engine raised {type(exc).__name__} (the worker's log says why)"


class EngineThread:
    def __init__(self, engine: Any, active: ActiveJobs, inbox: Inbox, outbox: Outbox, settings: Settings,
                 worker_id: str, stopping: threading.Event, reconcile_s: float | None = None,
                 on_broken: Callable[[str], None] | None = None,
                 on_kept_abort: Callable[[str], None] | None = None,
                 series: OwnEngineSeries | None = None) -> None:
        self.engine = engine
        self.series = series  # the vLLM series the own engine observes here (vLLM's observes its own: None)
        self.active = active
        self.inbox = inbox
        self.outbox = outbox
        self.settings = settings
        self.worker_id = worker_id
        self.stopping = stopping
        self.reconcile_s = reconcile_s if reconcile_s is not None else settings.heartbeat_seconds
        self.failed_steps = 0  # steps that raised since the engine last made a token
        self.broken: str | None = None  # why the engine was given up on; the loop then ends
        self.on_broken = on_broken
        self.on_kept_abort = on_kept_abort  # told once, why, where the engine keeps aborted requests (a leak)
        self.kept_abort: str | None = None
        self._next_reconcile = time.monotonic() + self.reconcile_s
        self._idle_sleep = 0.0
        # job id -> a promote that came before the job's add, and when (``time.monotonic``): applied on the add
        self._promotes_before_add: dict[str, tuple[Promote, float]] = {}
        self.state: dict[str, Any] = {}  # the engine's facts for the heartbeat, refreshed by this thread
        self.refresh_state()

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        while not self.stopping.is_set() and self.broken is None:
            self.outbox.put(self.iterate())
        if self.broken is not None and self.on_broken is not None:
            self.on_broken(self.broken)

    def iterate(self) -> StepRecords:
        """One turn: commands, maybe a step, the records they produced (sleeps when there is nothing to do)."""
        step = StepRecords(records=self._apply(self.inbox.drain()))
        if not self.engine.has_work:
            step.records += self._reconcile_if_due()
            if not step:
                self.inbox.wait(IDLE_WAIT_S)
            return step
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; giving its jobs back to the queue")
            step.records += self.fail_all(step_error(exc))
            self.failed_steps += 1
            if self.failed_steps >= self.settings.engine_error_limit:
                self.broken = f"{self.failed_steps} engine steps failed with no token made between them ({exc})"
                log.critical("the engine of %s is broken: %s", self.worker_id, self.broken)
            return step
        produced = self._records(outputs)
        if produced.deltas:  # tokens made: whatever failed before, the engine works
            self.failed_steps = 0
        step.deltas += produced.deltas
        step.records += produced.records + self._reconcile_if_due()
        self._pace(bool(outputs))
        return step

    def _pace(self, produced: bool) -> None:
        """Sleeps on the inbox while the engine has work it cannot schedule (no busy spin)."""
        if produced or not getattr(self.engine, "idle", False):
            self._idle_sleep = 0.0
            return
        first, longest = IDLE_BACKOFF_S
        self._idle_sleep = min(longest, max(first, self._idle_sleep * 2))
        self.inbox.wait(self._idle_sleep)

    # ---------------------------------------------------------------- commands
    def _apply(self, commands: list[Command]) -> list[Record]:
        records: list[Record] = []
        for cmd in commands:
            job = self.active.get(cmd.job_id) if isinstance(cmd, JobCommand) else None
            if isinstance(cmd, Add):
                if job is None or job.finished:
                    continue
                self._apply_promote_before_add(job)
                try:
                    self.engine.add_request(job.request)
                    job.in_engine = True
                except Exception as exc:  # bad input the API could not catch: fail this attempt only
                    log.warning("job %s failed at admission: %s", cmd.job_id, exc)
                    job.finished = True
                    records.append(self._failure(job, str(exc), "rejected by the engine", refusal_code(exc)))
            elif isinstance(cmd, Abort):
                if (job is not None and job.in_engine and not job.finished
                        and cmd.attempt in (None, job.lease.attempt)):
                    self._send_abort(job)
            elif isinstance(cmd, Supersede):
                if job is not None and job.lease.attempt == cmd.attempt:
                    self._set_aside(job)
                records.append(self._hand_back_rerun(cmd))
            elif isinstance(cmd, Resume):
                if job is not None and job.in_engine:
                    self.engine.resume(job.request_id)
            elif isinstance(cmd, Promote):
                if job is not None and job.in_engine:
                    self.engine.promote(job.request_id, cmd.tier)
                else:  # written after the lease, before the intake's add: kept for it
                    self._promotes_before_add[cmd.job_id] = (cmd, time.monotonic())
            elif isinstance(cmd, Learn):
                for key, n in cmd.lengths:
                    self.engine.scheduler.history.record(key, n)
            elif isinstance(cmd, ResetPrefixCache):
                try:
                    cmd.done.set_result(self.engine.reset_prefix_cache(cmd.reset_running_requests))
                except Exception as exc:  # noqa: BLE001 - the operator hears why; the engine goes on
                    cmd.done.set_exception(exc)
            elif isinstance(cmd, RetireLoras):
                try:
                    self.engine.retire_loras(cmd.loaded)
                except Exception:  # the adapters stay loaded until the next beat's word; the engine goes on
                    log.exception("the engine could not take the runtime adapters to retire by")
        return records

    def _apply_promote_before_add(self, job: ActiveJob) -> None:
        """The tier of a promote that came before the job's add (the admin wrote it after the lease read the tier,
        and the intake had not registered or added the job yet), on its request: the attempt runs at the tier SQL
        holds. One for another attempt is dropped: a later attempt's lease read the tier after that promote."""
        kept = self._promotes_before_add.pop(job.job_id, None)
        if kept is not None and kept[0].attempt in (None, job.lease.attempt):
            job.request.qos = replace(job.request.qos, tier=kept[0].tier)

    def _forget_promotes_before_add(self) -> None:
        """Drops the promotes kept a lease ago or more: an attempt leased here is added within its lease or has lost
        it (the heartbeat renews only the jobs the intake registered), so theirs never comes."""
        bound = time.monotonic() - self.settings.lease_seconds
        self._promotes_before_add = {job_id: kept for job_id, kept in self._promotes_before_add.items()
                                     if kept[1] > bound}

    def _send_abort(self, job: ActiveJob) -> None:
        self.engine.abort(job.request_id)
        if job.abort_sent_at is None:  # the first abort starts the wait for the engine's word
            job.abort_sent_at = time.monotonic()

    def _set_aside(self, job: ActiveJob) -> None:
        """A rerun of the job replaces this attempt here (its lease was lost): aborted where the engine holds it, and
        set aside; whatever the engine says of it from now on names an attempt not served, and writes nothing. Its
        stream events so far are in the outbox already (this thread made them), for the rerun to go on from."""
        if job.finished or not job.in_engine:  # the engine is done with it, or never had it: it only leaves
            job.finished = True
            self.active.pop(job.job_id, job.lease.attempt)
            return
        self._send_abort(job)
        job.finished = True
        self.active.abandon(job)

    def _hand_back_rerun(self, cmd: Supersede) -> Record:
        """The message of the rerun that superseded an attempt here, which the intake gave over (``Supersede``), back
        to the head of its queue once that attempt is set aside and its last stream events are published
        (``Record.after_events``): a take, here or on another worker, goes on from all of them
        (``GpuWorker._resumed``). A send the broker refuses is retried as a failed write is; where it is given up on,
        or still held or retried when the outbox closes at stop while Redis is away, the job goes back to queued,
        where the next sweep sends it (left dispatched, it waited for the sweeper's rule for a lost message,
        ``max(30, 5 x lease)`` s)."""
        url, given_over = self.settings.redis_url, utcnow()  # the rerun's message was sent before: taken here

        def write(_s: Session) -> None:
            if not send_back(url, cmd.job_id, cmd.queue, cmd.priority):
                raise RuntimeError(f"the broker did not take the message of job {cmd.job_id} back")
        given_up = Record(f"the return to queued of {cmd.job_id}, whose message the broker refused",
                          lambda s: back_to_queued(s, [cmd.job_id], given_over))
        return Record(f"the message of {cmd.job_id} back to {cmd.queue}", write, for_job=cmd.job_id,
                      after_events=True, if_given_up=given_up)

    # ---------------------------------------------------------------- outputs -> records
    def _records(self, outputs: list[Any]) -> StepRecords:
        step = StepRecords()
        first_tokens: list[ActiveJob] = []
        now = time.monotonic()  # the step's end: its tokens' time
        for out in outputs:
            job = self.active.serving(out.request_id)  # the attempt it names, while it is served here
            if job is None and out.finished:  # a set-aside attempt's request ended at last
                self.active.forget(out.request_id)
            if job is None or job.finished:
                continue
            attempt = job.lease.attempt
            if out.new_token_ids and not job.first_token_recorded:
                job.first_token_recorded = True
                first_tokens.append(job)
            data = {}
            if out.prompt_logprobs and job.prompt_logprobs is None:  # a recomputed prompt reports them again
                job.prompt_logprobs = [lp.as_dict() for lp in out.prompt_logprobs]
                data["prompt_logprobs"] = job.prompt_logprobs  # with the first token: a stream's echo needs them
            if out.new_logprobs:  # with their index in the attempt's logprobs, as offset places the text
                data |= {"logprobs": [lp.as_dict() for lp in out.new_logprobs], "logprobs_offset": len(job.logprobs)}
                job.logprobs.extend(data["logprobs"])
            if out.new_token_ids:  # their index in the attempt's ids: a follower cuts those a rerun repeats
                data["token_offset"] = job.tokens
                job.tokens += len(out.new_token_ids)
                self._inter_token_latency(job, now)
            if out.new_text or out.new_token_ids:
                text = storable(out.new_text)  # the stream says what SQL will hold
                if job.reasoning is not None:
                    job.reasoning.feed(text, len(out.new_token_ids))
                job.text.append(text)
                step.deltas.append((job.job_id, StreamEvent("delta", attempt, text, list(out.new_token_ids),
                                                            data=data, offset=job.produced)))
                job.produced += len(text)
            if out.event == "rejected":  # the engine could not admit it (bad input): fail this job only
                job.finished = True
                if out.error is not None:  # the request's own parameters: the client's to fix
                    record = self._failure(job, f"the engine refused the request: {out.error}",
                                           "rejected by the engine", INVALID_REQUEST)
                else:
                    record = self._failure(job, "the engine could not take the request (see the worker log)",
                                           "rejected by the engine")
                step.records.append(record)
                continue
            if out.event in ("relegated", "resumed"):
                self.active.set_relegated(job, out.event == "relegated")
                step.records.append(self._relegation(job, out.event))
            if out.finished:
                job.finished = True
                step.records.append(self._completion(job, out))
        if first_tokens:
            step.records.insert(0, self._first_tokens(first_tokens))
        return step

    def _inter_token_latency(self, job: ActiveJob, now: float) -> None:
        """Observes the time since the step that last gave ``job`` tokens, as vLLM's inter-token latency does (one
        observation a step, however many tokens it gave)."""
        if self.series is not None and job.last_token_at is not None:
            self.series.inter_token_latency.observe(now - job.last_token_at)
        job.last_token_at = now

    def _first_tokens(self, jobs: list[ActiveJob]) -> Record:
        """One write per step for the jobs whose first token came out in it (dashboard, job resource)."""
        now, keys = utcnow(), [(j.job_id, j.lease.attempt) for j in jobs]

        def write(s: Session) -> None:
            for job_id, attempt in keys:
                s.execute(update(Job).where(Job.id == job_id, Job.attempt == attempt, Job.first_token_at.is_(None))
                          .values(first_token_at=now))
        return Record(f"first tokens of {len(keys)} jobs", write)

    def _relegation(self, job: ActiveJob, event: str) -> Record:
        src, dst = ((JobStatus.RUNNING, JobStatus.RELEGATED) if event == "relegated"
                    else (JobStatus.RELEGATED, JobStatus.RUNNING))
        values = {"relegation_count": Job.relegation_count + 1} if event == "relegated" else {}
        lease = job.lease
        detail = relegation_detail(job) if event == "relegated" else "engine resumed it"

        def write(s: Session) -> bool:
            return transition(s, lease.job_id, src, dst, worker_id=self.worker_id, attempt=lease.attempt,
                              detail=detail, values=values)
        return Record(f"{event} {lease.job_id}", write,
                      [(lease.job_id, StreamEvent("status", lease.attempt, status=event))], for_job=lease.job_id)

    def _completion(self, job: ActiveJob, out: Any) -> Record:
        if out.status is RequestStatus.FINISHED_ABORTED:
            return self._abort(job, out)
        if out.status is RequestStatus.FINISHED_EXPIRED:
            return self._expiry(job, out)
        m = out.metrics
        reason = "length" if out.status is RequestStatus.FINISHED_LENGTH else "stop"
        output = self._output(job, m)
        stop_reason = job.request.stop_reason  # the stop string or token id that ended it (vLLM's stop_reason)
        kept = {**output, **self._timings(m)}  # what it keeps where a cancel came as it finished
        values = {**kept, "finish_reason": reason, "stop_reason": stop_reason,
                  "tbt_p50_s": m.tbt_p50_s, "tbt_p99_s": m.tbt_p99_s, "ttlt_s": m.ttlt_s,
                  "slo_met": m.slo_met,
                  "slo_miss": m.slo_miss.as_dict() if getattr(m, "slo_miss", None) else None,
                  "first_token_at": job.created_at + timedelta(seconds=m.ttft_s) if m.ttft_s is not None else None}
        lease = job.lease
        end = StreamEvent("end", lease.attempt, status="succeeded", finish_reason=reason,
                          data={**{k: output[k] for k in USAGE}, "stop_reason": stop_reason, "metrics": m.as_dict()})

        def write(s: Session) -> bool | list[tuple[str, StreamEvent]]:
            if leases.finish(s, lease, JobStatus.SUCCEEDED, values, detail=f"finished ({reason})"):
                return True
            if leases.keep_cancelled(s, lease, kept):  # cancelled as it finished: its output stays, as an abort's
                return self._kept(lease, kept)
            return False
        return Record(f"the result of {lease.job_id}", write, [(lease.job_id, end)], leaving=lease)

    def _abort(self, job: ActiveJob, out: Any) -> Record:
        """The engine stopped the job: the API cancelled it, or the worker lost its lease. A job this attempt ran
        until the API cancelled it keeps what the engine produced (its text so far, its token counts: billed as
        OpenAI bills a cancelled request; a prompt the engine began is billed with no output); a lost lease writes
        nothing (the job runs again). The API ended the stream as it cancelled; a ``kept`` event after that end
        tells it this worker is done with the job and wrote what it keeps."""
        lease, produced = job.lease, self._produced(job, out.metrics)
        return Record(f"the partial result of {lease.job_id}", lambda s: leases.keep_cancelled(s, lease, produced),
                      self._kept(lease, produced), leaving=lease)

    @staticmethod
    def _kept(lease: Any, produced: dict[str, Any] | None) -> list[tuple[str, StreamEvent]]:
        """The event that says the worker wrote what a cancelled attempt keeps (its usage, if any)."""
        usage = {k: produced.get(k) for k in USAGE} if produced else {}
        return [(lease.job_id, StreamEvent("kept", lease.attempt, status="cancelled", data=usage))]

    @classmethod
    def _produced(cls, job: ActiveJob, m: Any) -> dict[str, Any] | None:
        """What a job that ends cancelled keeps of its attempt: its output so far, or no output where the engine
        had begun its prompt only (None: the engine never scheduled it, or did not count)."""
        started = m is not None and (m.num_output_tokens or m.queue_s is not None or job.resumed is not None)
        return {**cls._output(job, m), **cls._timings(m)} if started else None

    @staticmethod
    def _timings(m: Any) -> dict[str, float | None]:
        """When the engine began the job's prompt and made its first token: a job cancelled after them keeps them
        too, as vLLM records a request's time to first token when the token comes, whatever ends the request."""
        return {"queue_s": m.queue_s, "ttft_s": m.ttft_s}

    @staticmethod
    def _output(job: ActiveJob, m: Any) -> dict[str, Any]:
        """The job's columns of what its attempt produced: text, token counts, the logprobs it asked for (a rerun
        that went on from an earlier attempt's tokens: theirs too, each token counted once, the prompt as billed)."""
        out = {"output_text": "".join(job.text), "completion_tokens": m.num_output_tokens,
               "prompt_tokens": job.request.prompt_len, "cached_tokens": m.num_cached_tokens,
               "cache_write_tokens": m.num_cache_write_tokens,
               "reasoning_tokens": job.reasoning.count if job.reasoning is not None else None,
               # every job's, as its stream sent them: a replay from SQL sends them again (the job resource and the
               # answers show them where the job asked: return_token_ids)
               "output_token_ids": job.output_token_ids,
               "output_logprobs": job.logprobs if job.request.sampling.logprobs is not None else None,
               "prompt_logprobs": job.prompt_logprobs}
        if job.resumed is not None:
            out.update(job.resumed.usage(m.num_output_tokens, m.num_cached_tokens, m.num_cache_write_tokens))
        return out

    @classmethod
    def _expiry(cls, job: ActiveJob, out: Any) -> Record:
        """The scheduler gave up on a job it had relegated under overload (past its expiry): expired, SLO missed.
        One relegated after its first tokens keeps what it produced, as a cancelled one does: a stream sent them,
        and the engine ran them (the usage, the metrics' token counts)."""
        lease, produced = job.lease, cls._produced(job, out.metrics) or {}
        tokens = produced.get("completion_tokens")
        error = ("relegated under overload and expired " + (f"after {tokens} of its tokens" if tokens else
                 "before its first token") + " (its deadline had long passed)")
        usage = {k: produced[k] for k in USAGE} if tokens else {}
        end = StreamEvent("end", lease.attempt, status="expired", data={"error": error, **usage})

        def write(s: Session) -> bool:
            return leases.finish(s, lease, JobStatus.EXPIRED, {**produced, "error": error, "slo_met": False},
                                 detail="expired: relegated under overload")
        return Record(f"the expiry of {lease.job_id}", write, [(lease.job_id, end)], leaving=lease)

    @staticmethod
    def _failure(job: ActiveJob, error: str, detail: str, code: str | None = None) -> Record:
        """``code``: ``INVALID_REQUEST`` where the request's own parameters failed it (else None)."""
        lease = job.lease
        values, end = failed_attempt(lease, error, code)

        def write(s: Session) -> bool:
            return leases.finish(s, lease, JobStatus.FAILED, values, detail=detail)
        return Record(f"the failure of {lease.job_id}", write, [(lease.job_id, end)], leaving=lease)

    # ---------------------------------------------------------------- giving jobs back
    def fail_all(self, error: str) -> list[Record]:
        """A step raised: every job in the engine goes back to the queue and is sent again at once (another
        attempt, maybe on another worker; one back here runs beside its aborted request, under its own request id);
        a job on its last allowed attempt fails instead, so a request that breaks every engine it meets cannot
        circulate forever."""
        records, requeued = [], []
        for job in self.active.snapshot():
            if job.finished:
                continue
            job.finished = True
            if job.in_engine:  # set aside: a rerun added here meanwhile goes beside it, under its own request id
                self._send_abort(job)
                self.active.abandon(job)
            if job.lease.attempt >= self.settings.max_attempts:
                records.append(self._failure(job, f"{error} (gave up after {job.lease.attempt} attempts)",
                                             "engine error"))
            else:
                records.append(self._give_back(job, f"engine error on {self.worker_id}; requeued"))
                requeued.append(job.job_id)
        if records:
            log.warning("engine error: gave back %d jobs (%d to requeue)", len(records), len(requeued))
        return records + self._resend(requeued)  # after their give-backs: each is queued when it is sent

    @staticmethod
    def _give_back(job: ActiveJob, detail: str) -> Record:
        lease = job.lease
        return Record(f"the release of {lease.job_id}", lambda s: leases.release(s, lease, detail),
                      leaving=lease)

    def _resend(self, job_ids: list[str]) -> list[Record]:
        """The jobs given back (``job_ids``, first admitted first) sent again at once: marked dispatched as soon as
        their give-backs are written (the sweeper sends only queued jobs, so none sends them meanwhile), and their
        messages sent once the stream events queued before are published (``Record.after_events``): a take, here or
        on another worker of the model, goes on from every token their attempts streamed (``GpuWorker._resumed``).
        A send the broker refuses is retried as a failed write is (dispatched meanwhile: no sweep sends them before
        those events are out); the jobs of one given up on, or still held or retried when the outbox closes at stop
        while Redis is away, go back to queued, where the next sweep sends them (left dispatched, they waited for the
        sweeper's rule for a lost message, ``max(30, 5 x lease)`` s)."""
        if not job_ids:
            return []
        url = self.settings.redis_url
        unsent: list[tuple[str, str, int]] = []  # marked dispatched, message not sent yet; first admitted first
        marked_by: list[datetime] = []  # when the mark committed: a later dispatched_at is a sweeper's resend (sent)

        def mark(s: Session) -> None:  # each commits: a retry after a partial mark finds those marked moved on
            # each on the queue dispatch sends its model to: a configured adapter's own, which a worker of the
            # model without that adapter does not read (on the model's it would fail the job)
            rows = {row.id: row for row in s.execute(select(Job.id, Job.model, Job.kind).where(Job.id.in_(job_ids)))}
            for job_id, queue, priority in back_to_queues(s, [rows[job_id] for job_id in job_ids if job_id in rows]):
                if mark_dispatched(s, job_id, detail="requeued after an engine error"):
                    unsent.append((job_id, queue, priority))
            marked_by[:] = [utcnow()]

        def send(_s: Session) -> None:
            # they ran, so they came before every message waiting: to the head, the first admitted taken first
            sent = set(send_back_all(url, unsent))
            unsent[:] = [job for job in unsent if job[0] not in sent]  # older ones, to the head before these later
            if unsent:
                raise RuntimeError(f"the broker did not take the messages of {len(unsent)} jobs")

        given_up = Record(f"the return to queued of {len(job_ids)} jobs whose messages the broker refused",
                          lambda s: back_to_queued(s, [job_id for job_id, _queue, _priority in unsent], marked_by[0]))
        return [Record(f"the resend of {len(job_ids)} jobs", mark,
                       then=Record(f"the messages of {len(job_ids)} jobs", send, after_events=True,
                                   if_given_up=given_up))]

    def _reconcile_if_due(self) -> list[Record]:
        now = time.monotonic()
        if now < self._next_reconcile:
            return []
        self._next_reconcile = now + self.reconcile_s
        self.refresh_state()
        return self.reconcile()

    def refresh_state(self) -> None:
        """A snapshot of the engine for the worker's row (KV, queues, speculation, last step)."""
        self.state = engine_state(self.engine)
        if self.series is not None and isinstance(self.state.get("queues"), dict):
            self.series.scheduler_state(self.state["queues"])
        spec_decode = getattr(self.engine, "spec_decode", None)  # the own engine's totals
        if self.series is not None and spec_decode is not None and getattr(self.engine.executor, "has_draft", False):
            self.series.spec_decode(spec_decode)

    def reconcile(self) -> list[Record]:
        """Jobs the worker holds that the engine no longer knows go back to the queue; those whose abort it has
        not confirmed for a lease are abandoned; an engine that keeps aborted requests is given up on."""
        self._forget_promotes_before_add()
        records = self._abandon_unconfirmed_aborts()
        live = getattr(self.engine, "requests", None)
        if not isinstance(live, dict):
            return records
        for request_id in self.active.abandoned_ids():
            if request_id not in live:
                self.active.forget(request_id)
        self._notice_kept_aborts()
        for job in self.active.snapshot():
            if job.in_engine and not job.finished and job.request_id not in live:
                log.warning("job %s is held by this worker but not in its engine; giving it back", job.job_id)
                job.finished = True
                records.append(self._give_back(job, f"lost by the engine of {self.worker_id}; requeued"))
                records += self._resend([job.job_id])
        return records

    def _abandon_unconfirmed_aborts(self) -> list[Record]:
        """Sets aside each job whose abort the engine has not confirmed (no finished output) for ``lease_seconds``,
        the bound the heartbeat renews a stopped job's lease for (``leases.renew``): its slot comes back, and where
        the API cancelled it, it settles now with what its stream carried (``_streamed``: the engine's own counts are
        not known)."""
        bound = time.monotonic() - self.settings.lease_seconds
        records = []
        for job in self.active.snapshot():
            if job.finished or job.abort_sent_at is None or job.abort_sent_at > bound:
                continue
            log.warning("the engine of %s never confirmed the abort of job %s (%.0f s); it no longer counts against "
                        "the worker's room", self.worker_id, job.job_id, time.monotonic() - job.abort_sent_at)
            job.finished = True
            self.active.abandon(job)
            lease, streamed = job.lease, self._streamed(job)
            records.append(Record(f"the abandoned abort of {lease.job_id}",
                                  lambda s, lease=lease, streamed=streamed: leases.keep_cancelled(s, lease, streamed),
                                  self._kept(lease, streamed), for_job=lease.job_id))
        return records

    @staticmethod
    def _streamed(job: ActiveJob) -> dict[str, Any] | None:
        """What a cancelled job whose abort the engine never confirmed keeps: the text and tokens its stream carried,
        billed as they went out (a rerun's, from the tokens it went on from); None where it streamed none. The
        engine's cache counts are not known."""
        if not job.tokens:
            return None
        prompt = job.resumed.prompt_len if job.resumed is not None else job.request.prompt_len
        return {"output_text": "".join(job.text), "completion_tokens": job.tokens, "prompt_tokens": prompt}

    def _notice_kept_aborts(self) -> None:
        """Set-aside attempts no longer wait for the engine to let their requests go (a rerun goes beside them), so
        nothing else would notice an engine that keeps them: each holds KV blocks and a slot for good. One the engine
        still holds ``KEPT_ABORT_LEASES`` leases after its abort is such a leak: the worker is told (``on_kept_abort``,
        once), and gives the engine up (it stops; a fresh engine lets them go)."""
        if self.kept_abort is not None:
            return
        bound = time.monotonic() - KEPT_ABORT_LEASES * self.settings.lease_seconds
        kept = [job for job in self.active.abandoned() if job.abort_sent_at is not None and job.abort_sent_at <= bound]
        if not kept:
            return
        self.kept_abort = (f"the engine kept the aborted request of job {kept[0].job_id} (attempt "
                           f"{kept[0].lease.attempt}) {KEPT_ABORT_LEASES} leases after its abort"
                           + (f", and {len(kept) - 1} more" if len(kept) > 1 else ""))
        log.critical("worker %s: %s", self.worker_id, self.kept_abort)
        if self.on_kept_abort is not None:
            self.on_kept_abort(self.kept_abort)
