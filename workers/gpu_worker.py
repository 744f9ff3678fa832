"""The long-lived GPU worker: one process per device, one engine, model loaded once.

The process loads the model, then runs a Celery consumer (solo pool) in the main thread
beside these threads:

* engine (``workers/engine_thread.py``): the only caller of the engine. It applies the
  inbox's commands (``workers/inbox.py``), steps, and puts what came out in the outbox;
* outbox (``workers/outbox.py``): the only writer of the engine's results. SQL writes with
  retries, each on its own; token events streamed to Redis in order, held while Redis is away;
* heartbeat: renews the leases of its jobs, writes the ``workers`` row (the engine thread's
  snapshot of KV usage, queue depths, speculation), notices cancelled/lost jobs and ``draining``;
* sweeper: ``workers.sweeper.sweep`` every ``sweep_seconds``;
* cancel listener: Redis pub/sub for prompt aborts (the heartbeat poll is the fallback);
* control listener: operator actions (resume, promote) into the inbox.

The Celery task only leases the job and puts it in the inbox; it blocks while the engine is
full, so an idle worker beside this one gets the next message.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from importlib import import_module
from typing import Any
from uuid import uuid4

import redis
from celery.signals import worker_shutting_down
from celery.utils.nodenames import host_format
from prometheus_client import REGISTRY
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from app.batch.storage import delete_expired_files
from app.services.webhooks import delete_settled, deliver_due
from app.db.migrate import upgrade
from app.embedded import recorded_redis_url, redis_silent
from app.db.models import Job, JobStatus, WorkerState
from app.db.session import session_scope, size_pool
from app.observability import engine_metrics
from app.observability.logs import configure_logging
from app.reasoning import ReasoningTokens
from app.services import lora_adapters, routing
from app.services.dispatch import dispatch, move, send_back, send_back_all
from app.services.model_info import context_length, get_tokenizer, use_chat_template
from app.services.routing import WORKER_QUEUE_PREFIX, WORKER_QUEUES, worker_queue
from app.services.streaming import CANCEL_CHANNEL, StreamEvent, stream_key
from app.services.transitions import ACTIVE, PENDING, as_utc, transition, utcnow
from app.services.truncation import fed_prompt
from app.services.workers import live_workers
from app.settings import Settings
from app.summarize.driver import advance_open_runs
from gpu_runtime.factory import build_engine, resolve_device
from gpu_runtime.qos import QoSClass, QoSSpec, TbtAnchor
from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams
from workers import decode_history
from workers import lease as leases
from workers import resume, taken
from workers.active_job import ActiveJob, ActiveJobs
from workers.celery_app import (BATCH_PRIORITY, INTERACTIVE_PRIORITY, cold_shutdown, consumer, get_celery,
                                queue_lists, queue_name)
from workers.control import start_control_listener
from workers.engine_thread import EngineThread, failed_attempt, refusal_code
from workers.inbox import Abort, Add, Inbox, Learn, RetireLoras, Supersede
from workers.outbox import Outbox, StepRecords
from workers.resume import Resumed
from workers.room import batch_room, has_room
from workers.batch_tasks import (count_abandoned_cancels, drop_left_working_dirs, finalize_open_batches,
                                restart_stalled_validation)
from workers.sweeper import back_to_queues, held_jobs, reroute, sweep
from workers.taken import take_back

log = logging.getLogger(__name__)

WEBHOOK_POLL_S = 1.0  # how often a worker looks for webhook deliveries that are due
DRAIN_PAUSE_S = 1.0  # how long a draining worker waits after handing a message back (``_drain_pause``)
PUBLISH_WAIT_S = 1.0  # how long a rerun waits for its earlier attempt's stream events to go out of this worker
PARKED_LOOK_S = 0.5  # how often a worker looks whether another took the job it handed back (``_await_taken_elsewhere``)
LOOK_S = 0.25  # how often a worker waiting for batch room looks for an interactive job its reserve can take


class GpuWorker:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.worker_id = settings.worker_name
        self.url = settings.sqlalchemy_url
        self.queue = queue_name(settings.model_name)
        # a LoRA adapter's jobs come on its own queue (routed by the job's model); this worker serves them all
        self.queues = [queue_name(m) for m in settings.served_models]
        if settings.routing == "prefix":  # and the jobs prefix routing sends this worker alone
            self.queues.append(worker_queue(self.worker_id))
        self.device = resolve_device(settings.device)
        self.backend = settings.engine_backend if not os.environ.get("COSERVE_ENGINE_FACTORY") else "custom"
        # the vLLM series for the API's /metrics: vLLM's stat logger registers its own in the process's registry; the
        # own engine's thread observes those the jobs' rows cannot give (``OwnEngineSeries``)
        self.engine_series = None if self.backend == "vllm" else engine_metrics.OwnEngineSeries(settings.model_name)
        self.active = ActiveJobs()
        self.inbox = Inbox()
        self.stopping = threading.Event()
        self.draining = False
        self.consumer_name: str | None = None  # the Celery worker's node name, once it consumes (run_worker)
        self.shutting_down = False  # Celery began a warm shutdown, or the engine was given up on (``begin_shutdown``)
        self.beat_now = threading.Event()  # wakes the heartbeat thread for a beat out of turn
        self.engine: Any = None
        self.redis = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2.0, socket_timeout=5.0)
        self.outbox = Outbox(self.url, self.redis, self.active)
        self.engine_thread: EngineThread | None = None
        self.gave_up: str | None = None  # why the worker gave up on an engine that still steps (``give_up_engine``)
        self.threads: list[threading.Thread] = []
        self.peers: decode_history.PeerLengths | None = None  # what the model's other workers finish
        self.handing_back: tuple[str, str] | None = None  # (job id, task id) of the message accept hands back now
        # when SQL first showed the APIs that this worker takes no jobs (its beat said stopping, or its row went)
        self.unroutable_at: float | None = None
        # the runtime adapters of the model its engine cannot serve (loaded before it started), and why
        self.lora_unserved: dict[str, str] = {}
        self.lora_checked: set[str] = set()  # the runtime adapters of the model at its last check (``_check_loras``)
        # the heartbeat and the intake both check them: each read is numbered as it begins, and only a read newer
        # than the one noted replaces it (the last write is not always the newest read)
        self._lora_lock = threading.Lock()
        self._lora_reads = 0  # reads begun
        self._lora_noted = 0  # the number of the read that lora_unserved and lora_checked hold

    # ---------------------------------------------------------------- life cycle
    def start(self) -> None:
        t0 = time.monotonic()
        self.tokenizer = get_tokenizer(self.settings.model)
        use_chat_template(self.settings.model, self.settings.chat_template,
                          self.settings.chat_template_content_format)  # the API's, as it counted prompts
        self.attach(self._build_engine())
        log.info("worker %s: %s engine ready on %s in %.1fs", self.worker_id, self.backend, self.device,
                 time.monotonic() - t0)
        history = getattr(self.engine.scheduler, "history", None)
        if history is not None:  # predicted output lengths (KV admission, batch deadlines) from what finished
            served = lora_adapters.served_models(self.settings)  # the adapters loaded at runtime so far too
            self.peers = decode_history.PeerLengths(served, self.worker_id, since=utcnow())
            with session_scope(self.url) as s:
                decode_history.seed(history, decode_history.finished_lengths(s, served))
        self._register()
        self._take_back_earlier()
        if self.settings.routing == "prefix":  # the sweepers look after this worker's own queue once it is gone
            self.redis.sadd(WORKER_QUEUES, worker_queue(self.worker_id))
        else:
            self._pass_on_own_queue()
        # operator actions from the dashboard (resume, promote) arrive over Redis pub/sub, into the inbox
        self.threads.append(start_control_listener(self.inbox, self.worker_id, self.settings.redis_url,
                                                   self.stopping))
        self.outbox.start()
        for name, fn in (("engine", self.engine_thread.run), ("heartbeat", self._heartbeat_loop),
                         ("sweeper", self._sweeper_loop), ("cancel", self._cancel_loop),
                         ("webhooks", self._webhook_loop)):
            t = threading.Thread(target=fn, name=f"coserve-{name}", daemon=True)
            t.start()
            self.threads.append(t)

    def _take_back_earlier(self) -> None:
        """The job whose message an earlier life under this id took and never acked (killed before it leased it, and
        restarted before a sweep found it lost: this life's beat makes it live) goes to the head of its model's
        queue (``workers.taken``)."""
        if held := take_back(self.settings.redis_url, [self.worker_id]):
            with session_scope(self.url, immediate=True) as s:
                reroute(s, self.settings.redis_url, [], taken=held_jobs(held))

    def _pass_on_own_queue(self) -> None:
        """A worker that reads no own queue (``COSERVE_ROUTING=queue``) passes on to its model's queue what an earlier
        life under its id, routed by prefix, left there: nobody else would (the sweepers reroute the own queue of a
        worker gone, and this one beats), and their lost-message rule counts a message waiting there as queued."""
        if not any(self.redis.llen(key) for key in queue_lists(worker_queue(self.worker_id))):
            return  # nothing left there (a worker that never routed by prefix)
        with session_scope(self.url, immediate=True) as s:
            reroute(s, self.settings.redis_url, [worker_queue(self.worker_id)])

    def served_context(self) -> int:
        """The context (prompt + output tokens) this worker serves: the model's as the settings say, or less where
        its engine holds less (the own engine fits it to its KV cache, vLLM to its max_model_len); read once the
        engine is built (a constant of it)."""
        own = context_length(self.settings)
        engine_len = getattr(getattr(self.engine, "executor", None), "max_model_len", None)
        return min(own, engine_len) if isinstance(engine_len, int) and engine_len > 0 else own

    def attach(self, engine: Any) -> EngineThread:
        """The engine this worker serves with, and the thread that alone will call it."""
        self.engine = engine
        self.engine_thread = EngineThread(engine, self.active, self.inbox, self.outbox, self.settings,
                                          self.worker_id, self.stopping, on_broken=self._engine_broken,
                                          on_kept_abort=self.give_up_engine, series=self.engine_series)
        return self.engine_thread

    def _build_engine(self) -> Any:
        s = self.settings
        factory = os.environ.get("COSERVE_ENGINE_FACTORY")  # "module:function" to swap the stack (benchmarks)
        if factory:
            build = getattr(import_module(factory.split(":")[0]), factory.split(":")[1])
        elif self.backend == "vllm":
            from gpu_runtime.executor.drafters import draft_checkpoint
            from gpu_runtime.vllm.build import build_vllm_engine
            from gpu_runtime.vllm.cli_args import operator_engine_args

            return build_vllm_engine(s.model, device=self.device, scheduler_policy=s.scheduler_policy,
                                     spec_policy=s.spec_policy, cost_profile=s.cost_profile, kv_reserve=s.kv_reserve,
                                     kv_cache_gib=s.vllm_kv_cache_gib, enforce_eager=s.vllm_enforce_eager,
                                     max_model_len=s.vllm_max_model_len, spec_tokens=s.vllm_spec_tokens,
                                     drafter=s.vllm_drafter, draft_model=draft_checkpoint(s.draft),
                                     step_log=s.vllm_step_log,
                                     overrides=operator_engine_args(s.vllm_engine_args, s.vllm_args),
                                     lora_modules=s.lora_modules,
                                     runtime_loras=s.max_loras if s.runtime_lora else 0,
                                     runtime_lora_rank=s.max_lora_rank, reasoning_parser=s.reasoning_parser,
                                     served_model_name=s.model_name,
                                     scheduler_config=s.scheduler_config,
                                     cost_calibration=s.cost_calibration)
        else:
            if s.lora_modules or s.runtime_lora:
                raise SystemExit("COSERVE_LORA_MODULES, COSERVE_RUNTIME_LORA: LoRA adapters are served on the vLLM "
                                 f"backend (COSERVE_BACKEND=vllm), not on {self.backend!r}")
            build = build_engine
        return build(s.model, device=self.device, scheduler_policy=s.scheduler_policy, spec_policy=s.spec_policy,
                     kv_blocks=s.kv_blocks, draft=s.draft if s.spec_policy != "none" else None,
                     cost_profile=s.cost_profile, kv_reserve=s.kv_reserve, tokenizer=self.tokenizer,
                     scheduler_config=s.scheduler_config)

    @property
    def broken(self) -> str | None:
        """Why the engine was given up on (its steps kept raising, or it kept an aborted request: ``give_up_engine``),
        else None."""
        return self._steps_broken or self.gave_up

    @property
    def _steps_broken(self) -> str | None:
        return self.engine_thread.broken if self.engine_thread is not None else None

    def _engine_broken(self, reason: str) -> None:
        """The engine was given up on (by the engine thread, or ``give_up_engine``): Celery's warm shutdown stops the
        intake, ``stop`` gives back what came in meanwhile, and ``run_worker`` exits with status 1 (a supervisor
        starts a fresh process)."""
        self.begin_shutdown()
        log.critical("worker %s stops: %s", self.worker_id, reason)
        os.kill(os.getpid(), signal.SIGTERM)

    def begin_shutdown(self) -> None:
        """Celery's warm shutdown began (SIGTERM), or the engine was given up on: the consumer takes no more messages,
        and a heartbeat at once (not at the next period) says ``stopping`` in the worker's state, so the APIs leave
        it out (prefix routing, readiness) through the grace, while it still beats until ``stop``. Short: Celery
        calls it from its signal handler."""
        self.shutting_down = True
        self.beat_now.set()

    def stop(self, grace_s: float | None = None) -> None:
        """Lets running jobs finish for ``grace_s`` (None: ``COSERVE_STOP_GRACE_SECONDS``), then gives the rest back
        to the queue."""
        grace_s = self.settings.stop_grace_seconds if grace_s is None else grace_s
        # an engine whose steps raise finishes nothing; one given up on for a request it kept still runs the rest
        deadline = time.monotonic() + (grace_s if self._steps_broken is None else 0.0)
        while len(self.active) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.stopping.set()
        self.beat_now.set()  # the heartbeat thread ends now, not at its next period
        self.inbox.wake()
        for t in self.threads:
            if t.name == "coserve-engine":
                t.join(5)
        self.outbox.close()  # what finished is written before the rest is given back
        self._hand_back_superseding()
        rest = sorted(self.active.take_all(), key=lambda j: j.request.arrival_time)
        with session_scope(self.url, immediate=True) as s:
            released = [job.lease.job_id for job in rest
                        if leases.release(s, job.lease, f"worker {self.worker_id} shut down")]
            rows = {r.id: r for r in s.execute(select(Job.id, Job.model, Job.kind).where(Job.id.in_(released)))}
            # they were running, so they came before every message waiting: to the head, the oldest taken first; each
            # to the queue dispatch sends its jobs to (a configured adapter's own: not every worker of the model
            # serves it), on its kind's list
            back = back_to_queues(s, [rows[job_id] for job_id in released if job_id in rows])
            for job_id in send_back_all(self.settings.redis_url, back):  # waiting in the broker again: dispatched,
                # as the sweeper marks what it sends (left queued, each sweep would send it once more)
                transition(s, job_id, JobStatus.QUEUED, JobStatus.DISPATCHED, detail="given back at shutdown",
                           values={"dispatched_at": utcnow()})
            row = s.get(WorkerState, self.worker_id)
            if row is not None:
                s.delete(row)
            # views read before the worker said it stops may still route here, unless they are stale by now: then
            # this pass is the last (``_reroute_late_routed``)
            late_routed = self._views_route_here()
            if self.settings.routing == "prefix":  # what was routed to this worker and not taken yet
                reroute(s, self.settings.redis_url, [worker_queue(self.worker_id)])
        self._said_unroutable()
        if self.settings.routing == "prefix" and late_routed:
            self._reroute_late_routed()
        log.info("worker %s stopped (%d jobs given back)", self.worker_id, len(rest))

    def _hand_back_superseding(self) -> None:
        """The messages of reruns the intake gave over to the engine thread (``Supersede``) that it did not get to
        before it ended, back to the head of their queues: their jobs are pending, and the earlier attempts' leases
        release nothing (else the sweeper's resend of a lost message would find them, ``max(30, 5 x lease)`` s later).
        Only once the engine thread has ended: while it runs the inbox is its own."""
        if any(t.name == "coserve-engine" and t.is_alive() for t in self.threads):
            return
        for cmd in self.inbox.drain():
            if isinstance(cmd, Supersede):
                send_back(self.settings.redis_url, cmd.job_id, cmd.queue, cmd.priority)

    def _said_unroutable(self) -> None:
        """Notes when SQL first showed the APIs that this worker takes no jobs (just committed: a beat that says
        ``stopping``, or ``stop``'s deletion of its row)."""
        if self.unroutable_at is None:
            self.unroutable_at = time.monotonic()

    def _views_stale_at(self) -> float:
        """When the APIs' views of the workers read before SQL showed that this worker takes no jobs are stale (counted
        from now where it has not shown that yet: ``stop``'s deletion of its row shows it)."""
        return (self.unroutable_at or time.monotonic()) + routing.REFRESH_S

    def _views_route_here(self) -> bool:
        """Whether an API may still route a job to this worker by a view it read before it said it stops."""
        return time.monotonic() < self._views_stale_at()

    def _reroute_late_routed(self) -> None:
        """``stop``'s last pass of the jobs routed to this worker alone to its model's queue. An API routes by a view of
        the workers up to ``routing.REFRESH_S`` old, so one read before this worker said it stops sends jobs here until
        then: a worker that stops at once (no job running, a cold shutdown) would leave them on a queue nobody reads
        until another worker's next sweep (``sweep_seconds``), or, with no other, until one starts. It waits for those
        views to go stale and passes on what came meanwhile; a send later still (an
        API slower between its view and its send) is the sweepers' (``_reroute_orphaned``). ``stop`` skips it where
        the views were stale before its first pass (a grace that long)."""
        time.sleep(max(0.0, self._views_stale_at() - time.monotonic()))
        try:
            with session_scope(self.url) as s:
                reroute(s, self.settings.redis_url, [worker_queue(self.worker_id)])
        except Exception:  # the sweepers pass them on: the queue is named to them at each send
            log.exception("worker %s could not pass on the jobs routed to it as it stopped", self.worker_id)

    def _register(self) -> None:
        with session_scope(self.url, immediate=True) as s:
            row = s.get(WorkerState, self.worker_id)
            if row is None:
                row = WorkerState(id=self.worker_id, model=self.settings.model_name, queue=self.queue,
                                  device=self.device)
                s.add(row)
            row.started_at = row.heartbeat_at = utcnow()
            row.draining = False
            self._check_loras(s)
            row.state = self._state()
            if dropped := leases.drop_held_marks(s, self.worker_id):
                log.info("%d jobs a worker %s that stopped waited with are to be sent again", dropped, self.worker_id)

    # ---------------------------------------------------------------- intake (Celery task)
    def accept(self, job_id: str, priority: int = INTERACTIVE_PRIORITY, queue: str | None = None) -> None:
        """Lease ``job_id`` (its message came on ``queue``) and add it to the engine; while the engine has no room for
        it (``workers.room``: an interactive job while ``max_inflight`` jobs are in line, a batch job while all but the
        interactive reserve are), its message is not kept here: it goes back to the head of its list on the model's
        queue at once (its place kept), and the worker takes no message until it has room again (``_await_room``).
        A worker of the model with room takes it meanwhile (held here, it waited for this engine however many others
        had room), or this one takes it back as soon as it has room. A full worker hands back at most the one message
        it took, so a message bounces once per full worker, not between them. A batch job's wait ends early where an
        interactive job waits on this worker's queues and its reserve has room: the worker takes the interactive one,
        which kombu hands out first. A draining worker hands the message back at once (``_drain_pause``).

        A cold shutdown cancels this task by raising in it, and its message is acked all the same: the job it held,
        not yet in the engine, goes back to the head of its queue then (``_give_back_interrupted``), not lost until
        the sweeper misses it.

        A rerun of a job whose earlier attempt this worker holds set aside (an abort its engine has not confirmed) is
        added beside that attempt: the engine knows each attempt by its own request id. One whose earlier attempt it
        still serves is given over to the engine thread (``Supersede``), which sets that attempt aside and hands the
        message back once its last stream events are in Redis (whoever takes it goes on from them); the intake takes
        the next message meanwhile.
        """
        self.handing_back = None
        try:
            wait = self._take(job_id, priority, queue)
        except BaseException:
            if cold_shutdown():
                self._give_back_interrupted(job_id, self._queue_back(job_id, queue), priority)
            raise
        if wait == "room":
            self._await_room(priority)
        elif wait == "drain":
            self._drain_pause()
        elif wait == "elsewhere":
            self._await_taken_elsewhere(job_id, priority)

    def _take(self, job_id: str, priority: int, queue: str | None) -> str | None:
        """``accept``'s intake: the job leased into the engine, or its message (it came on ``queue``) handed back.
        What to wait for then, with no message in hand: "room" (the engine was full), "drain" (this worker drains),
        "elsewhere" (a job of a runtime adapter its engine cannot serve, handed back for another worker), or None."""
        if (earlier := self._earlier_attempt(job_id)) is not None:  # set aside by the engine thread, which then hands
            # the message back (``Supersede``): not waited for here, the messages behind it taken meanwhile
            log.warning("job %s came back to this worker while its attempt %d still runs here; setting that one aside",
                        job_id, earlier)
            self.inbox.put(Supersede(job_id, earlier, self._queue_back(job_id, queue), priority))
            return None
        if self.shutting_down or self.draining or not self._has_room(priority):
            # for another worker, or this one later
            self._hand_back(job_id, self._queue_back(job_id, queue), priority)
            if self.stopping.is_set() or self.shutting_down:
                return None
            return "drain" if self.draining else "room"
        model, shared = self._job_route(job_id)
        if shared not in self.queues:  # for a worker that serves its model, not failed here
            self._hand_back(job_id, shared, priority)
            return None
        unserved = self.lora_unserved
        if self._unchecked_adapter(model):  # loaded since its last check: held to the workers live then, not this one
            with session_scope(self.url) as s:
                unserved = self._check_loras(s)
        if model in unserved and self._served_by_another(model):
            self._hand_back(job_id, shared, priority)  # for that one; failed here where none serves it
            return "elsewhere"
        with session_scope(self.url, immediate=True) as s:
            lease = leases.acquire(s, job_id, self.worker_id, self.settings.lease_seconds)
            if lease is None:
                log.info("job %s is not pending any more; message dropped", job_id)
                return None
            job = s.get(Job, job_id, populate_existing=True)  # as leased: its attempt names its request
            try:
                request = self._request(job, s)
            except Exception as exc:  # bad input the API could not catch: fail this attempt only
                if cold_shutdown():  # Celery cancelled this task (not the job's fault): accept gives the job back
                    raise
                log.warning("job %s failed at admission: %s", job_id, exc)
                values, end = failed_attempt(lease, str(exc), refusal_code(exc))
                leases.finish(s, lease, JobStatus.FAILED, values, detail="rejected by the engine")
                self.outbox.put(StepRecords(deltas=[(job_id, end)]))
                return None
            created = as_utc(job.created_at)
            first_out = as_utc(job.first_token_at) if job.first_token_at is not None else None
            parser = (job.sampling or {}).get("reasoning_parser")
        resumed = self._resumed(lease, request) if lease.attempt > 1 else None
        if resumed is not None:  # the policy judges it on the pace of what is left, not on its settled TTFT
            request.qos = replace(request.qos, delivered=len(resumed.token_ids),
                                  first_token_s=None if first_out is None else (first_out - created).total_seconds())
            shift = self.engine.executor.now() - time.time()  # the stream's times on the engine clock (metrics)
            request.delivered_times = [t + shift for t in resumed.token_times]
        active = ActiveJob(lease, request, created, reasoning=ReasoningTokens(parser) if parser else None,
                           resumed=resumed)
        if resumed is not None:
            # the attempt's stream begins with the tokens it goes on from (a follower cuts what its client has)
            data = {"token_offset": 0} | ({"logprobs": list(resumed.logprobs), "logprobs_offset": 0}
                                          if resumed.logprobs else {})
            self.outbox.put(StepRecords(deltas=[(job_id, StreamEvent("delta", lease.attempt, resumed.text,
                                                                     list(resumed.token_ids), data=data, offset=0))]))
        # registered and queued under one lock: an abort that sees the job is applied after its add
        with self.active.lock:
            self.active.add(active)
            self.inbox.put(Add(job_id))
        return None

    def give_up_engine(self, reason: str) -> None:
        """The engine keeps aborted requests (``EngineThread``: one still held ``KEPT_ABORT_LEASES`` leases after its
        abort): their KV blocks and slots leak, and only a fresh engine lets them go. The worker stops as one whose
        engine broke (exit status 1: its supervisor starts it afresh), its running jobs finishing within the stop
        grace."""
        self.gave_up = reason
        self._engine_broken(reason)

    def _hand_back(self, job_id: str, back_to: str, priority: int) -> None:
        """``send_back`` of the message in hand, its task id known meanwhile (``handing_back``): a cold shutdown that
        interrupts it is finished by ``_give_back_interrupted`` with no second message."""
        self.handing_back = (job_id, uuid4().hex)
        send_back(self.settings.redis_url, job_id, back_to, priority, task_id=self.handing_back[1])
        taken.forget(self.redis, self.worker_id)  # in its queue again: not the one to send again should this die

    def _send_back_once(self, job_id: str, back_to: str, priority: int) -> None:
        """The dispatched job's message back to the head of ``back_to``, once: where a hand-back of it was under way
        when the task was interrupted, the message it pushed is moved there (a second could not lease the job, but
        it cost a worker a take); sent where it is not in the list (not pushed, or a consumer has it)."""
        url, handing = self.settings.redis_url, self.handing_back
        task_id = handing[1] if handing is not None and handing[0] == job_id else None
        if task_id is None or not move(url, back_to, priority, task_id):
            send_back(url, job_id, back_to, priority, task_id=task_id)

    def _drain_pause(self) -> None:
        """After a draining worker handed a message back: its consumer stops (``_consume``), which Celery applies
        once this task returns; where the word was lost, this pause, with no message in hand, spaces the bounces
        and lets the other workers take it meanwhile."""
        self.stopping.wait(DRAIN_PAUSE_S)

    def _give_back_interrupted(self, job_id: str, back_to: str, priority: int) -> None:
        """The job of an ``accept`` that a cold shutdown interrupted back to the head of ``back_to``: still pending
        (its message is acked with the task's failure), or leased here but not yet in the engine (``stop`` gives
        back what is). A hand-back of its message that the shutdown interrupted is finished, not sent twice
        (``_send_back_once``)."""
        if job_id in self.active:
            return
        try:
            with session_scope(self.url, immediate=True) as s:
                row = s.execute(select(Job.status, Job.attempt, Job.worker_id).where(Job.id == job_id)).first()
                status = JobStatus(row.status) if row is not None else None
                if status in ACTIVE and row.worker_id == self.worker_id:
                    lease = leases.Lease(job_id, row.attempt, self.worker_id)
                    status = JobStatus.QUEUED if leases.release(s, lease, f"worker {self.worker_id} shut down "
                                                                           "before it ran") else None
                if status is JobStatus.QUEUED:
                    dispatch(s, self.settings.redis_url, job_id, self.settings.model_name, queue=back_to,
                             priority=priority, detail="given back at shutdown", send=send_back)
                elif status is JobStatus.DISPATCHED:
                    self._send_back_once(job_id, back_to, priority)
        except Exception:  # the sweeper finds it: its lease lapses, or its message is missed from the queue
            log.exception("job %s could not be given back at shutdown", job_id)

    def _resumed(self, lease: leases.Lease, request: Request) -> Resumed | None:
        """Where an earlier attempt of the job streamed tokens: ``request`` goes on from them (``workers.resume``;
        its prompt and sampling are changed here). None: it runs from scratch (nothing usable was streamed, or the
        stream cannot be read: a rerun from scratch is always correct)."""
        deadline = time.monotonic() + PUBLISH_WAIT_S
        while self.outbox.publishing(lease.job_id):  # an earlier attempt here left; its last deltas go out first
            if time.monotonic() >= deadline:  # held (Redis away): what a client has is not known
                log.info("job %s attempt %d runs from scratch: its earlier attempt's stream events wait for Redis",
                         lease.job_id, lease.attempt)
                return None
            time.sleep(0.01)
        try:
            raw = self.redis.xrange(stream_key(lease.job_id))
            done = resume.streamed((StreamEvent.parse(fields, entry_id) for entry_id, fields in raw), lease.attempt)
            sp = request.sampling
            tokenizer = getattr(self, "tokenizer", None) or get_tokenizer(self.settings.model)
            plan = resume.plan(sp, request.prompt_token_ids, done,
                               lambda ids: tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens))
        except Exception:  # never fails the job: it runs from scratch
            log.exception("could not read what the earlier attempts of %s streamed; it runs from scratch", lease.job_id)
            return None
        if plan is None:
            if done is not None:
                log.info("job %s attempt %d runs from scratch (%s)", lease.job_id, lease.attempt,
                         resume.refusal(sp) or "what was streamed cannot be gone on from")
            return None
        request.prompt_token_ids = plan.prompt(request.prompt_token_ids)
        request.sampling = plan.sampling(sp)
        log.info("job %s attempt %d goes on after the %d tokens its earlier attempt streamed", lease.job_id,
                 lease.attempt, len(plan.token_ids))
        return plan

    def _queue_back(self, job_id: str, queue: str | None) -> str:
        """Where the message of ``job_id`` that came on ``queue`` goes back: that queue when the model's workers share
        it, the shared one its model's jobs go on (``_model_queue``) when it was this worker's own (prefix routing
        chose this worker; another may take it now). Read only for a message handed back."""
        if queue and queue in self.queues and not queue.startswith(WORKER_QUEUE_PREFIX):
            return queue
        return self._model_queue(job_id)

    def _model_queue(self, job_id: str) -> str:
        """The shared queue dispatch sends the model of ``job_id`` to (``_job_route``)."""
        return self._job_route(job_id)[1]

    def _job_route(self, job_id: str) -> tuple[str | None, str]:
        """The model of ``job_id`` and the shared queue dispatch sends it to (``sweeper.back_to_queues``): a
        configured adapter's own, which a worker without that adapter never reads; the model's where SQL cannot say
        (model None). A job whose queue this worker does not read came here astray (routed to its own queue by a view
        of a predecessor under its id that served the model, or given back to the model's queue by an older coserve):
        it goes there, to workers that serve its model (each reads the queues of what it serves: it stays there)."""
        try:
            with session_scope(self.url) as s:
                row = s.execute(select(Job.id, Job.model, Job.kind).where(Job.id == job_id)).first()
                if row is not None:
                    return row.model, back_to_queues(s, [row])[0][1]
        except Exception:  # SQL away: the model's queue, which this worker (serving the job's model) reads too
            if cold_shutdown():  # Celery cancelled this task: accept gives the job back
                raise
            log.warning("could not read the model of job %s; its message goes back to %s", job_id, self.queue)
        return None, self.queue

    def _served_by_another(self, adapter: str) -> bool:
        """Whether another live worker of the model serves the runtime adapter ``adapter``, which this one's engine
        cannot (``lora_unserved``), by what its heartbeat says (``lora_adapters.serves``)."""
        with session_scope(self.url) as s:
            rank = lora_adapters.ranks(s, self.settings.model_name).get(adapter)
            return rank is not None and any(
                w.id != self.worker_id and self.settings.model_name in w.served
                and lora_adapters.serves(w.state or {}, adapter, rank) for w in live_workers(s, self.settings))

    def _unchecked_adapter(self, model: str | None) -> bool:
        """Whether ``model`` (a job's) may be a runtime adapter loaded since this worker's last ``_check_loras``: one
        that a load landing between its registration and its next beat held to the workers live before it."""
        return (model is not None and model not in self.settings.served_models
                and model not in self.settings.model_aliases and model not in self.lora_checked)

    def _check_loras(self, session: Session) -> dict[str, str]:
        """Notes the runtime adapters of the model that this worker's engine cannot serve (``lora_unserved``; a load
        is held to the workers live then, so one loaded before this worker started may be above its max_lora_rank,
        or its engine may load none), saying so loudly for each new one: their jobs go to another worker of the
        model (``_take``), and fail here where none serves them. Returns what this read found: the heartbeat and
        the intake both check, and a read older than the one noted meanwhile is not noted (``_note_loras``)."""
        with self._lora_lock:
            self._lora_reads += 1
            read = self._lora_reads
        said = getattr(self.engine, "lora_limits", None)
        adapters = lora_adapters.ranks(session, self.settings.model_name)
        unserved = lora_adapters.unserved(said if isinstance(said, dict) else None, adapters)
        if unserved and not self._runtime_lora_anywhere(session):  # rows left from before: no job may name them
            unserved = {}
        for name in self._note_loras(read, set(adapters), unserved):
            log.error("worker %s cannot serve the runtime LoRA adapter %r: %s; its jobs go to the model's other "
                      "workers, and fail here where none serves it (unload it, or start this worker with an engine "
                      "that serves it: COSERVE_RUNTIME_LORA=1, COSERVE_MAX_LORA_RANK)", self.worker_id, name,
                      unserved[name])
        return unserved

    def _note_loras(self, read: int, checked: set[str], unserved: dict[str, str]) -> list[str]:
        """Notes what ``_check_loras``'s read number ``read`` found, unless a newer read was noted already (a beat that
        read before an adapter was loaded and wrote after the intake had read it then made the worker take its jobs);
        returns the adapters it newly found unserved."""
        with self._lora_lock:
            if read < self._lora_noted:
                return []
            new = sorted(unserved.keys() - self.lora_unserved.keys())
            self._lora_noted, self.lora_checked, self.lora_unserved = read, checked, unserved
            return new

    def _runtime_lora_anywhere(self, session: Session) -> bool:
        """Whether this worker (its COSERVE_RUNTIME_LORA) or another live worker of the model loads runtime adapters
        (``lora_adapters.heartbeat_limits``): where none does, the API (its setting alike) serves none of them, and
        the rows of those loaded before are left unnamed."""
        return self.settings.runtime_lora or any(
            w.id != self.worker_id and self.settings.model_name in w.served
            and (lora_adapters.heartbeat_limits(w.state or {}) or {"runtime": True}).get("runtime")
            for w in live_workers(session, self.settings))

    def _has_room(self, priority: int) -> bool:
        """Whether the engine takes a job of message ``priority`` now: a batch job leaves the interactive reserve
        free (``workers.room``)."""
        return has_room(self.active.in_line, priority == BATCH_PRIORITY, self.settings.max_inflight,
                        self.settings.kept_for_interactive)

    def _earlier_attempt(self, job_id: str) -> int | None:
        """The attempt of ``job_id`` this worker still serves although SQL has the job pending again (its lease lapsed
        while it ran here, and the sweeper's resend came back here); None where it serves none, or where the job is
        not pending (a second message for the attempt running here: the lease says so at once)."""
        earlier = self.active.get(job_id)
        if earlier is None:
            return None
        with session_scope(self.url) as s:
            row = s.get(Job, job_id, populate_existing=True)
            if row is None or JobStatus(row.status) not in PENDING:
                return None
        return earlier.lease.attempt

    def _await_room(self, priority: int) -> None:
        """Waits, with no message in hand, until the engine has room for a job of message ``priority`` (the consumer
        fetches the next message then); a batch job's wait also ends where an interactive job waits on this worker's
        queues and the interactive reserve has room for it (looked at every ``LOOK_S``)."""
        look_at = time.monotonic() + LOOK_S
        while not (self._has_room(priority) or self.stopping.is_set() or self.shutting_down):
            if priority == BATCH_PRIORITY and time.monotonic() >= look_at:
                if self._has_room(INTERACTIVE_PRIORITY) and self._interactive_waiting():
                    return
                look_at = time.monotonic() + LOOK_S
            time.sleep(0.02)

    def _interactive_waiting(self) -> bool:
        """Whether an interactive job's message waits on one of the queues this worker reads."""
        return self._messages_waiting([queue_lists(queue)[0] for queue in self.queues])

    def _messages_waiting(self, lists: list[str]) -> bool:
        """Whether a message waits on one of the Redis ``lists`` (False where Redis does not answer)."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            for name in lists:
                pipe.llen(name)
            return any(pipe.execute())
        except redis.RedisError:
            return False

    def _await_taken_elsewhere(self, job_id: str, priority: int) -> None:
        """After the job of a runtime adapter this engine cannot serve went back for a worker that serves it
        (``_take``): waits, with no message in hand, until its message is no longer the next of its list (that worker
        took it), no other live worker serves the adapter (this one takes the job again, and fails it), or a message
        waits that this worker's consumer would take first (``_taken_before``); looked at every ``PARKED_LOOK_S``. The
        job waits for no one here: its message stays the next a free worker takes. Taking it again each second only
        handed it back again (a Celery task, Redis writes and log lines a second while the others were busy)."""
        handed = self.handing_back
        if handed is None or handed[0] != job_id:
            return
        adapter, queue = self._job_route(job_id)
        kind = 1 if priority == BATCH_PRIORITY else 0
        head, before = queue_lists(queue)[kind], self._taken_before(queue, kind)
        while not (self.stopping.wait(PARKED_LOOK_S) or self.shutting_down):
            if not self._next_on(head, handed[1]) or self._messages_waiting(before):
                return
            try:  # unloaded since (its job fails here), or its last server gone
                if adapter not in self.lora_unserved or not self._served_by_another(adapter):
                    return
            except SQLAlchemyError:  # the consumer takes it again: ``_take`` decides
                return

    def _taken_before(self, queue: str, kind: int) -> list[str]:
        """This worker's lists whose messages its consumer may take before the next of ``queue``'s list ``kind`` (0:
        interactive, 1: batch): the other queues' (kombu takes from them in turn), and its interactive one for a batch
        job's (kombu hands those out first)."""
        return [name for q in self.queues for i, name in enumerate(queue_lists(q)) if q != queue or i < kind]

    def _next_on(self, name: str, task_id: str) -> bool:
        """Whether the message of ``task_id`` is the next a consumer takes from Redis list ``name`` (True where Redis
        does not answer: the wait goes on)."""
        try:
            head = self.redis.lindex(name, -1)
        except redis.RedisError:
            return True
        return head is not None and task_id.encode() in head

    def _request(self, job: Job, session: Session) -> Request:
        """The engine request of the job's attempt that was just leased (``leases.acquire`` moved ``job.attempt`` on
        to it), named after that attempt (``Lease.request_id``)."""
        ids = fed_prompt(self.settings, job)
        sampling = SamplingParams.from_job(job.sampling or {}, self.settings.default_max_tokens)
        tier = self.settings.engine_tier(job.tier)
        created = as_utc(job.created_at)
        if job.kind == "batch":
            qos = QoSSpec(QoSClass.BATCH, tier, ttlt_s=max(1e-3, (as_utc(job.deadline_at) - created).total_seconds()))
        else:
            qos = QoSSpec(QoSClass.INTERACTIVE, tier, ttft_s=(job.ttft_ms or self.settings.default_ttft_ms) / 1e3,
                          tbt_s=(job.tbt_ms or self.settings.default_tbt_ms) / 1e3,
                          tbt_anchor=TbtAnchor(job.tbt_anchor or self.settings.tbt_anchor))
        # arrival on the engine clock = when the job was submitted, so queueing counts against TTFT
        waited = (utcnow() - created).total_seconds()
        adapter = job.model if job.model != self.settings.model_name else None
        path, version = None, 0.0
        if adapter is not None and adapter not in self.settings.lora_modules:  # loaded at runtime: from SQL
            path, version = self._runtime_adapter_source(adapter, session)
            if (why := self.lora_unserved.get(adapter)) is not None:  # and no other worker serves it (``_take``)
                raise ValueError(f"LoRA adapter {adapter!r} cannot be served by worker {self.worker_id!r} ({why}), "
                                 "and no other live worker of the model serves it; unload it, or start the model's "
                                 "workers with an engine that serves it (COSERVE_RUNTIME_LORA=1, "
                                 "COSERVE_MAX_LORA_RANK), and resubmit")
        return Request(leases.engine_request_id(job.id, job.attempt), ids, sampling, qos,
                       arrival_time=self.engine.executor.now() - max(0.0, waited),
                       app_id=decode_history.history_key(job.app_id, job.tenant_id, job.kind, adapter),
                       lora_name=adapter, lora_path=path, lora_version=version,
                       cache_salt=self._cache_salt(job))

    def _runtime_adapter_source(self, adapter: str, session: Session) -> tuple[str, float]:
        """Where this worker loads the runtime adapter a job names, and its version (``adapter_source``); a
        ValueError saying why it cannot: unloaded since the job came, or never one this worker serves (a configured
        adapter of another worker, reached here by a queue the job should not have taken)."""
        source = lora_adapters.adapter_source(session, adapter)
        if source is not None:
            return source
        if lora_adapters.was_unloaded(session, adapter):
            raise ValueError(f"LoRA adapter {adapter!r} was unloaded before this job began; load it again "
                             "(POST /v1/load_lora_adapter) and resubmit")
        served = ", ".join(map(repr, self.settings.lora_modules)) or "none"
        raise ValueError(f"LoRA adapter {adapter!r} is not served by this worker (its COSERVE_LORA_MODULES: "
                         f"{served}); give it to the workers that take its jobs, or resubmit when one that serves "
                         "it runs")

    def _cache_salt(self, job: Job) -> str | None:
        """The job's prefix-cache scope: its tenant's (COSERVE_PREFIX_CACHE_SCOPE=tenant), narrowed by the
        request's own ``cache_salt`` (vLLM's) where it gave one."""
        scope = job.tenant_id if self.settings.prefix_cache_scope == "tenant" else None
        salt = (job.sampling or {}).get("cache_salt")
        if salt is None:
            return scope
        return salt if scope is None else f"{scope}:{salt}"

        # ---------------------------------------------------------------- heartbeat, sweeper, cancel
    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"pid": os.getpid(), "served": list(self.settings.served_models),
                                 "runtime_lora": self.settings.runtime_lora,
                                 "context_length": self.served_context(),  # the API holds jobs to it
                                 "active_jobs": len(self.active),
                                 "relegated_jobs": self.active.relegated, "device": self.device,
                                 # attempts aborted whose abort the engine has not confirmed (a rerun runs beside)
                                 "set_aside_jobs": self.active.set_aside,
                                 # what prefix routing weighs: the jobs it serves in line, and how many it takes
                                 "in_line": self.active.in_line, "max_inflight": self.settings.max_inflight,
                                 "batch_room": batch_room(self.settings.max_inflight,
                                                          self.settings.kept_for_interactive),
                                 "outbox_pending": self.outbox.pending,
                                 # a warm shutdown's grace: it takes no job, though it beats until it stops
                                 "stopping": self.shutting_down,
                                 # whether prefix routing may send it jobs: it reads its own queue
                                 "own_queue": self.settings.routing == "prefix"}
        if self.settings.routing == "prefix":  # jobs prefix routing sent this worker alone, not taken yet
            try:
                state["routed_waiting"] = sum(self.redis.llen(key) for key in queue_lists(worker_queue(self.worker_id)))
            except redis.RedisError:
                pass
        if isinstance(limits := getattr(self.engine, "lora_limits", None), dict):  # the API holds loads to them
            state["lora"] = limits
        # the API checks structured outputs with it (``app.output_constraints``); the own engine serves none
        state["grammar_backend"] = getattr(self.engine, "grammar_backend", None)
        # why that backend cannot run (the API refuses a structured output at submit then: ``routing``)
        state["grammar_unavailable"] = getattr(self.engine, "grammar_unavailable", None)
        if self.lora_unserved:  # the APIs' /readyz names them, and another worker takes their jobs
            state["lora_unserved"] = dict(self.lora_unserved)
        if self.engine_thread is not None:
            state.update(self.engine_thread.state)  # the engine thread's snapshot: no engine reads from here
        return state

    def heartbeat(self) -> None:
        jobs = self.active.snapshot()
        with session_scope(self.url, immediate=True) as s:
            held = leases.renew(s, self.worker_id, [j.lease for j in jobs], self.settings.lease_seconds,
                                ending=[j.job_id for j in jobs if j.finished])  # their last write on its way
            row = s.get(WorkerState, self.worker_id)
            if row is None and self.stopping.is_set():  # read here, in the beat's transaction: a stop that deleted
                return  # the row since this beat began set it before, and a stopped worker's row stays deleted
            if row is None:  # deleted by an operator or a DB reset: come back
                row = WorkerState(id=self.worker_id, model=self.settings.model_name, queue=self.queue,
                                  device=self.device)
                s.add(row)
            row.heartbeat_at = utcnow()
            self._check_loras(s)  # adapters loaded while it was not live (a load is held to the live workers)
            row.state = state = self._state()
            draining = bool(row.draining)
            retire = self.backend == "vllm" and self.settings.runtime_lora
            loras = lora_adapters.versions(s, self.settings.model_name) if retire else None
        if state["stopping"]:  # committed: the APIs' views read from now on leave this worker out
            self._said_unroutable()
        if loras is not None:  # the runtime adapters unloaded or replaced since leave vLLM once no job uses them
            self.inbox.put(RetireLoras(loras))  # the engine thread's to tell the engine (its only caller)
        self._publish_engine_series()
        for job in jobs:  # cancelled by the API, or our lease was lost: stop generating it
            if job.lease.job_id not in held and not job.finished:
                log.info("job %s is no longer ours (cancelled or lease lost); aborting", job.lease.job_id)
                self.abort(job.lease.job_id, job.lease.attempt)
        if draining != self.draining:
            self.draining = draining
            log.info("worker %s %s", self.worker_id, "draining: taking no new jobs" if draining else "serving again")
            self._consume(not draining)
        if state.get("routed_waiting") and self._passes_routed_on():
            with session_scope(self.url, immediate=True) as s:
                reroute(s, self.settings.redis_url, [worker_queue(self.worker_id)])
        if self.peers is not None:
            self.peers.models = lora_adapters.served_models(self.settings)  # adapters loaded (or unloaded) since
            with session_scope(self.url) as s:
                lengths = self.peers.read(s)
            if lengths:
                self.inbox.put(Learn(tuple(lengths)))

    def _publish_engine_series(self) -> None:
        """The engine's ``vllm:`` series, for the API's /metrics: vLLM's stat logger's (the process's registry), or
        those the own engine's thread observes."""
        registry = REGISTRY if self.engine_series is None else self.engine_series.registry
        try:
            engine_metrics.publish(self.redis, self.worker_id, 3 * self.settings.heartbeat_seconds + 5, registry,
                                   model_name=self.settings.model_name)
        except redis.RedisError as exc:
            log.debug("engine metrics not published: %s", exc)

    def _passes_routed_on(self) -> bool:
        """Whether the jobs prefix routing sent this worker alone go to its model's queue, for the others, at this
        beat: an API routes by a view of the workers up to ``routing.REFRESH_S`` old, so it sends them here after the
        worker stopped taking them: it drains, it stops (a warm shutdown's grace, an engine given up on: its consumer
        is gone, but it beats and looks live until ``stop``), or it has no batch room (the batch jobs there wait until
        a job of its own ends, while another worker has room; an interactive one waits there only until its consumer
        takes it, as this worker reads the model's queue too)."""
        return self.draining or self.shutting_down or not self._has_room(BATCH_PRIORITY)

    def _consume(self, on: bool) -> None:
        """Starts or stops consuming this worker's queues (Celery's add_consumer/cancel_consumer, which its consumer
        applies in its own loop): a draining worker leaves the messages in the broker for the other workers, instead
        of taking each and handing it back (``accept``: at most the one in hand when the drain began); those routed
        to it alone go to its model's queue at each heartbeat (``heartbeat``)."""
        if self.consumer_name is None:
            return
        control = get_celery(self.settings.redis_url).control
        try:
            for queue in self.queues:
                if on:
                    control.add_consumer(queue, destination=[self.consumer_name], reply=False)
                else:
                    control.cancel_consumer(queue, destination=[self.consumer_name], reply=False)
        except Exception as exc:  # kombu's errors and socket errors alike: accept still hands messages back
            log.warning("worker %s could not %s consuming its queues: %s", self.worker_id,
                        "resume" if on else "stop", exc)

    def abort(self, job_id: str, attempt: int | None = None) -> None:
        """Stops the job's attempt here (``attempt``: only that one; None: whichever this worker serves)."""
        with self.active.lock:  # after the job's Add (the intake queues it under this lock)
            if job_id in self.active:
                self.inbox.put(Abort(job_id, attempt))

    def _heartbeat_loop(self) -> None:
        while True:
            self.beat_now.wait(self.settings.heartbeat_seconds)  # a period, or less where something woke it
            self.beat_now.clear()
            if self.stopping.is_set():
                return
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
                          holder_stale_s=self.settings.lease_seconds, silent_s=routing.live_seconds(self.settings),
                          max_attempts=self.settings.max_attempts,
                          served=self.settings.served_models)
                finalize_open_batches(self.url, self.settings.data_dir, self.settings.redis_url)  # batch fan-in
                # cancelled batches whose fan-out died uncounted, their cancel's count lost with its API; then the
                # working folders no batch's end deleted (its fan-out run was killed)
                count_abandoned_cancels(self.settings)
                drop_left_working_dirs(self.url, self.settings.data_dir)
                with session_scope(self.url) as s:
                    delete_expired_files(s)  # the Files API's expires_after
                    delete_settled(s, timedelta(days=self.settings.webhook_retention_days))  # webhook deliveries
                    lora_adapters.prune_unloaded(s)  # unloaded adapters whose jobs have all ended
                restart_stalled_validation(self.settings)  # batches whose API died while validating them
                advance_open_runs(self.settings, self.worker_id)  # summarization runs, whichever process started them
            except Exception:
                log.exception("sweep failed")

    def _webhook_loop(self) -> None:
        """Sends the tenants' due webhook deliveries (its own thread: an endpoint that is slow to answer holds up
        no sweep)."""
        s = self.settings
        while not self.stopping.wait(WEBHOOK_POLL_S):
            try:
                with session_scope(self.url) as session:
                    deliver_due(session, retry_s=s.webhook_retry_s, max_attempts=s.webhook_max_attempts,
                                timeout_s=s.webhook_timeout_s, private_targets=s.webhook_private_targets)
            except Exception:
                log.exception("webhook delivery failed")

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


def _wait_for_redis(url: str, wait_s: float = 30.0) -> None:
    """Returns once Redis answers at ``url``; a worker started beside Redis waits ``wait_s`` for it, then stops with
    the reason."""
    if (silent := redis_silent(url, wait_s)) is not None:
        raise SystemExit(f"Redis at REDIS_URL does not answer ({silent}); start it or fix the URL")


def no_redis_url(settings: Settings) -> str:
    """Why a worker without REDIS_URL does not start, and the URL to give it where `coserve up` serves from its data
    directory (a second worker beside it, the usual reason to run one there)."""
    recorded = recorded_redis_url(settings.data_dir)
    if recorded is None:
        return "REDIS_URL is not set; start Redis (or use `coserve up`) and export REDIS_URL"
    return (f"REDIS_URL is not set; `coserve up` recorded its Redis at {recorded} in {settings.data_dir.resolve()}: "
            f"to serve beside it, REDIS_URL={recorded} coserve worker")


def run_worker(settings: Settings) -> None:
    """``coserve worker``: migrate, load the model, consume the model's queue until stopped."""
    if not settings.redis_url:
        raise SystemExit(no_redis_url(settings))
    _wait_for_redis(settings.redis_url)  # before the model loads: minutes lost to a typo in the URL otherwise
    # Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. On a CPU shared with the API
    # and Redis, spinning threads stalled every parallel region (bench_spec_engine with one core busy:
    # 6.2 -> 12.5 tok/s); on a quiet machine the two settings measured the same. An explicit value wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    size_pool(settings.sqlalchemy_url, settings.database_pool)
    upgrade(settings.sqlalchemy_url)
    runtime = GpuWorker(settings)
    runtime.start()
    app = get_celery(settings.redis_url)
    app.coserve_worker = runtime  # the task reaches the runtime through its app
    taken.record_deliveries(runtime.redis, runtime.worker_id)  # the message in hand, for the sweep that finds it lost

    @worker_shutting_down.connect(weak=False)
    def _on_shutdown(**_kw):
        runtime.begin_shutdown()  # a task waiting for engine room gives its job back; the APIs route here no more
    # host_format: %h is the machine's name, as `celery worker -n` expands it (Celery's Worker does not)
    runtime.consumer_name = host_format(f"{runtime.worker_id}@%h")
    worker = consumer(app, runtime.queues, runtime.consumer_name)
    try:
        worker.start()
    finally:
        # a warm shutdown (SIGTERM) lets running jobs finish for a grace; a cold one (SIGQUIT) gives them back at once
        runtime.stop(0.0 if cold_shutdown() else settings.stop_grace_seconds)
    if runtime.broken is not None:
        raise SystemExit(f"worker {runtime.worker_id}: the engine is broken ({runtime.broken}); its jobs were "
                         "given back to the queue")


def exit_quickly(stopped: bool) -> None:
    """Spares the worker's process the interpreter's last full collection at exit, which walks torch's, the model's,
    the tokenizer's and SQLAlchemy's objects (seconds of a shared CPU that `coserve up`'s restart and Ctrl-C and each
    test's stop waited for; some 840k objects and 13 s with vLLM imported). Without vLLM it freezes them: reference
    counts still free them, atexit handlers and logs run as before. With vLLM imported a freeze would have triton's
    bindings (nanobind) report each object of theirs left frozen as leaked, some twenty lines on stderr at every
    exit; there a worker that ``stopped`` (its engine shut, its jobs handed back) ends here instead, without the
    teardown: its atexit handlers run, its logs and streams are flushed, then ``os._exit(0)``. A worker that ended in
    an error keeps the teardown, its traceback and its exit code. Only where the process ends next (``main``):
    `coserve worker` may run inside another program's process (a test's CliRunner), whose objects must stay
    collectable."""
    if "vllm" not in sys.modules:
        gc.freeze()
    elif stopped:
        atexit._run_exitfuncs()  # what the teardown would have run first (vLLM's, multiprocessing's, logging's)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main() -> None:
    configure_logging()
    try:
        run_worker(Settings())
    except BaseException:
        exit_quickly(stopped=False)
        raise
    exit_quickly(stopped=True)


if __name__ == "__main__":
    main()
