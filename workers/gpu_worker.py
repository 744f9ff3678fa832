"""The long-lived GPU worker: one process per device, one engine, model loaded once.

Shape (measured choice, see the report): the process loads the model, then runs a Celery
consumer (solo pool) in the main thread beside four threads:

* engine: calls ``Engine.step()`` while there is work; streams deltas to Redis; writes
  completions, relegations and resumptions back to SQL;
* heartbeat: renews the leases of its jobs, writes the ``workers`` row (KV usage, queue
  depths, speculation state), notices cancelled/lost jobs and ``draining``;
* sweeper: ``workers.sweeper.sweep`` every ``sweep_seconds``;
* cancel listener: Redis pub/sub for prompt aborts (the heartbeat poll is the fallback).

The Celery task only leases the job and hands it to the engine; it blocks while the
engine is full, so an idle worker beside this one gets the next message.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from importlib import import_module
from typing import Any

import redis
from celery.signals import worker_shutting_down
from sqlalchemy import select, update

from app.db.migrate import upgrade
from app.db.models import Job, JobStatus, WorkerState
from app.db.session import session_scope
from app.services.dispatch import dispatch, send_job
from app.services.model_info import encode_input, get_tokenizer
from app.services.streaming import CANCEL_CHANNEL, StreamEvent, publish
from app.services.transitions import ACTIVE, as_utc, transition, utcnow
from app.settings import Settings
from gpu_runtime.factory import build_engine, resolve_device
from gpu_runtime.qos import QoSClass, QoSSpec, TbtAnchor, Tier
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.sampling import SamplingParams
from workers import decode_history
from workers import lease as leases
from workers.celery_app import get_celery, queue_name
from workers.control import start_control_listener
from workers.batch_tasks import finalize_open_batches, restart_stalled_validation
from workers.sweeper import sweep

log = logging.getLogger(__name__)

MAX_INFLIGHT = int(os.environ.get("COSERVE_MAX_INFLIGHT", "64"))  # jobs in the engine before the task waits


@dataclass
class ActiveJob:
    lease: leases.Lease
    request: Request
    created_at: Any
    text: list[str] = field(default_factory=list)
    relegated: bool = False
    first_token_recorded: bool = False


class GpuWorker:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.url = settings.sqlalchemy_url
        self.queue = queue_name(settings.model_name)
        self.device = resolve_device(settings.device)
        self.backend = settings.engine_backend if not os.environ.get("COSERVE_ENGINE_FACTORY") else "custom"
        self.active: dict[str, ActiveJob] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.draining = False
        self.shutting_down = False  # Celery began a warm shutdown
        self.requeued: list[str] = []  # given back after an engine error, to send after the next step
        self.engine: Any = None
        self.redis = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2.0, socket_timeout=5.0)
        self.threads: list[threading.Thread] = []
        self.peers: decode_history.PeerLengths | None = None  # what the model's other workers finish
        self.peer_lengths: list[tuple[str, int]] = []  # read by the heartbeat, recorded by the engine thread

    # ---------------------------------------------------------------- life cycle
    def start(self) -> None:
        t0 = time.monotonic()
        self.tokenizer = get_tokenizer(self.settings.model)
        self.engine = self._build_engine()
        log.info("worker %s: %s engine ready on %s in %.1fs", self.worker_id, self.backend, self.device,
                 time.monotonic() - t0)
        history = getattr(self.engine.scheduler, "history", None)
        if history is not None:  # predicted output lengths (KV admission, batch deadlines) from what finished
            self.peers = decode_history.PeerLengths(self.settings.model_name, self.worker_id, since=utcnow())
            with session_scope(self.url) as s:
                decode_history.seed(history, decode_history.finished_lengths(s, self.settings.model_name))
        self._register()
        # operator actions from the dashboard (resume, promote) arrive over Redis pub/sub
        self.threads.append(start_control_listener(self.engine, self.worker_id, self.settings.redis_url,
                                                   self.stopping))
        for name, fn in (("engine", self._engine_loop), ("heartbeat", self._heartbeat_loop),
                         ("sweeper", self._sweeper_loop), ("cancel", self._cancel_loop)):
            t = threading.Thread(target=fn, name=f"coserve-{name}", daemon=True)
            t.start()
            self.threads.append(t)

    def _build_engine(self) -> Any:
        s = self.settings
        factory = os.environ.get("COSERVE_ENGINE_FACTORY")  # "module:function" to swap the stack (benchmarks)
        if factory:
            build = getattr(import_module(factory.split(":")[0]), factory.split(":")[1])
        elif self.backend == "vllm":
            from gpu_runtime.vllm.build import build_vllm_engine

            return build_vllm_engine(s.model, device=self.device, scheduler_policy=s.scheduler_policy,
                                     spec_policy=s.spec_policy, cost_profile=s.cost_profile, kv_reserve=s.kv_reserve,
                                     kv_cache_gib=s.vllm_kv_cache_gib, enforce_eager=s.vllm_enforce_eager,
                                     max_model_len=s.vllm_max_model_len)
        else:
            build = build_engine
        return build(s.model, device=self.device, scheduler_policy=s.scheduler_policy, spec_policy=s.spec_policy,
                     kv_blocks=s.kv_blocks, draft=s.draft if s.spec_policy != "none" else None,
                     cost_profile=s.cost_profile, kv_reserve=s.kv_reserve, tokenizer=self.tokenizer)

    def stop(self, grace_s: float = 10.0) -> None:
        """Lets running jobs finish for ``grace_s``, then gives the rest back to the queue."""
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            time.sleep(0.1)
        self.stopping.set()
        self.wake.set()
        for t in self.threads:
            if t.name == "coserve-engine":
                t.join(5)
        with self.lock:
            rest = list(self.active.values())
            self.active.clear()
        with session_scope(self.url, immediate=True) as s:
            for job in rest:
                if leases.release(s, job.lease, f"worker {self.worker_id} shut down"):
                    send_job(self.settings.redis_url, job.lease.job_id, self.settings.model_name)
            row = s.get(WorkerState, self.worker_id)
            if row is not None:
                s.delete(row)
        log.info("worker %s stopped (%d jobs given back)", self.worker_id, len(rest))

    def _register(self) -> None:
        with session_scope(self.url, immediate=True) as s:
            row = s.get(WorkerState, self.worker_id)
            if row is None:
                row = WorkerState(id=self.worker_id, model=self.settings.model_name, queue=self.queue,
                                  device=self.device)
                s.add(row)
            row.started_at = row.heartbeat_at = utcnow()
            row.draining = False
            row.state = self._state()

    # ---------------------------------------------------------------- intake (Celery task)
    def accept(self, job_id: str) -> None:
        """Lease ``job_id`` and add it to the engine; waits while the engine is full."""
        holding = False
        while len(self.active) >= MAX_INFLIGHT or self.draining:
            if self.stopping.is_set() or self.shutting_down or self.draining:
                # hand it back for another worker; a draining worker pauses so the message
                # does not bounce between it and the broker
                if self.draining:
                    time.sleep(1.0)
                if holding:
                    self._hold(job_id, False)
                send_job(self.settings.redis_url, job_id, self.settings.model_name)
                return
            if not holding:
                # the message is unacked in our hands: if we die now, the sweeper sees our stale
                # heartbeat on the row and resends the job instead of waiting for redelivery
                self._hold(job_id, True)
                holding = True
            time.sleep(0.02)
        with session_scope(self.url, immediate=True) as s:
            lease = leases.acquire(s, job_id, self.worker_id, self.settings.lease_seconds)
            if lease is None:
                log.info("job %s is not pending any more; message dropped", job_id)
                return
            job = s.get(Job, job_id)
            try:
                request = self._request(job)
                # registered before the engine sees it, so its first outputs are not dropped
                with self.lock:
                    self.active[job_id] = ActiveJob(lease, request, as_utc(job.created_at))
                self.engine.add_request(request)
            except Exception as exc:  # bad input the API could not catch: fail this attempt only
                with self.lock:
                    self.active.pop(job_id, None)
                log.warning("job %s failed at admission: %s", job_id, exc)
                leases.finish(s, lease, JobStatus.FAILED, {"error": str(exc)}, detail="rejected by the engine")
                self._publish([(job_id, StreamEvent("end", attempt=lease.attempt, status="failed",
                                                    data={"error": str(exc)}))])
                return
        self.wake.set()

    def _hold(self, job_id: str, held: bool) -> None:
        """Marks (or unmarks) a still-dispatched job as held by this worker while it waits for room."""
        try:
            with session_scope(self.url, immediate=True) as s:
                s.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.DISPATCHED.value)
                          .values(worker_id=self.worker_id if held else None)
                          .execution_options(synchronize_session=False))
        except Exception:  # best effort: without the mark the sweeper's age rule still recovers it
            log.exception("could not record the holder of job %s", job_id)

    def _request(self, job: Job) -> Request:
        ids = encode_input(self.settings.model, job.prompt, job.messages)
        sp = job.sampling or {}
        sampling = SamplingParams(max_tokens=int(sp.get("max_tokens", self.settings.default_max_tokens)),
                                  temperature=float(sp.get("temperature", 0.0)), top_p=float(sp.get("top_p", 1.0)),
                                  stop=tuple(sp.get("stop") or ()), seed=sp.get("seed"),
                                  ignore_eos=bool(sp.get("ignore_eos", False)))
        try:
            tier = Tier(job.tier)
        except ValueError:
            tier = Tier.PAID if job.tier == self.settings.tiers[-1] else Tier.FREE
        created = as_utc(job.created_at)
        if job.kind == "batch":
            qos = QoSSpec(QoSClass.BATCH, tier, ttlt_s=max(1e-3, (as_utc(job.deadline_at) - created).total_seconds()))
        else:
            qos = QoSSpec(QoSClass.INTERACTIVE, tier, ttft_s=(job.ttft_ms or self.settings.default_ttft_ms) / 1e3,
                          tbt_s=(job.tbt_ms or self.settings.default_tbt_ms) / 1e3,
                          tbt_anchor=TbtAnchor(job.tbt_anchor or self.settings.tbt_anchor))
        # arrival on the engine clock = when the job was submitted, so queueing counts against TTFT
        waited = (utcnow() - created).total_seconds()
        return Request(job.id, ids, sampling, qos, arrival_time=self.engine.executor.now() - max(0.0, waited),
                       app_id=decode_history.history_key(job.app_id, job.tenant_id, job.kind))

    # ---------------------------------------------------------------- engine thread
    def _engine_loop(self) -> None:
        while not self.stopping.is_set():
            if not self.engine.has_work and not self.requeued:
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            # jobs given back after an engine error are sent again only once a step has taken
            # their aborts: sent earlier, one could come back here and its abort hit the new run
            requeued, self.requeued = self.requeued, []
            self._learn_from_peers()
            try:
                outputs = self.engine.step()
            except Exception as exc:
                log.exception("engine step failed; giving its jobs back to the queue")
                self._fail_all(f"engine error: {exc}")
                continue
            finally:
                self._resend(requeued)
            try:
                self._handle(outputs)
            except Exception:
                log.exception("could not record engine outputs (will retry via leases)")

    def _learn_from_peers(self) -> None:
        """Records the lengths the heartbeat read from the other workers (the history is the engine thread's)."""
        if not self.peer_lengths:
            return
        with self.lock:
            lengths, self.peer_lengths = self.peer_lengths, []
        for key, n in lengths:
            self.engine.scheduler.history.record(key, n)

    def _handle(self, outputs: list[Any]) -> None:
        events: list[tuple[str, StreamEvent]] = []
        first_tokens: list[ActiveJob] = []
        for out in outputs:
            job = self.active.get(out.request_id)
            if job is None:
                continue
            attempt = job.lease.attempt
            if out.new_token_ids and not job.first_token_recorded:
                job.first_token_recorded = True
                first_tokens.append(job)
            if out.new_text or out.new_token_ids:
                job.text.append(out.new_text)
                events.append((out.request_id, StreamEvent("delta", attempt, out.new_text, list(out.new_token_ids))))
            if out.event == "rejected":  # the engine could not admit it (bad input): fail this job only
                end = self._reject(job)
                if end is not None:
                    events.append((out.request_id, end))
                continue
            if out.event in ("relegated", "resumed"):
                self._relegation(job, out.event)
                events.append((out.request_id, StreamEvent("status", attempt, status=out.event)))
            if out.finished:
                end = self._complete(job, out)
                if end is not None:
                    events.append((out.request_id, end))
        self._record_first_tokens(first_tokens)
        self._publish(events)

    def _record_first_tokens(self, jobs: list[ActiveJob]) -> None:
        """One write per step for the jobs whose first token came out in it (dashboard, job resource)."""
        if not jobs:
            return
        now = utcnow()
        with session_scope(self.url, immediate=True) as s:
            for job in jobs:
                s.execute(update(Job).where(Job.id == job.lease.job_id, Job.attempt == job.lease.attempt,
                                            Job.first_token_at.is_(None)).values(first_token_at=now))

    def _relegation(self, job: ActiveJob, event: str) -> None:
        src, dst = ((JobStatus.RUNNING, JobStatus.RELEGATED) if event == "relegated"
                    else (JobStatus.RELEGATED, JobStatus.RUNNING))
        values = {"relegation_count": Job.relegation_count + 1} if event == "relegated" else {}
        with session_scope(self.url, immediate=True) as s:
            transition(s, job.lease.job_id, src, dst, worker_id=self.worker_id, attempt=job.lease.attempt,
                       detail=f"engine {event} it", values=values)

    def _complete(self, job: ActiveJob, out: Any) -> StreamEvent | None:
        with self.lock:
            self.active.pop(out.request_id, None)
        if out.status is RequestStatus.FINISHED_ABORTED:
            return None  # cancelled (the API wrote it) or lease lost: nothing to record
        m = out.metrics
        reason = "length" if out.status is RequestStatus.FINISHED_LENGTH else "stop"
        text = "".join(job.text)
        values = {"output_text": text, "finish_reason": reason, "completion_tokens": m.num_output_tokens,
                  "prompt_tokens": job.request.prompt_len, "ttft_s": m.ttft_s, "tbt_p50_s": m.tbt_p50_s,
                  "tbt_p99_s": m.tbt_p99_s, "ttlt_s": m.ttlt_s, "slo_met": m.slo_met,
                  "slo_miss": m.slo_miss.as_dict() if getattr(m, "slo_miss", None) else None,
                  "first_token_at": job.created_at + timedelta(seconds=m.ttft_s) if m.ttft_s is not None else None}
        with session_scope(self.url, immediate=True) as s:
            ok = leases.finish(s, job.lease, JobStatus.SUCCEEDED, values, detail=f"finished ({reason})")
        if not ok:
            return None
        return StreamEvent("end", job.lease.attempt, status="succeeded", finish_reason=reason,
                           data={"prompt_tokens": job.request.prompt_len, "completion_tokens": m.num_output_tokens,
                                 "metrics": m.as_dict()})

    def _reject(self, job: ActiveJob) -> StreamEvent | None:
        with self.lock:
            self.active.pop(job.lease.job_id, None)
        error = "the engine rejected the request at admission (invalid parameters; see the worker log)"
        with session_scope(self.url, immediate=True) as s:
            if not leases.finish(s, job.lease, JobStatus.FAILED, {"error": error}, detail="rejected by the engine"):
                return None
        return StreamEvent("end", job.lease.attempt, status="failed", data={"error": error})

    def _fail_all(self, error: str) -> None:
        """A step raised: give every job in the engine back to the queue (another attempt, maybe on
        another worker); a job already on its last allowed attempt fails instead, so a request that
        breaks every engine it meets cannot circulate forever."""
        with self.lock:
            jobs = list(self.active.values())
            self.active.clear()
        events, resend = [], []
        with session_scope(self.url, immediate=True) as s:
            for job in jobs:
                self.engine.abort(job.lease.job_id)
                if job.lease.attempt >= self.settings.max_attempts:
                    msg = f"{error} (gave up after {job.lease.attempt} attempts)"
                    if leases.finish(s, job.lease, JobStatus.FAILED, {"error": msg}, detail="engine error"):
                        events.append((job.lease.job_id, StreamEvent("end", job.lease.attempt, status="failed",
                                                                     data={"error": msg})))
                elif leases.release(s, job.lease, f"engine error on {self.worker_id}; requeued"):
                    resend.append(job.lease.job_id)
        self._publish(events)
        self.requeued += resend  # sent by the engine loop after the next step took the aborts
        if jobs:
            log.warning("engine error: requeued %d jobs, failed %d on their last attempt", len(resend), len(events))

    def _resend(self, job_ids: list[str]) -> None:
        if not job_ids:
            return
        try:
            with session_scope(self.url) as s:
                for job_id in job_ids:  # marked dispatched, then sent; a failed send leaves it for the sweeper
                    dispatch(s, self.settings.redis_url, job_id, self.settings.model_name,
                             detail="requeued after an engine error")
        except Exception:  # they are queued in SQL: the sweeper sends them
            log.exception("could not resend %d requeued jobs", len(job_ids))

    def _publish(self, events: list[tuple[str, StreamEvent]]) -> None:
        if not events:
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            for job_id, ev in events:
                publish(pipe, job_id, ev)
            pipe.execute()
        except redis.RedisError as exc:  # streaming is best effort; SQL has the result
            log.warning("could not stream %d events: %s", len(events), exc)

    # ---------------------------------------------------------------- heartbeat, sweeper, cancel
    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"pid": os.getpid(), "active_jobs": len(self.active), "device": self.device}
        if self.engine is not None:
            try:
                cap = self.engine.executor.capacity()
                state.update(kv_total_blocks=cap.total_blocks, kv_free_blocks=cap.free_blocks,
                             kv_usage=round(cap.usage, 4), kv_recomputes=self.engine.num_recomputes)
                state["queues"] = self.engine.scheduler.queue_depths()
                state["speculation"] = self.engine.speculation.state()
                state["draft_on_device"] = bool(self.engine.executor.draft_on_device)
                drafter = getattr(self.engine.executor, "drafter", None)
                state["drafter"] = type(drafter).__name__ if drafter is not None else None
                stats = self.engine.last_stats
                state["last_step"] = {"latency_s": stats.step_latency_s, "decodes": stats.num_decodes,
                                      "prefill_tokens": stats.num_prefill_tokens}
            except Exception as exc:  # the dashboard gets less detail, the heartbeat still beats
                state["state_error"] = str(exc)
        return state

    def heartbeat(self) -> None:
        with self.lock:
            jobs = list(self.active.values())
        with session_scope(self.url, immediate=True) as s:
            held = leases.renew(s, self.worker_id, [j.lease for j in jobs], self.settings.lease_seconds)
            row = s.get(WorkerState, self.worker_id)
            if row is None:  # deleted by an operator or a DB reset: come back
                row = WorkerState(id=self.worker_id, model=self.settings.model_name, queue=self.queue,
                                  device=self.device)
                s.add(row)
            row.heartbeat_at = utcnow()
            row.state = self._state()
            draining = bool(row.draining)
        for job in jobs:  # cancelled by the API, or our lease was lost: stop generating it
            if job.lease.job_id not in held:
                log.info("job %s is no longer ours (cancelled or lease lost); aborting", job.lease.job_id)
                self.abort(job.lease.job_id)
        if draining != self.draining:
            self.draining = draining
            log.info("worker %s %s", self.worker_id, "draining: taking no new jobs" if draining else "serving again")
        if self.peers is not None:
            with session_scope(self.url) as s:
                lengths = self.peers.read(s)
            if lengths:
                with self.lock:
                    self.peer_lengths.extend(lengths)

    def abort(self, job_id: str) -> None:
        if job_id in self.active:
            self.engine.abort(job_id)
            self.wake.set()

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(self.settings.heartbeat_seconds):
            try:
                self.heartbeat()
            except Exception:
                log.exception("heartbeat failed")

    def _sweeper_loop(self) -> None:
        while not self.stopping.wait(self.settings.sweep_seconds):
            try:
                with session_scope(self.url, immediate=True) as s:
                    sweep(s, self.settings.redis_url, queued_grace_s=max(2.0, self.settings.sweep_seconds),
                          resend_after_s=max(30.0, 5 * self.settings.lease_seconds),
                          holder_stale_s=self.settings.lease_seconds, max_attempts=self.settings.max_attempts)
                finalize_open_batches(self.url, self.settings.data_dir, self.settings.redis_url)  # batch fan-in
                restart_stalled_validation(self.settings)  # batches whose API died while validating them
            except Exception:
                log.exception("sweep failed")

    def _cancel_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(CANCEL_CHANNEL)
                while not self.stopping.is_set():
                    msg = pubsub.get_message(timeout=1.0)
                    if msg and msg.get("type") == "message":
                        self.abort(msg["data"].decode())
            except redis.RedisError:
                self.stopping.wait(1.0)  # the heartbeat poll covers the gap


def run_worker(settings: Settings) -> None:
    """``coserve worker``: migrate, load the model, consume the model's queue until stopped."""
    if not settings.redis_url:
        raise SystemExit("REDIS_URL is not set; start Redis (or use `coserve up`) and export REDIS_URL")
    # Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. On a CPU shared with the API
    # and Redis, spinning threads stalled every parallel region (bench_spec_engine with one core busy:
    # 6.2 -> 12.5 tok/s); on a quiet machine the two settings measured the same. An explicit value wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    upgrade(settings.sqlalchemy_url)
    runtime = GpuWorker(settings)
    runtime.start()
    app = get_celery(settings.redis_url)
    app.coserve_worker = runtime  # the task reaches the runtime through its app

    @worker_shutting_down.connect(weak=False)
    def _on_shutdown(**_kw):
        runtime.shutting_down = True  # short: a task waiting for engine room gives its job back
    worker = app.Worker(pool="solo", concurrency=1, queues=[runtime.queue], hostname=f"{runtime.worker_id}@%h",
                        loglevel=os.environ.get("COSERVE_LOG_LEVEL", "WARNING"), without_heartbeat=True,
                        without_mingle=True, without_gossip=True, quiet=True)
    try:
        worker.start()
    finally:
        runtime.stop()


def main() -> None:
    logging.basicConfig(level=os.environ.get("COSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s")
    run_worker(Settings())


if __name__ == "__main__":
    main()
