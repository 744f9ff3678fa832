"""The worker's threads keep one writer each (issue 19, item 6): each race the code review found,
reproduced against the real DB and Redis with the real engine thread and outbox around a real
``Engine`` on the simulated executor (or a stand-in engine where the race needs one)."""

from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
import redis
from sqlalchemy import select

from app.auth import authenticate
from app.db.models import Job, JobEvent
from app.db.session import session_scope
from app.embedded import start_redis
from app.schemas import JobCreate
from app.services import dispatch as dispatch_module
from app.services.jobs import submit_job
from app.services.streaming import StreamEvent, stream_key
from gpu_runtime.engine import Engine, RequestOutput
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.qos import QoSClass, QoSSpec, Tier
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.scheduler.registry import create_scheduler
from tests.conftest import free_port, wait_for
from tests.unit.scheduler.helpers import COST
from workers import control, engine_thread as engine_thread_module, outbox as outbox_module
from workers import lease as leases
from workers.active_job import ActiveJob, ActiveJobs
from workers.celery_app import INTERACTIVE_PRIORITY
from workers.engine_thread import EngineThread, relegation_detail
from workers.gpu_worker import GpuWorker
from workers.inbox import Abort, Add
from workers.outbox import Outbox, StepRecords

pytestmark = pytest.mark.integration


def sim_engine() -> Engine:
    """An engine on the simulated executor under QoServe, for a worker the test drives step by step."""
    return Engine(SimExecutor(COST, kv_blocks=256, block_size=16), create_scheduler("qoserve", cost_model=COST))


def leased_on_sim_engine(settings, keys) -> tuple[GpuWorker, Engine, EngineThread, str]:
    """A worker on ``sim_engine()`` and a paid job (12 tokens) it has leased into that engine, not yet stepped."""
    worker = GpuWorker(settings)
    engine = sim_engine()
    engine_thread = worker.attach(engine)
    with session_scope(settings.sqlalchemy_url) as s:
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="hello there", max_tokens=12),
                            settings, dispatch=False).job.id
    worker.accept(job_id)
    return worker, engine, engine_thread, job_id


def _request(job_id: str, tier: Tier = Tier.PAID, max_tokens: int = 4) -> Request:
    return Request(job_id, [1] * 8, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   QoSSpec(QoSClass.INTERACTIVE, tier, ttft_s=60.0, tbt_s=10.0), 0.0)


def _leased_jobs(settings, keys, worker, n: int, in_engine: bool = False) -> list[ActiveJob]:
    url = settings.sqlalchemy_url
    with session_scope(url) as s:
        principal = authenticate(s, keys.paid)
        ids = [submit_job(s, principal, JobCreate(prompt=f"p{i}", max_tokens=4), settings, dispatch=False).job.id
               for i in range(n)]
    jobs = []
    with session_scope(url) as s:
        for job_id in ids:
            lease = leases.acquire(s, job_id, worker.worker_id, 30)
            # its request named after the attempt, as the worker names it
            job = ActiveJob(lease, _request(lease.request_id), s.get(Job, job_id).created_at, in_engine=in_engine)
            worker.active.add(job)
            jobs.append(job)
    return jobs


def _finished(job: ActiveJob) -> RequestOutput:
    req = job.request
    req.output_token_ids, req.token_times, req.finish_time = [5, 6], [0.1, 0.2], 0.2
    req.status = RequestStatus.FINISHED_LENGTH
    from gpu_runtime.metrics import request_metrics

    return RequestOutput(job.request_id, [6], "", RequestStatus.FINISHED_LENGTH, metrics=request_metrics(req))


class _OneStep:
    """Returns the given outputs from its first step, then nothing."""

    has_work = True
    idle = False

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs

    def step(self) -> list[RequestOutput]:
        out, self.outputs = self.outputs, []
        return out


def _status(url: str, job_id: str) -> str:
    with session_scope(url) as s:
        return s.scalar(select(Job.status).where(Job.id == job_id))


def test_a_write_that_raises_neither_drops_the_steps_other_outputs_nor_holds_the_job(settings, keys, monkeypatch):
    worker = GpuWorker(settings)
    a, b, c = _leased_jobs(settings, keys, worker, 3, in_engine=True)
    engine_thread = worker.attach(_OneStep([_finished(a), _finished(b), _finished(c)]))
    real_finish, calls = leases.finish, {a.job_id: 0, c.job_id: 0}

    def finish(s, lease, *args, **kw):  # a's write fails once, c's every time
        if lease.job_id in calls:
            calls[lease.job_id] += 1
            if lease.job_id == c.job_id or calls[lease.job_id] == 1:
                raise RuntimeError("disk I/O error")
        return real_finish(s, lease, *args, **kw)
    monkeypatch.setattr(leases, "finish", finish)

    worker.outbox.apply(engine_thread.iterate())
    url = settings.sqlalchemy_url
    assert _status(url, b.job_id) == "succeeded"  # the write after the failed one went through
    assert _status(url, a.job_id) == "running" and a.job_id in worker.active  # retried, its lease still renewed
    for _ in range(outbox_module.MAX_TRIES):
        for record in worker.outbox._retry:
            record.not_before = 0.0
        worker.outbox.retry_due()
    assert _status(url, a.job_id) == "succeeded" and calls[a.job_id] == 2
    # c's write never succeeds: given up, the job leaves the worker, so its lease lapses for the sweeper
    assert calls[c.job_id] == outbox_module.MAX_TRIES and len(worker.active) == 0
    worker.outbox.flush_events()
    r = redis.Redis.from_url(settings.redis_url)
    ends = {j.job_id: StreamEvent.parse(r.xrange(stream_key(j.job_id))[-1][1]) for j in (a, b)}
    assert {e.status for e in ends.values()} == {"succeeded"}
    c_events = [StreamEvent.parse(raw).type for _id, raw in r.xrange(stream_key(c.job_id))]
    assert c_events == ["delta"]  # its token streamed, but no "end" for a result that is not in SQL


class _Recorder:
    """A stand-in engine that records the calls the engine thread makes."""

    has_work = False
    idle = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.requests: dict[str, Request] = {}

    def add_request(self, request: Request) -> None:
        self.calls.append(("add", request.request_id))
        self.requests[request.request_id] = request

    def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))

    def step(self) -> list:
        return []


def test_an_abort_that_arrives_before_the_engine_took_the_add_still_stops_the_job(settings, keys):
    worker = GpuWorker(settings)
    engine_thread = worker.attach(_Recorder())
    (job,) = _leased_jobs(settings, keys, worker, 1)
    worker.inbox.put(Add(job.job_id))  # the intake's add, not yet applied by the engine thread
    worker.abort(job.job_id)  # the cancel listener, in between
    engine_thread.iterate()
    assert worker.engine.calls == [("add", job.request_id), ("abort", job.request_id)]
    # an abort for a job the engine never got is not applied to a later run of the same id
    worker.inbox.put(Abort("job_unknown"))
    engine_thread.iterate()
    assert worker.engine.calls[-1] == ("abort", job.request_id)


def test_the_heartbeats_abort_of_a_lost_attempt_leaves_the_rerun_leased_here_since(settings, keys):
    """The heartbeat found attempt 1's lease lost and asks for its abort; attempt 2 of the job was leased here before
    the engine thread took it: the abort names attempt 1, and attempt 2 runs on (a cancel names no attempt)."""
    worker = GpuWorker(settings)
    engine_thread = worker.attach(_Recorder())
    (job,) = _leased_jobs(settings, keys, worker, 1, in_engine=True)
    worker.abort(job.job_id, job.lease.attempt)  # the heartbeat's
    rerun = ActiveJob(leases.Lease(job.job_id, 2, worker.worker_id), _request(f"{job.job_id}:2"), job.created_at,
                      in_engine=True)
    worker.active.add(rerun)
    worker.engine.requests[rerun.request_id] = rerun.request  # in the engine: a reconcile due meanwhile keeps it
    engine_thread.iterate()
    assert worker.engine.calls == [] and worker.active.get(job.job_id) is rerun and rerun.abort_sent_at is None
    worker.abort(job.job_id)  # the API's cancel: whichever attempt runs here
    engine_thread.iterate()
    assert worker.engine.calls == [("abort", rerun.request_id)]


def test_reconcile_gives_back_a_job_the_engine_lost(settings, keys):
    worker = GpuWorker(settings)
    engine_thread = worker.attach(_Recorder())
    kept, lost = _leased_jobs(settings, keys, worker, 2, in_engine=True)
    worker.engine.requests[kept.request_id] = kept.request  # the engine knows only one of them
    worker.outbox.apply(StepRecords(records=engine_thread.reconcile()))
    assert worker.active.snapshot_ids() == [kept.job_id]
    url = settings.sqlalchemy_url
    assert _status(url, lost.job_id) == "dispatched" and _status(url, kept.job_id) == "running"
    assert redis.Redis.from_url(settings.redis_url).llen("coserve.tiny") == 1  # sent to a worker again


def test_the_message_of_a_job_the_engine_lost_is_sent_once_its_retried_mark_is_written(settings, keys, monkeypatch):
    """The resend's mark (queued -> dispatched) fails once (a busy database) and is retried; its message, the send
    that follows it (``Record.then``), goes only once the mark is written: sent before, the job would be marked
    after its message was taken (or, sent with nothing marked yet, never sent at all)."""
    worker = GpuWorker(settings)
    engine_thread = worker.attach(_Recorder())
    (lost,) = _leased_jobs(settings, keys, worker, 1, in_engine=True)  # the engine knows none of them
    real_mark = engine_thread_module.mark_dispatched

    def locked_once(*args, **kwargs) -> bool:
        monkeypatch.setattr(engine_thread_module, "mark_dispatched", real_mark)
        raise RuntimeError("database is locked")

    monkeypatch.setattr(engine_thread_module, "mark_dispatched", locked_once)
    r = redis.Redis.from_url(settings.redis_url)
    worker.outbox.apply(StepRecords(records=engine_thread.reconcile()))
    url = settings.sqlalchemy_url
    assert _status(url, lost.job_id) == "queued" and r.llen("coserve.tiny") == 0  # given back; the mark waits
    wait_for(lambda: worker.outbox.retry_due() or not worker.outbox.pending, 10, "the mark retried")
    assert _status(url, lost.job_id) == "dispatched" and r.llen("coserve.tiny") == 1


class _Stuck:
    """Work admitted that the scheduler cannot place (e.g. all KV held): every step runs nothing."""

    has_work = True
    idle = True

    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> list:
        self.steps += 1
        return []


def test_an_engine_with_nothing_schedulable_is_not_spun(settings):
    worker = GpuWorker(settings)
    engine_thread = worker.attach(_Stuck())
    loop = threading.Thread(target=engine_thread.run, daemon=True)
    loop.start()
    time.sleep(0.5)
    worker.stopping.set()
    worker.inbox.wake()
    loop.join(5)
    # backing off 1 ms -> 50 ms: about 15 steps in 0.5 s (a spinning loop makes thousands)
    assert 3 <= worker.engine.steps <= 40, worker.engine.steps
    steps = worker.engine.steps
    worker.stopping.clear()
    worker.inbox.put(Abort("x"))  # a command wakes it at once
    started = time.monotonic()
    engine_thread.iterate()
    assert time.monotonic() - started < 0.1 and worker.engine.steps == steps + 1


def test_relegated_jobs_leave_room_under_the_in_flight_cap(settings, keys):
    """The cap counts the jobs the engine serves in line. Relegated jobs (shed under overload, waiting for spare
    capacity) leave room, so new arrivals reach the scheduler instead of waiting in the queue's FIFO order; a
    resumed job counts again."""
    worker = GpuWorker(settings.model_copy(update={"max_inflight": 2}))
    a, b = _leased_jobs(settings, keys, worker, 2, in_engine=True)
    stand_in = _OneStep([RequestOutput(j.request_id, status=RequestStatus.RELEGATED, event="relegated")
                         for j in (a, b)])
    stand_in.executor = SimExecutor(COST, kv_blocks=64, block_size=16)  # the intake reads the engine's clock
    stand_in.add_request = lambda request: None
    engine_thread = worker.attach(stand_in)
    worker.outbox.apply(engine_thread.iterate())
    assert _status(settings.sqlalchemy_url, a.job_id) == "relegated"
    assert (worker.active.in_line, worker.active.relegated, worker._state()["relegated_jobs"]) == (0, 2, 2)
    with session_scope(settings.sqlalchemy_url) as s:  # the operator's history says why
        detail = s.scalars(select(JobEvent.detail).where(JobEvent.job_id == a.job_id,
                                                         JobEvent.to_status == "relegated")).one()
    assert detail.startswith("engine relegated it (paid tier): its ") and " s TTFT deadline " in detail, detail

    with session_scope(settings.sqlalchemy_url) as s:
        new = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="new", max_tokens=4), settings).job.id
    intake = threading.Thread(target=worker.accept, args=(new,), daemon=True)
    intake.start()
    intake.join(10)
    assert not intake.is_alive() and new in worker.active  # taken at once: two held, none in line

    stand_in.outputs = [RequestOutput(a.request_id, status=RequestStatus.WAITING, event="resumed")]
    worker.outbox.apply(engine_thread.iterate())
    assert (worker.active.in_line, worker.active.relegated) == (2, 1)
    worker.active.pop(b.job_id)  # b leaves (finished or expired): the count follows
    assert (worker.active.in_line, worker.active.relegated) == (2, 0)


def test_a_promotion_reaches_the_scheduler_through_the_inbox_and_keeps_its_tier_counts(settings):
    """The operator names the job; the engine thread promotes the request of the attempt it serves (its own id)."""
    worker = GpuWorker(settings)
    engine = Engine(SimExecutor(COST, kv_blocks=64, block_size=16), create_scheduler("qoserve", cost_model=COST))
    engine_thread = worker.attach(engine)
    lease = leases.Lease("free-job", 1, worker.worker_id)
    free = _request(lease.request_id, Tier.FREE)
    worker.active.add(ActiveJob(lease, free, None, in_engine=True))
    engine.add_request(free)
    engine.step()  # admitted and waiting or running
    control.handle(worker.inbox, {"action": "promote", "job_id": "free-job", "tier": "paid"})
    assert free.qos.tier is Tier.FREE  # the control thread changed nothing itself
    engine_thread.iterate()  # the engine thread applies it, the next step the scheduler
    engine.step()
    assert free.qos.tier is Tier.PAID and engine.scheduler.free_waiting == 0
    engine.abort("free-job")
    engine.step()
    assert engine.scheduler.free_waiting == 0 and engine.scheduler.num_unfinished == 0


def _listening(settings, worker: GpuWorker, stop: threading.Event) -> None:
    """The worker's own control listener (``workers.control``) on its inbox, subscribed before this returns."""
    control.start_control_listener(worker.inbox, worker.worker_id, settings.redis_url, stop)
    r = redis.Redis.from_url(settings.redis_url)
    wait_for(lambda: dict(r.pubsub_numsub(control.control_channel(worker.worker_id)))
             .get(control.control_channel(worker.worker_id).encode()), 5, "the control listener's subscription")


@pytest.mark.parametrize("registered", [False, True], ids=["before_the_job_is_registered", "before_its_add"])
def test_a_promote_written_as_the_intake_adds_the_job_takes_effect_on_that_attempt(client, keys, settings,
                                                                                   registered):
    """An admin promote written just after the worker's lease committed, before its engine thread had the job's add,
    is delivered (the worker holds the job in SQL) and comes to the engine thread before the add (the intake had not
    registered the job yet, or had and its add is behind the promote in the inbox): the request is added at the new
    tier, not at the one its lease read (the engine thread dropped it, and the attempt ran at the old tier while SQL
    and the admin's answer said the new one)."""
    worker = GpuWorker(settings)
    engine = sim_engine()
    engine_thread = worker.attach(engine)
    stop = threading.Event()
    _listening(settings, worker, stop)
    with session_scope(settings.sqlalchemy_url) as s:
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="hello there", max_tokens=4),
                            settings, dispatch=False).job.id
    register, answers = worker.active.add, []

    def promoted_as_added(job: ActiveJob) -> None:  # the intake, between its lease's commit and its add
        if registered:
            register(job)
        answers.append(client.post(f"/admin/api/jobs/{job_id}/promote", json={"tier": "free"},
                                   headers={"Authorization": f"Bearer {keys.admin}"}).json())
        wait_for(lambda: len(worker.inbox), 5, "the promote in the worker's inbox")
        if not registered:
            worker.outbox.apply(engine_thread.iterate())  # the engine thread takes it before the job is there
            register(job)

    worker.active.add = promoted_as_added
    try:
        worker.accept(job_id)
    finally:
        stop.set()
    assert answers[0]["delivered"] is True and answers[0]["worker_id"] == worker.worker_id, answers
    worker.outbox.apply(engine_thread.iterate())  # the add, and a step of the engine
    job = worker.active.get(job_id)
    assert job.in_engine and job.request.qos.tier is Tier.FREE


def test_a_promote_kept_for_an_attempt_never_added_is_not_applied_to_a_later_one(settings, keys):
    """A promote that came before its job's add names the attempt the admin's write found: a later attempt of the
    job, whose lease read the tier after that promote (and maybe after others since), keeps the tier its lease read."""
    worker = GpuWorker(settings)
    engine_thread = worker.attach(_Recorder())
    (job,) = _leased_jobs(settings, keys, worker, 1)  # attempt 1, registered, its add not queued yet
    worker.active.pop(job.job_id)  # it leaves before its add (its lease lost meanwhile)
    control.handle(worker.inbox, {"action": "promote", "job_id": job.job_id, "tier": "free", "attempt": 1})
    engine_thread.iterate()
    rerun = ActiveJob(leases.Lease(job.job_id, 2, worker.worker_id), _request(f"{job.job_id}:2"), job.created_at)
    with worker.active.lock:
        worker.active.add(rerun)
        worker.inbox.put(Add(job.job_id))
    engine_thread.iterate()
    assert worker.engine.calls == [("add", rerun.request_id)] and rerun.request.qos.tier is Tier.PAID


class _Heard:
    """An inbox that records what the control handler hands it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def promote(self, job_id: str, tier: Tier, attempt: int | None = None) -> None:
        self.calls.append(("promote", job_id, tier))

    def resume(self, job_id: str) -> None:
        self.calls.append(("resume", job_id))


def test_a_relegation_says_the_tier_and_the_deadline_that_was_missed_or_predicted_to_be():
    now = datetime.now(UTC)

    def job(qos: QoSSpec, age_s: float, first_token: bool = False) -> ActiveJob:
        request = Request("j", [1] * 8, SamplingParams(max_tokens=4), qos, 0.0)
        return ActiveJob(leases.Lease("j", 1, "w"), request, now - timedelta(seconds=age_s),
                         first_token_recorded=first_token)

    batch = QoSSpec(QoSClass.BATCH, Tier.FREE, ttlt_s=600.0)
    chat = QoSSpec(QoSClass.INTERACTIVE, Tier.PAID, ttft_s=2.0, tbt_s=0.05)
    assert re.fullmatch(r"engine relegated it \(free tier\): its 600 s TTLT deadline predicted to be missed, "
                        r"due in 5(70\.0|69\.9) s", relegation_detail(job(batch, 30)))
    assert relegation_detail(job(chat, 5)).startswith(
        "engine relegated it (paid tier): its 2 s TTFT deadline passed 3.")
    assert relegation_detail(job(chat, 5, first_token=True)) == (
        "engine relegated it (paid tier): its stream fell behind its 50 ms TBT")


def test_a_promotion_resumes_the_job_only_when_the_admin_moved_it_up():
    down, up = _Heard(), _Heard()
    assert control.handle(down, {"action": "promote", "job_id": "j", "tier": "free", "resume": False})
    assert control.handle(up, {"action": "promote", "job_id": "j", "tier": "paid", "resume": True})
    assert down.calls == [("promote", "j", Tier.FREE)]
    assert up.calls == [("promote", "j", Tier.PAID), ("resume", "j")]


def test_stream_events_wait_in_order_while_redis_is_away(tmp_path, settings):
    port = free_port()
    client = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.5, socket_timeout=1.0)
    box = Outbox(settings.sqlalchemy_url, client, ActiveJobs())
    deltas = [("job_a", StreamEvent("delta", 1, t, [i], offset=3 * i)) for i, t in enumerate(("one", "two", "thr"))]
    box.apply(StepRecords(deltas=deltas[:2]))
    box.flush_events()  # Redis is down: nothing is lost
    assert box.pending == 2
    box.apply(StepRecords(deltas=deltas[2:]))
    proc, url = start_redis(tmp_path / "redis", port)
    try:
        box._publish_after = 0.0
        box.flush_events()
        assert box.pending == 0
        got = [StreamEvent.parse(raw) for _id, raw in redis.Redis.from_url(url).xrange(stream_key("job_a"))]
        assert [(e.text, e.offset) for e in got] == [("one", 0), ("two", 3), ("thr", 6)]
    finally:
        proc.terminate()
        proc.wait(10)


def _ended(job: ActiveJob, status: RequestStatus, tokens: int, text: str = "", counted: bool = True) -> RequestOutput:
    """The engine's last output for ``job``: ``tokens`` generated in all, the last one (with ``text``) in this
    output where it finished by itself; ``counted`` False: an output without metrics."""
    from gpu_runtime.metrics import request_metrics

    req = job.request
    req.output_token_ids, req.token_times = [5] * tokens, [0.1 * (i + 1) for i in range(tokens)]
    req.status, req.finish_time = status, 1.0
    new = [5] if status is not RequestStatus.FINISHED_ABORTED else []
    return RequestOutput(job.request_id, new, text, status, metrics=request_metrics(req) if counted else None)


def test_a_job_cancelled_while_it_runs_keeps_what_its_engine_produced(settings, keys):
    """The API cancelled the job (status cancelled) while this attempt ran it: the engine's abort writes the text and
    token counts it produced on the job, as does a finish that raced the cancel, and an abort of a job whose prompt
    the engine had begun (its prompt tokens, no output); the job stays cancelled, and its stream gets one ``kept``
    event from the worker once that is written (the API's cancel waits for it). An abort for a job that is no longer
    this attempt's (its lease was lost, it ran again elsewhere or waits to) writes nothing and says nothing, nor
    does one the engine never scheduled or did not count write anything."""
    from app.db.models import JobEvent
    from app.services.jobs import cancel_job

    worker = GpuWorker(settings)
    jobs = _leased_jobs(settings, keys, worker, 7, in_engine=True)
    cancelled, finishing, rerun, requeued, silent, uncounted, prefilled = jobs
    url = settings.sqlalchemy_url
    with session_scope(url) as s:
        leases.release(s, rerun.lease, "lease lost")
        assert leases.acquire(s, rerun.job_id, "w2", 30).attempt == 2  # another worker runs it now
        leases.release(s, requeued.lease, "lease lost")  # back in the queue, at the same attempt
        for job in jobs:
            cancel_job(s, s.get(Job, job.job_id))
    stand_in = _OneStep([RequestOutput(j.request_id, [5, 5], "Hello", RequestStatus.DECODING) for j in jobs
                         if j not in (silent, prefilled)])
    engine_thread = worker.attach(stand_in)
    worker.outbox.apply(engine_thread.iterate())  # tokens streamed before the worker heard of the cancel
    prefilled.request.scheduled_time = 0.05  # its first prompt chunk ran; no token yet
    stand_in.outputs = [_ended(cancelled, RequestStatus.FINISHED_ABORTED, 2),
                        _ended(finishing, RequestStatus.FINISHED_LENGTH, 3, " world"),
                        *(_ended(j, RequestStatus.FINISHED_ABORTED, 2) for j in (rerun, requeued)),
                        _ended(silent, RequestStatus.FINISHED_ABORTED, 0),
                        _ended(uncounted, RequestStatus.FINISHED_ABORTED, 2, counted=False),
                        _ended(prefilled, RequestStatus.FINISHED_ABORTED, 0)]
    worker.outbox.apply(engine_thread.iterate())
    worker.outbox.flush_events()
    assert len(worker.active) == 0  # every one of them left the worker

    with session_scope(url) as s:
        rows = {j.job_id: s.get(Job, j.job_id) for j in jobs}
        kept = {j.job_id: (r.output_text, r.completion_tokens, r.prompt_tokens, r.cached_tokens)
                for j in jobs if (r := rows[j.job_id]).completion_tokens is not None}
        assert kept == {cancelled.job_id: ("Hello", 2, 8, 0), finishing.job_id: ("Hello world", 3, 8, 0),
                        prefilled.job_id: ("", 0, 8, 0)}
        assert {(r.status, r.finish_reason) for r in rows.values()} == {("cancelled", "cancelled")}
        # the timings it made before the cancel, as vLLM records a time to first token when the token comes
        assert rows[cancelled.job_id].ttft_s == pytest.approx(0.1 - cancelled.request.arrival_time)
        assert rows[prefilled.job_id].ttft_s is None
        assert rows[prefilled.job_id].queue_s == pytest.approx(0.05 - prefilled.request.arrival_time)
        assert all(r.output_text is None for r in rows.values() if r.id not in kept)
        assert (rows[rerun.job_id].attempt, rows[rerun.job_id].worker_id) == (2, "w2")
        ends = s.scalars(select(JobEvent.to_status).where(JobEvent.job_id.in_(list(kept)),
                                                          JobEvent.from_status == "running")).all()
        assert ends == ["cancelled"] * 3  # no other terminal transition
    r = redis.Redis.from_url(settings.redis_url)
    streams = {j.job_id: [StreamEvent.parse(raw) for _id, raw in r.xrange(stream_key(j.job_id))] for j in jobs}
    deltas = {j.job_id: 0 if j in (silent, prefilled) else 2 if j is finishing else 1 for j in jobs}
    for job in (cancelled, finishing, silent, uncounted, prefilled):
        events = streams[job.job_id]
        assert [e.type for e in events] == ["delta"] * deltas[job.job_id] + ["kept"], job.job_id
        usage = kept.get(job.job_id)
        assert events[-1].data == ({} if usage is None else {"prompt_tokens": usage[2], "completion_tokens":
                                                             usage[1], "cached_tokens": usage[3],
                                                             "reasoning_tokens": None,  # no reasoning parser
                                                             "cache_write_tokens": 0})  # the own engine: no cache
    for job in (rerun, requeued):  # no word from a worker that no longer runs the attempt
        assert [e.type for e in streams[job.job_id]] == ["delta"]


def test_a_cancelled_jobs_tokens_are_kept_when_its_write_comes_a_lease_after_the_cancel(settings, keys):
    """A loaded machine: the engine confirmed the abort of a job the API cancelled (a client hung up), and the write
    of what it produced still waits in the outbox a lease after the cancel. The worker beats on: it keeps the job's
    lease until that write, so the sweeper does not settle the end as it stands (no token count, a late write then
    refused), and the job keeps its tokens (e2e test_client_hangups saw ``completion_tokens`` None under load)."""
    from sqlalchemy import update

    from app.services.jobs import cancel_job
    from app.services.transitions import utcnow
    from workers.sweeper import sweep

    worker = GpuWorker(settings)
    (job,) = _leased_jobs(settings, keys, worker, 1, in_engine=True)
    stand_in = _OneStep([RequestOutput(job.request_id, [5, 5], "Hello", RequestStatus.DECODING)])
    engine_thread = worker.attach(stand_in)
    worker.outbox.apply(engine_thread.iterate())
    url = settings.sqlalchemy_url
    with session_scope(url) as s:
        cancel_job(s, s.get(Job, job.job_id))
    stand_in.outputs = [_ended(job, RequestStatus.FINISHED_ABORTED, 2)]
    unwritten = engine_thread.iterate()  # the abort's record, not yet taken by the outbox's I/O thread
    assert job.finished and job.job_id in worker.active
    with session_scope(url) as s:  # the cancel was a lease and more ago, and the lease its beats gave runs out now
        now = utcnow()
        s.execute(update(Job).where(Job.id == job.job_id).values(
            finished_at=now - timedelta(seconds=settings.lease_seconds + 1), lease_expires_at=now))
    worker.heartbeat()  # the one beat since (a loaded machine)
    with session_scope(url) as s:
        sweep(s, settings.redis_url, queued_grace_s=0)  # a dead worker's stopped jobs settle as they stand
    worker.outbox.apply(unwritten)
    with session_scope(url) as s:
        row = s.get(Job, job.job_id)
        assert (row.status, row.output_text, row.completion_tokens) == ("cancelled", "Hello", 2)
        assert row.settled_at is not None and row.lease_expires_at is None
    assert job.job_id not in worker.active


def test_a_nul_the_model_generates_is_streamed_and_stored_as_the_replacement_character(settings, keys):
    """PostgreSQL's text holds no NUL, and a model may generate one (a byte token): the stream and SQL agree on
    U+FFFD, so the job's result is written on every database."""
    worker = GpuWorker(settings)
    (job,) = _leased_jobs(settings, keys, worker, 1, in_engine=True)
    stand_in = _OneStep([RequestOutput(job.request_id, [5], "a\x00", RequestStatus.DECODING)])
    engine_thread = worker.attach(stand_in)
    worker.outbox.apply(engine_thread.iterate())
    stand_in.outputs = [_ended(job, RequestStatus.FINISHED_LENGTH, 2, "\x00b")]
    worker.outbox.apply(engine_thread.iterate())
    worker.outbox.flush_events()
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, job.job_id).output_text == "a\ufffd\ufffdb"
    events = [StreamEvent.parse(raw) for _id, raw in redis.Redis.from_url(settings.redis_url).xrange(
        stream_key(job.job_id))]
    assert [(e.text, e.offset) for e in events if e.type == "delta"] == [("a\ufffd", 0), ("\ufffdb", 2)]


def _lapse_and_requeue(settings, job_id: str) -> None:
    """The worker's heartbeat was late (a busy database): the lease lapses and a sweeper requeues and resends."""
    from datetime import timedelta

    from sqlalchemy import update

    from app.services.transitions import utcnow
    from workers.sweeper import sweep

    # SQLite's write lock from each transaction's start, as the workers' sweeper takes it: a read that turns into a
    # write fails at once ("database is locked") where the running worker committed in between
    with session_scope(settings.sqlalchemy_url, immediate=True) as s:
        s.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        s.commit()
        sweep(s, settings.redis_url, queued_grace_s=0)


def test_a_job_that_comes_back_to_the_worker_still_running_it_runs_once_in_its_engine(settings, keys):
    """The earlier attempt still running here is aborted and set aside before the next is added (the engine knows
    each by its own request id), and the result is the new attempt's alone."""
    url = settings.sqlalchemy_url
    worker, engine, engine_thread, job_id = leased_on_sim_engine(settings, keys)
    for _ in range(5):  # attempt 1 runs: its prompt and a few tokens
        worker.outbox.apply(engine_thread.iterate())
    first = worker.active.get(job_id)
    assert first.lease.attempt == 1 and first.request.num_output_tokens > 0
    _lapse_and_requeue(settings, job_id)
    worker.accept(job_id)  # the resend comes back here at once: attempt 1 must go first (the message is sent back)
    assert worker.active.get(job_id) is first
    worker.outbox.apply(engine_thread.iterate())  # the engine aborts attempt 1; its record leaves the worker
    assert job_id not in worker.active and first.request.status is RequestStatus.FINISHED_ABORTED
    worker.accept(job_id)  # the message again: attempt 2 now
    second = worker.active.get(job_id)
    assert second.lease.attempt == 2
    for _ in range(60):
        worker.outbox.apply(engine_thread.iterate())
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert (job.status, job.attempt, job.completion_tokens) == ("succeeded", 2, second.request.num_output_tokens)
    assert not engine.has_work


def test_a_job_that_comes_back_while_its_attempt_still_runs_here_leaves_the_intake_free(settings, keys):
    """The resend of a job whose lease lapsed while it ran here comes back to this worker. The intake (the Celery
    consumer, which takes one message at a time) puts the set-aside of attempt 1 in the inbox and returns at once: it
    waits neither for the engine thread nor hands the message back while attempt 1 is still served (a take of it
    then waited again). The engine thread, setting attempt 1 aside, hands the message back through its outbox, after
    attempt 1's last stream events; the next take runs attempt 2. (The intake waited up to a second for the engine
    thread, every message behind it with it, and then handed the message back all the same.)"""
    worker, _engine, engine_thread, job_id = leased_on_sim_engine(settings, keys)
    for _ in range(5):  # attempt 1 runs: its prompt and a few tokens
        worker.outbox.apply(engine_thread.iterate())
    first = worker.active.get(job_id)
    _lapse_and_requeue(settings, job_id)
    r = redis.Redis.from_url(settings.redis_url)
    waiting = r.llen("coserve.tiny")
    worker.accept(job_id)  # the resend comes back here; no engine thread runs meanwhile
    assert worker.active.get(job_id) is first and r.llen("coserve.tiny") == waiting  # in no one's hand yet
    worker.outbox.apply(engine_thread.iterate())  # the engine thread sets attempt 1 aside; its message waits for
    assert worker.active.get(job_id) is None and r.llen("coserve.tiny") == waiting  # attempt 1's deltas in Redis
    worker.outbox.flush_events()  # they are published: the message goes back
    assert r.llen("coserve.tiny") == waiting + 1
    assert job_id.encode() in r.lindex("coserve.tiny", -1)  # at the head: the next message a consumer takes
    worker.accept(job_id)  # the message again
    second = worker.active.get(job_id)
    assert second is not None and second.lease.attempt == 2


def _last_deltas_held(worker, engine_thread, job_id: str):
    """Attempt 1 runs (its prompt and a few tokens, published), then Redis goes away to the outbox and attempt 1's
    last deltas wait there. The outbox's Redis to put back once it is reachable again, and attempt 1."""
    for _ in range(5):
        worker.outbox.apply(engine_thread.iterate())
    worker.outbox.flush_events()
    reachable, worker.outbox.redis = worker.outbox.redis, redis.Redis(port=free_port())
    worker.outbox.put(engine_thread.iterate())
    return reachable, worker.active.get(job_id)


@contextmanager
def _threads_running(worker, engine_thread):
    """The worker's outbox (I/O) thread and its engine thread running for the block, stopped after it."""
    worker.outbox.start()
    loop = threading.Thread(target=engine_thread.run, name="coserve-engine", daemon=True)
    loop.start()
    try:
        yield
    finally:
        worker.stopping.set()
        loop.join(5)
        worker.outbox.close()


def _counting_streamed(r, send, streamed: list[int]):
    """``send`` (a message's send to its queue) that first notes how many of attempt 1's tokens the job's stream in
    Redis holds as the message goes."""
    def counted(url, sent_job_id, queue, priority, **kw):
        events = [StreamEvent.parse(raw) for _id, raw in r.xrange(stream_key(sent_job_id))]
        streamed.append(sum(len(e.token_ids) for e in events if e.type == "delta" and e.attempt == 1))
        return send(url, sent_job_id, queue, priority, **kw)
    return counted


def test_a_superseded_attempts_last_deltas_are_in_redis_before_the_reruns_message_is_back_on_its_queue(
        settings, keys, monkeypatch):
    """The engine thread sets attempt 1 aside (``Supersede``) while attempt 1's last deltas wait in the outbox (Redis
    refused the outbox's publish). The rerun's message goes back to its queue only once they are in Redis, so any
    worker of the model that takes it goes on from every token attempt 1 streamed. (The I/O thread sent it back as it
    took the set-aside, before those deltas: a worker that took it went on from fewer tokens than attempt 1 made.)"""
    worker, _engine, engine_thread, job_id = leased_on_sim_engine(settings, keys)
    reachable, first = _last_deltas_held(worker, engine_thread, job_id)
    r = redis.Redis.from_url(settings.redis_url)
    streamed_at_send: list[int] = []  # attempt 1's tokens in the job's stream in Redis as the message goes back
    monkeypatch.setattr(engine_thread_module, "send_back",
                        _counting_streamed(r, engine_thread_module.send_back, streamed_at_send))
    _lapse_and_requeue(settings, job_id)
    waiting = r.llen("coserve.tiny")
    worker.accept(job_id)  # the resend comes back here: given over to the engine thread
    with _threads_running(worker, engine_thread):  # the I/O thread takes attempt 1's last step, then the set-aside
        wait_for(lambda: worker.active.get(job_id) is None and worker.outbox._steps.empty(), 10, "the set-aside")
        worker.outbox.redis = reachable  # Redis is back
        wait_for(lambda: r.llen("coserve.tiny") == waiting + 1, 10, "the rerun's message back on its queue")
    assert streamed_at_send == [first.tokens]


def test_a_job_an_engine_error_gave_back_is_sent_again_once_its_last_deltas_are_in_redis(settings, keys, monkeypatch):
    """An engine step raises while attempt 1's last deltas wait in the outbox (Redis refused the outbox's publish).
    The job is given back and marked dispatched at once (a sweep meanwhile does not send it: it was not left queued),
    and its message goes to the head of its queue only once those deltas are in Redis, so any worker of the model
    that takes it goes on from every token attempt 1 streamed. (The I/O thread sent it as it took the engine's error,
    before those deltas: a worker that took it went on from fewer tokens than attempt 1 made.)"""
    from workers.sweeper import sweep

    worker, engine, engine_thread, job_id = leased_on_sim_engine(settings, keys)
    reachable, first = _last_deltas_held(worker, engine_thread, job_id)
    r = redis.Redis.from_url(settings.redis_url)
    streamed_at_send: list[int] = []  # attempt 1's tokens in the job's stream in Redis as its message is sent
    monkeypatch.setattr(dispatch_module, "send_to", _counting_streamed(r, dispatch_module.send_to, streamed_at_send))
    real_step = engine.step

    def fails_once() -> list[RequestOutput]:
        engine.step = real_step
        raise RuntimeError("device lost")

    engine.step = fails_once
    waiting = r.llen("coserve.tiny")
    with _threads_running(worker, engine_thread):  # attempt 1's last step (its deltas wait), give-back, resend
        wait_for(lambda: _status(settings.sqlalchemy_url, job_id) == "dispatched" and worker.outbox._steps.empty(),
                 10, "the job given back and marked dispatched")
        with session_scope(settings.sqlalchemy_url, immediate=True) as s:  # a sweeper meanwhile leaves it be
            assert sweep(s, settings.redis_url, queued_grace_s=0).dispatched == 0
        assert r.llen("coserve.tiny") == waiting and streamed_at_send == []
        worker.outbox.redis = reachable  # Redis is back
        wait_for(lambda: r.llen("coserve.tiny") == waiting + 1, 10, "the job's message back on its queue")
    assert streamed_at_send == [first.tokens] and job_id.encode() in r.lindex("coserve.tiny", -1)
    assert _status(settings.sqlalchemy_url, job_id) == "dispatched"


def test_a_rerun_given_over_to_an_engine_thread_that_ended_first_goes_back_to_its_queue_at_stop(settings, keys):
    """The intake gives the message of a rerun over to the engine thread (``Supersede``); the worker stops before the
    engine thread applied it. The message goes back to the head of its queue at stop, not lost until the sweeper's
    resend of a lost message (the earlier attempt's lease releases nothing: the job is pending again)."""
    worker, _engine, engine_thread, job_id = leased_on_sim_engine(settings, keys)
    for _ in range(5):
        worker.outbox.apply(engine_thread.iterate())
    _lapse_and_requeue(settings, job_id)
    r = redis.Redis.from_url(settings.redis_url)
    waiting = r.llen("coserve.tiny")
    worker.accept(job_id)  # given over to the engine thread, which never runs again
    worker.stop(grace_s=0)
    assert r.llen("coserve.tiny") == waiting + 1 and job_id.encode() in r.lindex("coserve.tiny", -1)


def test_a_rerun_runs_and_finishes_beside_the_aborted_request_its_engine_still_holds(settings, keys):
    """The engine is told to abort attempt 1 (its lease lapsed) and never lets the request go: its scheduler drops it,
    the engine holds it unfinished. The rerun that comes back here is added beside it under its own request id and
    runs to the end, the job's result its own; when the engine at last reports attempt 1 aborted, that late word
    writes nothing, on the job or its stream. (Under one request id per job, the rerun waited for attempt 1 to leave,
    which it never did.)"""
    url = settings.sqlalchemy_url
    worker, engine, engine_thread, job_id = leased_on_sim_engine(settings, keys)
    kept: list[str] = []

    def keep(request_id: str) -> None:  # the engine thread's abort: no more scheduled, never confirmed
        engine.scheduler.abort_request(request_id)
        kept.append(request_id)

    engine.abort = keep
    for _ in range(5):  # attempt 1 runs: its prompt and a few tokens
        worker.outbox.apply(engine_thread.iterate())
    first = worker.active.get(job_id)
    assert first.lease.attempt == 1 and first.request.num_output_tokens > 0
    _lapse_and_requeue(settings, job_id)
    worker.abort(job_id)  # the heartbeat found the lease lost
    worker.outbox.apply(engine_thread.iterate())
    assert kept == [first.request.request_id] and worker.active.get(job_id) is first  # unconfirmed
    worker.accept(job_id)  # the resend comes back here; given over to the engine thread, which sets attempt 1 aside
    worker.outbox.apply(engine_thread.iterate())  # the engine thread sets attempt 1 aside
    worker.outbox.flush_events()
    worker.accept(job_id)  # the message again
    second = worker.active.get(job_id)
    assert second is not None and second.lease.attempt == 2 and second.request.request_id != first.request.request_id
    for _ in range(80):
        worker.outbox.apply(engine_thread.iterate())
    worker.outbox.flush_events()
    held = engine.requests.get(first.request.request_id)
    assert held is first.request and not held.status.finished  # the engine still holds attempt 1
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert (job.status, job.attempt) == ("succeeded", 2)
        result = (job.output_text, job.completion_tokens, job.settled_at)
    assert result[1] == len(second.output_token_ids)
    stream = redis.Redis.from_url(settings.redis_url)
    events = [StreamEvent.parse(raw) for _id, raw in stream.xrange(stream_key(job_id))]

    Engine.abort(engine, first.request.request_id)  # the engine's word on attempt 1 comes at last, in a step (the
    worker.outbox.apply(engine_thread.iterate())  # abort waiting is the engine's only work)
    worker.outbox.flush_events()
    assert first.request.request_id not in engine.requests and worker.active.abandoned_ids() == []
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert (job.status, job.attempt, job.output_text, job.completion_tokens, job.settled_at) == \
            ("succeeded", 2) + result
    assert [StreamEvent.parse(raw) for _id, raw in stream.xrange(stream_key(job_id))] == events


def test_an_earlier_attempts_last_record_leaves_a_newer_attempt_of_the_job_in_place(settings, keys):
    worker = GpuWorker(settings)
    (job,) = _leased_jobs(settings, keys, worker, 1, in_engine=True)
    old = _ended(job, RequestStatus.FINISHED_ABORTED, 2)
    engine_thread = worker.attach(_OneStep([old]))
    step = engine_thread.iterate()  # attempt 1's abort: a record that takes it off the worker once written
    newer = ActiveJob(leases.Lease(job.job_id, job.lease.attempt + 1, worker.worker_id), job.request, job.created_at)
    worker.active.add(newer)  # meanwhile the job was leased here again
    worker.outbox.apply(step)
    assert worker.active.get(job.job_id) is newer


def test_a_retried_relegation_lands_before_the_resumption_after_it(settings, keys, monkeypatch):
    """The outbox retries a failed write; a later write of the same job waits behind it, so SQL ends as the engine
    did (running), not as the retried relegation would leave it."""
    from workers import engine_thread as engine_thread_module

    worker = GpuWorker(settings)
    (job,) = _leased_jobs(settings, keys, worker, 1, in_engine=True)
    stand_in = _OneStep([RequestOutput(job.request_id, status=RequestStatus.RELEGATED, event="relegated")])
    engine_thread = worker.attach(stand_in)
    real, failed = engine_thread_module.transition, []

    def transition(s, job_id, src, dst, **kw):  # the relegation's write meets a busy database once
        if dst.value == "relegated" and not failed:
            failed.append(job_id)
            raise RuntimeError("database is locked")
        return real(s, job_id, src, dst, **kw)

    monkeypatch.setattr(engine_thread_module, "transition", transition)
    worker.outbox.apply(engine_thread.iterate())
    stand_in.outputs = [RequestOutput(job.request_id, status=RequestStatus.WAITING, event="resumed")]
    worker.outbox.apply(engine_thread.iterate())
    for record in worker.outbox._retry:
        record.not_before = 0.0
    worker.outbox.retry_due()
    assert failed and not worker.outbox._retry
    assert _status(settings.sqlalchemy_url, job.job_id) == "running"
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, job.job_id).relegation_count == 1


def test_a_rerun_that_goes_on_from_streamed_tokens_is_judged_on_pace_not_on_its_past_ttft(settings, keys):
    """Attempt 2 of a free job whose 1 ms TTFT passed long ago goes on from attempt 1's streamed tokens: its QoS says
    how many the client has and when the first went out, and the engine's policy runs it instead of relegating it as a
    fresh job that missed its TTFT."""
    url = settings.sqlalchemy_url
    worker = GpuWorker(settings)
    engine = sim_engine()
    engine_thread = worker.attach(engine)
    with session_scope(url) as s:
        job_id = submit_job(s, authenticate(s, keys.free), JobCreate(prompt="hello there", max_tokens=40, ttft_ms=1,
                                                                       tbt_ms=600_000), settings, dispatch=False).job.id
    worker.accept(job_id)
    for _ in range(8):  # attempt 1 streams a few tokens
        worker.outbox.apply(engine_thread.iterate())
    first = worker.active.get(job_id)
    assert first.request.num_output_tokens > 0
    _lapse_and_requeue(settings, job_id)
    worker.accept(job_id)  # attempt 1 is aborted first
    worker.outbox.apply(engine_thread.iterate())
    worker.outbox.flush_events()  # its stream events go out to Redis (the outbox thread's work)
    worker.accept(job_id)
    second = worker.active.get(job_id)
    assert second.lease.attempt == 2 and second.resumed is not None
    delivered = len(second.resumed.token_ids)
    assert second.request.qos.delivered == delivered and second.request.qos.first_token_s is not None
    worker.outbox.apply(engine_thread.iterate())
    assert second.request.relegation_count == 0 and second.request.status is not RequestStatus.RELEGATED
    for _ in range(80):
        worker.outbox.apply(engine_thread.iterate())
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert (job.status, job.attempt, job.completion_tokens) == ("succeeded", 2, 40)


def test_a_reruns_metrics_are_the_answers_as_its_client_saw_them(settings, keys):
    """Attempt 2 goes on from attempt 1's streamed tokens: it learns when the client got each of them (the stream's
    entry times), and its finished job keeps attempt 1's first token as the answer's (TTFT, ``first_token_at``)."""
    url = settings.sqlalchemy_url
    worker = GpuWorker(settings)
    engine = sim_engine()
    engine_thread = worker.attach(engine)
    with session_scope(url) as s:
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="hello there", max_tokens=40,
                                                                       ttft_ms=600_000, tbt_ms=600_000),
                            settings, dispatch=False).job.id
    worker.accept(job_id)
    for _ in range(8):  # attempt 1 streams a few tokens
        worker.outbox.apply(engine_thread.iterate())
    worker.outbox.flush_events()
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        first_at, created = job.first_token_at, job.created_at
    assert first_at is not None
    _lapse_and_requeue(settings, job_id)
    worker.accept(job_id)  # attempt 1 is aborted first
    worker.outbox.apply(engine_thread.iterate())
    worker.outbox.flush_events()
    worker.accept(job_id)
    second = worker.active.get(job_id)
    assert second.lease.attempt == 2 and second.resumed is not None
    assert len(second.request.delivered_times) == second.request.qos.delivered > 0
    for _ in range(80):
        worker.outbox.apply(engine_thread.iterate())
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert (job.status, job.attempt, job.completion_tokens) == ("succeeded", 2, 40)
        assert abs((job.first_token_at - first_at).total_seconds()) < 1e-3  # not the rerun's own first token
        assert job.ttft_s == pytest.approx((first_at - created).total_seconds(), abs=1e-3)
        assert job.slo_met is True


def test_a_rerun_that_supersedes_its_attempt_here_goes_on_from_the_deltas_still_in_the_outbox(settings, keys,
                                                                                                monkeypatch):
    """The engine thread sets attempt 1 aside (``Supersede``) right after a step whose deltas it put in the outbox, the
    I/O thread not having taken that step yet: the rerun waits for them to be published before it reads the stream,
    and goes on from every token attempt 1 streamed (it read the stream at once and went on from fewer, so its
    sampled tokens could part from what the client had been sent)."""
    worker, _engine, engine_thread, job_id = leased_on_sim_engine(settings, keys)
    for _ in range(5):  # attempt 1 runs: its prompt and a few tokens, published
        worker.outbox.apply(engine_thread.iterate())
    worker.outbox.flush_events()
    first = worker.active.get(job_id)
    assert first.lease.attempt == 1 and first.tokens > 0
    streamed = first.tokens
    last = engine_thread.iterate()  # one more step, put as the engine thread puts it: the I/O thread has not taken it
    assert any(j == job_id for j, _ in last.deltas) and first.tokens > streamed
    worker.outbox.put(last)
    _lapse_and_requeue(settings, job_id)
    worker.accept(job_id)  # the resend comes back here while attempt 1 still runs: given over to the engine thread
    worker.outbox.put(engine_thread.iterate())  # takes the Supersede: attempt 1 set aside, its message to go back
    assert worker.active.get(job_id) is None
    real_sleep, turns = time.sleep, []

    def outbox_thread(seconds: float) -> None:  # while the intake waits for attempt 1's deltas: the I/O thread's turn
        if not turns:
            worker.outbox.start()  # its I/O thread takes the step and publishes it
            turns.append("outbox")
        real_sleep(seconds)

    monkeypatch.setattr("workers.gpu_worker.time.sleep", outbox_thread)
    worker.accept(job_id)  # the message again, taken before the I/O thread got to attempt 1's last step
    second = worker.active.get(job_id)
    assert second is not first and second.lease.attempt == 2 and turns == ["outbox"]
    worker.outbox.close()
    assert second.resumed is not None and len(second.resumed.token_ids) == first.tokens


def test_an_abort_of_a_request_its_scheduler_no_longer_holds_is_taken_by_a_step(settings, keys):
    """A step that raised midway can leave a request the engine holds and its scheduler no longer does. The engine
    thread steps only while the engine has work: an abort waiting counts as such, so the step that takes it lets the
    request go (its KV, the job's slot) and the cancelled job settles. (Counted out, the abort waited for other work
    and the request stayed held: an attempt set aside meanwhile would be read as kept, the engine given up on.)"""
    from app.services.jobs import cancel_job

    worker, engine, engine_thread, job_id = leased_on_sim_engine(settings, keys)
    for _ in range(3):
        worker.outbox.apply(engine_thread.iterate())
    job = worker.active.get(job_id)
    assert job.request.num_output_tokens > 0 and not job.finished
    engine.scheduler.abort_request(job.request_id)  # what the failed step left: held, not scheduled
    assert not engine.has_work
    with session_scope(settings.sqlalchemy_url) as s:
        cancel_job(s, s.get(Job, job_id))
    worker.abort(job_id)
    for _ in range(2):
        worker.outbox.apply(engine_thread.iterate())
    assert job.request_id not in engine.requests and job.request.status is RequestStatus.FINISHED_ABORTED
    assert job.finished and job_id not in worker.active and not engine.has_work
    assert _status(settings.sqlalchemy_url, job_id) == "cancelled"


def test_an_abort_the_engine_never_confirms_gives_the_slot_back_after_a_lease(settings, keys):
    """vLLM frees an aborted request's resources; an engine that never confirms an abort (no finished output) held
    the job's slot for good, and a worker that met a few such aborts took no more work. One lease after the abort
    went to the engine the worker stops counting the job (its lease is no longer renewed; a cancelled job settles
    with nothing written, as a lapsed lease's does), and what that engine says of it later writes nothing."""
    from app.services.jobs import cancel_job

    settings = settings.model_copy(update={"max_inflight": 1})
    worker = GpuWorker(settings)
    engine_thread = worker.attach(_Recorder())  # its abort only records the call: the engine never confirms it
    (job,) = _leased_jobs(settings, keys, worker, 1)
    worker.inbox.put(Add(job.job_id))
    worker.outbox.apply(engine_thread.iterate())
    url = settings.sqlalchemy_url
    with session_scope(url) as s:
        cancel_job(s, s.get(Job, job.job_id))
    worker.abort(job.job_id)
    worker.outbox.apply(engine_thread.iterate())
    assert worker.engine.calls[-1] == ("abort", job.request_id) and not worker._has_room(INTERACTIVE_PRIORITY)
    worker.outbox.apply(StepRecords(records=engine_thread.reconcile()))
    assert job.job_id in worker.active.snapshot_ids()  # within its lease: the engine may still confirm it
    job.abort_sent_at -= settings.lease_seconds  # a lease later (the clock moved on, not slept on)
    worker.outbox.apply(StepRecords(records=engine_thread.reconcile()))
    assert worker.active.snapshot_ids() == [] and worker.active.in_line == 0 and worker._has_room(INTERACTIVE_PRIORITY)
    assert worker.active.abandoned_ids() == [job.request_id]  # listed while the engine may hold it (a leak bound)
    worker.heartbeat()  # the worker's row counts it (the dashboard, /readyz, /metrics), not only its log
    assert _worker_row_state(settings, worker)["set_aside_jobs"] == 1
    with session_scope(url) as s:
        row = s.get(Job, job.job_id)
        assert (row.status, row.settled_at is not None, row.lease_expires_at) == ("cancelled", True, None)
        settled = row.settled_at
    # the engine speaks of it at last: nothing is written on the settled job, and its id is free again
    engine_thread.engine = _OneStep([_ended(job, RequestStatus.FINISHED_ABORTED, 2, "late")])
    worker.outbox.apply(engine_thread.iterate())
    worker.outbox.flush_events()
    assert worker.active.abandoned_ids() == []
    worker.heartbeat()
    assert _worker_row_state(settings, worker)["set_aside_jobs"] == 0
    with session_scope(url) as s:
        row = s.get(Job, job.job_id)
        assert (row.output_text, row.completion_tokens, row.settled_at) == (None, None, settled)
    events = [StreamEvent.parse(raw).type for _id, raw in redis.Redis.from_url(settings.redis_url)
              .xrange(stream_key(job.job_id))]
    assert events.count("kept") == 1 and "delta" not in events


class _DeafToAborts(_OneStep):
    """Returns the given outputs from its first step, then nothing: an abort is never confirmed."""

    def abort(self, request_id: str) -> None:
        pass


def test_a_cancelled_job_whose_abort_the_engine_never_confirms_keeps_the_tokens_it_streamed(settings, keys):
    """The engine streamed tokens of a job the API then cancelled, and never confirms its abort: a lease later the
    worker sets it aside and settles it with the text and tokens its stream carried (billed and reported as they went
    out), where it wrote no token count before."""
    from app.services.jobs import cancel_job

    worker = GpuWorker(settings)
    (job,) = _leased_jobs(settings, keys, worker, 1, in_engine=True)
    engine_thread = worker.attach(_DeafToAborts([RequestOutput(job.request_id, [5, 5], "Hello",
                                                               RequestStatus.DECODING)]))
    worker.outbox.apply(engine_thread.iterate())
    url = settings.sqlalchemy_url
    with session_scope(url) as s:
        cancel_job(s, s.get(Job, job.job_id))
    worker.abort(job.job_id)
    worker.outbox.apply(engine_thread.iterate())
    job.abort_sent_at -= settings.lease_seconds  # a lease later (the clock moved on, not slept on)
    worker.outbox.apply(StepRecords(records=engine_thread.reconcile()))
    worker.outbox.flush_events()
    assert worker.active.abandoned_ids() == [job.request_id]
    with session_scope(url) as s:
        row = s.get(Job, job.job_id)
        assert (row.status, row.output_text, row.completion_tokens, row.prompt_tokens) == ("cancelled", "Hello", 2, 8)
        assert row.settled_at is not None
    events = [StreamEvent.parse(raw) for _id, raw in redis.Redis.from_url(settings.redis_url)
              .xrange(stream_key(job.job_id))]
    assert [(e.type, e.data.get("completion_tokens")) for e in events if e.type == "kept"] == [("kept", 2)]


def _worker_row_state(settings, worker: GpuWorker) -> dict:
    from app.db.models import WorkerState

    with session_scope(settings.sqlalchemy_url) as s:
        return dict(s.get(WorkerState, worker.worker_id).state)


def _set_aside_with_its_message(settings, keys, monkeypatch):
    """A worker whose engine never confirms the abort of a job whose lease lapsed while it ran there (its attempt set
    aside there), that job requeued and sent again by the sweeper, and ``delivered(**kwargs)``: that worker's consumer
    runs a message of the job (``kwargs``: the task's keyword arguments in the message)."""
    from workers.celery_app import RUN_JOB, get_celery

    worker = GpuWorker(settings)
    engine_thread = worker.attach(_Recorder())  # its abort only records the call: the engine never confirms it
    (job,) = _leased_jobs(settings, keys, worker, 1)
    worker.inbox.put(Add(job.job_id))
    worker.outbox.apply(engine_thread.iterate())
    _lapse_and_requeue(settings, job.job_id)  # the sweeper requeued it and sent its message again
    worker.abort(job.job_id)  # the heartbeat found it is no longer ours
    worker.outbox.apply(engine_thread.iterate())
    job.abort_sent_at -= settings.lease_seconds  # a lease later (the clock moved on, not slept on)
    worker.outbox.apply(StepRecords(records=engine_thread.reconcile()))
    assert worker.active.abandoned_ids() == [job.request_id] and job.job_id not in worker.active
    worker.engine.executor = SimpleNamespace(now=time.monotonic)  # the clock a job's arrival is set on

    app = get_celery(settings.redis_url)
    app.loader.import_default_modules()
    monkeypatch.setattr(app, "coserve_worker", worker, raising=False)
    run_job = app.tasks[RUN_JOB]

    def delivered(**kwargs):
        run_job.push_request(id="task-1", args=[job.job_id], kwargs=kwargs, retries=0, is_eager=False,
                             called_directly=False, delivery_info={"priority": INTERACTIVE_PRIORITY, "exchange": "",
                                                                   "routing_key": "coserve.tiny"})
        try:
            return run_job.run(job.job_id, **kwargs)
        finally:
            run_job.pop_request()
    return worker, engine_thread, job, delivered


def test_a_job_that_comes_back_while_its_earlier_attempt_is_set_aside_runs_at_once(settings, keys, monkeypatch):
    """A job whose lease lapsed while its engine never confirmed the abort has its attempt set aside on this worker.
    The engine knows each attempt by its own request id, so the resent message coming back here is neither waited on
    nor sent again later: the rerun is added beside the aborted request at once. A message that an older worker sent
    again with its set-aside count still runs."""
    worker, _engine_thread, job, delivered = _set_aside_with_its_message(settings, keys, monkeypatch)
    r = redis.Redis.from_url(settings.redis_url)
    waiting = r.llen("coserve.tiny")
    assert delivered(set_aside_rounds=3) is None
    worker.outbox.apply(_engine_thread.iterate())  # the engine thread adds it
    second = worker.active.get(job.job_id)
    assert second.lease.attempt == 2 and second.request_id == f"{job.job_id}:2" != job.request_id
    assert worker.engine.calls == [("add", job.request_id), ("abort", job.request_id), ("add", second.request_id)]
    assert worker.active.abandoned_ids() == [job.request_id]  # attempt 1 stays listed beside it
    assert r.llen("coserve.tiny") == waiting  # no message sent again, no hand-back
    with session_scope(settings.sqlalchemy_url) as s:
        row = s.get(Job, job.job_id)
        assert (row.status, row.attempt, row.worker_id) == ("running", 2, worker.worker_id)


def test_an_engine_that_keeps_an_aborted_request_for_leases_stops_the_worker_for_a_fresh_engine(settings, keys,
                                                                                                   monkeypatch):
    """A set-aside attempt no longer holds its job back, so nothing else notices an engine that keeps aborted requests
    (their KV blocks and slots leak for good). One still held ``KEPT_ABORT_LEASES`` leases after its abort gives the
    engine up as a broken one is: the worker stops (SIGTERM to itself: Celery's warm shutdown, then exit status 1
    for its supervisor to start a fresh engine), once; an engine that let the request go in time is kept."""
    import os
    import signal

    from workers.engine_thread import KEPT_ABORT_LEASES

    worker, engine_thread, job, _delivered = _set_aside_with_its_message(settings, keys, monkeypatch)
    signals: list[tuple[int, int]] = []
    monkeypatch.setattr("workers.gpu_worker.os.kill", lambda pid, sig: signals.append((pid, sig)))
    job.abort_sent_at -= (KEPT_ABORT_LEASES - 1.5) * settings.lease_seconds  # short of the bound
    worker.outbox.apply(StepRecords(records=engine_thread.reconcile()))
    assert signals == [] and worker.broken is None and not worker.shutting_down
    job.abort_sent_at -= settings.lease_seconds  # past it (the clock moved on, not slept on)
    worker.outbox.apply(StepRecords(records=engine_thread.reconcile()))
    assert signals == [(os.getpid(), signal.SIGTERM)] and worker.shutting_down
    assert worker.broken == (f"the engine kept the aborted request of job {job.job_id} (attempt 1) "
                             f"{KEPT_ABORT_LEASES} leases after its abort")  # run_worker exits with it (status 1)
    worker.outbox.apply(StepRecords(records=engine_thread.reconcile()))
    assert len(signals) == 1


def test_an_engine_that_let_a_set_aside_request_go_is_not_given_up_on(settings, keys, monkeypatch):
    signals: list[tuple[int, int]] = []
    monkeypatch.setattr("workers.gpu_worker.os.kill", lambda pid, sig: signals.append((pid, sig)))
    worker, engine_thread, job, _delivered = _set_aside_with_its_message(settings, keys, monkeypatch)
    del worker.engine.requests[job.request_id]  # the engine let it go, without a word
    job.abort_sent_at -= 10 * settings.lease_seconds
    worker.outbox.apply(StepRecords(records=engine_thread.reconcile()))
    assert worker.active.abandoned_ids() == [] and signals == [] and worker.broken is None


def test_a_worker_that_gives_up_on_an_engine_that_kept_a_request_lets_its_running_jobs_finish(settings, keys,
                                                                                               monkeypatch):
    """Unlike an engine whose steps raise, one given up on for an aborted request it kept still runs the others: the
    stopping worker's grace lets them finish there, rather than hand them back to run again elsewhere."""
    monkeypatch.setattr("workers.gpu_worker.os.kill", lambda pid, sig: None)  # the SIGTERM that stops the consumer
    worker, _engine, engine_thread, job_id = leased_on_sim_engine(settings, keys)
    worker.give_up_engine(f"the engine kept the aborted request of job {'0' * 24}")  # another job's
    worker.outbox.start()
    loop = threading.Thread(target=engine_thread.run, name="coserve-engine", daemon=True)
    real_sleep = time.sleep

    def waiting_for_jobs(seconds: float) -> None:  # the engine steps only once the stop waits for its jobs
        if threading.current_thread() is threading.main_thread() and loop not in worker.threads:
            worker.threads.append(loop)  # the stop joins it
            loop.start()
        real_sleep(seconds)

    monkeypatch.setattr("workers.gpu_worker.time.sleep", waiting_for_jobs)
    worker.stop(grace_s=60)  # returns once its jobs have left (a simulated engine's steps take no time)
    assert worker.broken is not None and _status(settings.sqlalchemy_url, job_id) == "succeeded"


def test_a_nul_in_the_tokens_logprobs_is_stored_with_the_job(settings, keys):
    assert_a_nul_and_its_logprobs_are_stored(settings, keys)


def assert_a_nul_and_its_logprobs_are_stored(settings, keys) -> None:
    """A NUL the engine generates (a byte token), in the text and in its logprobs, its alternatives' and the
    prompt's: the job's result is written on every database (``test_postgres`` runs this on PostgreSQL, whose text
    refuses NUL): the text with U+FFFD in its place (``storable``), the logprobs (JSON: ``\\u0000``) keep the
    tokens as the engine named them."""
    from gpu_runtime.logprobs import TokenLogprob

    worker = GpuWorker(settings)
    (job,) = _leased_jobs(settings, keys, worker, 1, in_engine=True)
    job.request.sampling = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)  # as a vLLM worker asks
    nul = TokenLogprob("\x00", -0.5, (("\x00", -0.5), ("b", -1.0)), 190, 1, (190, 65))
    first = RequestOutput(job.request_id, [190], "\x00", RequestStatus.DECODING, new_logprobs=[nul],
                          prompt_logprobs=[TokenLogprob("p", None), nul])
    stand_in = _OneStep([first])
    engine_thread = worker.attach(stand_in)
    worker.outbox.apply(engine_thread.iterate())
    last = _ended(job, RequestStatus.FINISHED_LENGTH, 2, "a")
    last.new_logprobs = [TokenLogprob("a", -0.1)]
    stand_in.outputs = [last]
    worker.outbox.apply(engine_thread.iterate())
    worker.outbox.flush_events()
    with session_scope(settings.sqlalchemy_url) as s:
        stored = s.get(Job, job.job_id)
        assert (stored.status, stored.output_text) == ("succeeded", "\ufffda")
        assert [t["token"] for t in stored.output_logprobs] == ["\x00", "a"]
        assert stored.output_logprobs[0]["top"] == [["\x00", -0.5], ["b", -1.0]]
        assert [t["token"] for t in stored.prompt_logprobs] == ["p", "\x00"]
