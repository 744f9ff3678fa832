"""A worker's shutdown and drain: what happens to the jobs it runs and to the message it holds (real SQLite, real
Redis; a real worker process for the signals)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import pytest
import redis
from celery.worker import state as celery_state
from sqlalchemy import select, update

from app.auth import authenticate
from app.db.models import Job, JobEvent, JobStatus, WorkerState
from app.db.session import session_scope
from app.schemas import JobCreate
from app.services import dispatch
from app.services.dispatch import send_job
from app.services.jobs import submit_job
from app.services.streaming import stream_key
from app.services.transitions import transition
from tests.conftest import wait_for
from tests.integration.test_worker_room import _next_taken
from workers import gpu_worker
from workers.gpu_worker import GpuWorker

pytestmark = pytest.mark.integration

KILL_JOB = "<class 'celery.concurrency.solo.TaskPool'> does not implement kill_job"  # how Celery's cancel raises


def _submit(settings, keys, dispatch: bool = False, **body) -> str:
    with session_scope(settings.sqlalchemy_url) as s:
        return submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="a", **body), settings,
                          dispatch=dispatch).job.id


def _taken(settings, keys) -> str:
    """A job dispatched, as when a worker took its message (the message itself left the queue)."""
    job_id = _submit(settings, keys)
    with session_scope(settings.sqlalchemy_url) as s:
        assert transition(s, job_id, JobStatus.QUEUED, JobStatus.DISPATCHED)
    return job_id


def _details(settings, job_id) -> list[str | None]:
    with session_scope(settings.sqlalchemy_url) as s:
        return list(s.scalars(select(JobEvent.detail).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))


def _given_back_mid_stream(settings, keys, start_worker, signum: int, **env: str) -> str:
    """A 400-token job (400 steps of 10 ms at least) on a real worker sent ``signum`` as the job streams, checked
    handed back: dispatched for the next worker, with nothing written of its first attempt. Returns its id."""
    worker = start_worker("w1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build", COSERVE_STEP_DELAY_S="0.01",
                          **env)
    job_id = _submit(settings, keys, dispatch=True, max_tokens=400, ignore_eos=True)
    r = redis.Redis.from_url(settings.redis_url)
    wait_for(lambda: r.xlen(stream_key(job_id)) >= 4, 60, "the job to stream")
    worker.send_signal(signum)
    worker.wait(60)
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, job_id)
        assert (job.status, job.attempt, job.worker_id, job.completion_tokens) == ("dispatched", 1, None, None)
    assert _details(settings, job_id)[-2:] == ["worker w1 shut down", "given back at shutdown"]
    return job_id


def test_a_cold_shutdown_gives_the_running_job_back_at_once(settings, keys, start_worker):
    """SIGQUIT (Celery's cold shutdown: "terminate all running tasks") hands the running job back to the head of the
    queue, dispatched for the next worker, instead of letting it run on for the warm shutdown's grace."""
    job_id = _given_back_mid_stream(settings, keys, start_worker, signal.SIGQUIT)
    assert _next_taken(settings, "coserve.tiny", batch=False) == [job_id]  # one message: no sweep sends it twice


def test_a_warm_shutdown_lets_running_jobs_finish_for_the_configured_grace(settings, keys, start_worker):
    """COSERVE_STOP_GRACE_SECONDS is the grace SIGTERM gives running jobs: 0 hands the running job back at once, where
    the 10 s default would have let it finish (400 steps of 10 ms)."""
    _given_back_mid_stream(settings, keys, start_worker, signal.SIGTERM, COSERVE_STOP_GRACE_SECONDS="0")


@pytest.mark.parametrize("where", ["before the lease", "after the lease"])
def test_a_job_whose_intake_a_cold_shutdown_interrupts_goes_back_to_the_head(settings, keys, monkeypatch, where):
    """Celery's cold shutdown cancels the task running on the solo pool by raising in it, wherever it is, and acks its
    message: the job it was taking goes back to the head of the queue, dispatched (not failed as a bad request, not
    lost until the sweeper misses its message, not held by a lease of a job the engine never got)."""
    worker = GpuWorker(settings)
    job_id = _taken(settings, keys)
    send_job(settings.redis_url, "later", settings.model_name)

    def cancelled(*_args, **_kwargs):
        celery_state.should_terminate = 1  # as Celery's SIGQUIT handler sets it before the exception reaches the task
        raise NotImplementedError(KILL_JOB)

    monkeypatch.setattr(celery_state, "should_terminate", None)
    if where == "before the lease":
        monkeypatch.setattr(gpu_worker.leases, "acquire", cancelled)
    else:
        monkeypatch.setattr(GpuWorker, "_request", cancelled)
    with pytest.raises(NotImplementedError):
        worker.accept(job_id)
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, job_id)
        assert (job.status, job.worker_id, job.lease_expires_at, job.error) == ("dispatched", None, None, None)
    assert _next_taken(settings, "coserve.tiny", batch=False) == [job_id, "later"]
    assert len(worker.active) == 0


@pytest.mark.parametrize("where", ["after the push", "after the move"])
def test_a_hand_back_a_cold_shutdown_interrupts_leaves_one_message_at_the_head(settings, keys, monkeypatch, where):
    """A draining worker hands the message it took back (send_back: a push at the tail, then a move to the head);
    a cold shutdown that raises in the task between the two, or once the move is done, left a second message there
    (accept's give-back sent one more): the hand-back is finished instead, one message, at the head."""
    worker = GpuWorker(settings)
    worker.draining = True
    job_id = _taken(settings, keys)
    send_job(settings.redis_url, "later", settings.model_name)
    real_move = dispatch.move

    def cancelled(*args, **kwargs):  # Celery's SIGQUIT lands in the hand-back, once
        if where == "after the move" or celery_state.should_terminate:
            moved = real_move(*args, **kwargs)
            if celery_state.should_terminate:
                return moved
        celery_state.should_terminate = 1
        raise NotImplementedError(KILL_JOB)

    monkeypatch.setattr(celery_state, "should_terminate", None)
    monkeypatch.setattr(dispatch, "move", cancelled)
    with pytest.raises(NotImplementedError):
        worker.accept(job_id)
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, job_id).status == "dispatched"
    assert _next_taken(settings, "coserve.tiny", batch=False) == [job_id, "later"]


def test_a_second_message_left_by_a_hand_back_a_cold_shutdown_interrupted_runs_nothing_twice(settings, keys,
                                                                                              monkeypatch):
    """Another worker takes the message a draining worker pushed back before the cold shutdown that interrupts the
    hand-back's move: the give-back finds it gone from the list and sends a second one. Only one lease is had: the
    taker runs the job once, and the second message, wherever it lands (the taker, a third worker, after the job
    ended), is acked and dropped, neither running the job again nor failing it."""
    from tests.integration.test_worker_threads import sim_engine

    draining, taker, third = (GpuWorker(settings.model_copy(update={"worker_id": w})) for w in ("wa", "wb", "wc"))
    draining.draining = True
    engine = sim_engine()
    engine_thread = taker.attach(engine)
    job_id = _submit(settings, keys, max_tokens=4)
    with session_scope(settings.sqlalchemy_url) as s:  # dispatched, its message in the draining worker's hand
        assert transition(s, job_id, JobStatus.QUEUED, JobStatus.DISPATCHED)
    r = redis.Redis.from_url(settings.redis_url)
    real_move = dispatch.move

    def taken_then_cancelled(*args, **kwargs):  # the taker's consumer takes the pushed message, then SIGQUIT lands
        if celery_state.should_terminate:
            return real_move(*args, **kwargs)
        pushed = [m for m in r.lrange("coserve.tiny", 0, -1) if draining.handing_back[1].encode() in m]
        assert len(pushed) == 1 and r.lrem("coserve.tiny", 1, pushed[0]) == 1
        celery_state.should_terminate = 1
        raise NotImplementedError(KILL_JOB)

    monkeypatch.setattr(celery_state, "should_terminate", None)
    monkeypatch.setattr(dispatch, "move", taken_then_cancelled)
    with pytest.raises(NotImplementedError):
        draining.accept(job_id)
    assert _next_taken(settings, "coserve.tiny", batch=False) == [job_id]  # the second message
    monkeypatch.setattr(celery_state, "should_terminate", None)
    taker.accept(job_id)  # the message it took: leased and run here
    assert taker.active.get(job_id).lease.attempt == 1
    taker.accept(job_id)  # the second message, taken by the same worker while the job runs there
    third.accept(job_id)  # or by another
    assert len(third.active) == 0 and len(taker.active) == 1
    for _ in range(40):
        taker.outbox.apply(engine_thread.iterate())
    third.accept(job_id)  # or once the job ended
    assert len(third.active) == 0 and len(taker.active) == 0
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, job_id)
        assert (job.status, job.attempt, job.worker_id, job.error) == ("succeeded", 1, "wb", None)
    assert _details(settings, job_id).count("leased") == 1 and not engine.has_work


def test_a_bad_request_still_fails_at_admission_outside_a_cold_shutdown(settings, keys, monkeypatch):
    worker = GpuWorker(settings)
    job_id = _submit(settings, keys)

    def bad(*_args, **_kwargs):
        raise ValueError("no such adapter")

    monkeypatch.setattr(celery_state, "should_terminate", None)
    monkeypatch.setattr(GpuWorker, "_request", bad)
    worker.accept(job_id)
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, job_id)
        assert (job.status, job.error) == ("failed", "no such adapter")


def test_a_draining_worker_hands_the_message_it_holds_back_before_it_pauses(settings, keys):
    """The message a worker took as its drain began goes back to the head at once, for the other workers; the worker
    pauses (its consumer stops meanwhile) only with no message in hand."""
    worker = GpuWorker(settings)
    worker.draining = True
    job_id = _taken(settings, keys)
    send_job(settings.redis_url, "later", settings.model_name)
    intake = threading.Thread(target=worker.accept, args=(job_id,), daemon=True)
    intake.start()
    try:
        wait_for(lambda: _next_taken(settings, "coserve.tiny", batch=False) == [job_id, "later"], 10,
                 "the message to be handed back", interval=0.01)
        assert intake.is_alive()  # handed back first, then the pause
    finally:
        worker.stopping.set()  # ends the pause
        intake.join(5)
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, job_id).status == "dispatched"  # never leased here


def _consumed_queues(settings, worker_id: str) -> list[str] | None:
    """The queues a worker's Celery consumer reads, as it answers Celery's inspect (None: no answer)."""
    from workers.celery_app import get_celery

    answer = get_celery(settings.redis_url).control.inspect(timeout=1.0).active_queues() or {}
    return next(([q["name"] for q in queues] for name, queues in answer.items() if name.startswith(f"{worker_id}@")),
                None)


def test_a_drain_leaves_no_message_held_by_the_consumer(settings, keys, start_worker):
    """Messages keep coming while a real worker's drain begins: the worker takes each until its beat reads the drain,
    then hands back the one it holds (``accept``) and its consumer stops (``cancel_consumer``), which kombu applies
    after the read under way; a message its last BRPOP took after that has no consumer and kombu requeues it. Celery
    fetches nothing ahead (solo pool, prefetch 1: the one message in hand is the task's), so none is left unacked in
    Redis until the visibility timeout: each job ran on the worker or its message waits on the model's queue."""
    worker_id = "w1"
    start_worker(worker_id)
    jobs = [_taken(settings, keys) for _ in range(40)]

    def send_all() -> None:  # one every 20 ms, the worker's drain beginning meanwhile
        for job_id in jobs:
            send_job(settings.redis_url, job_id, settings.model_name)
            threading.Event().wait(0.02)

    sending = threading.Thread(target=send_all, daemon=True)
    sending.start()
    threading.Event().wait(0.2)  # the worker takes the first ones
    with session_scope(settings.sqlalchemy_url) as s:
        s.execute(update(WorkerState).where(WorkerState.id == worker_id).values(draining=True))
    sending.join(30)
    wait_for(lambda: _consumed_queues(settings, worker_id) == [], 20, "the draining worker to stop consuming")

    def settled() -> dict[str, str] | None:
        with session_scope(settings.sqlalchemy_url) as s:
            status = dict(s.execute(select(Job.id, Job.status).where(Job.id.in_(jobs))).all())
        return status if not {"running", "relegated"} & set(status.values()) else None

    status = wait_for(settled, 30, "the jobs taken before the drain to end")
    r = redis.Redis.from_url(settings.redis_url)
    assert r.hlen("unacked") == 0  # kombu's messages delivered and not acked: none held
    waiting = _next_taken(settings, "coserve.tiny", batch=False)
    assert sorted(waiting) == sorted(j for j, st in status.items() if st == "dispatched")  # one message each
    assert {st for st in status.values()} <= {"succeeded", "dispatched"}


def _leased(settings, keys, worker, kind: str, model: str | None = None):
    """A job of ``kind`` for ``model`` the worker runs (leased in SQL, in its active jobs)."""
    from gpu_runtime.qos import QoSClass, QoSSpec, Tier
    from gpu_runtime.request import Request
    from gpu_runtime.sampling import SamplingParams
    from workers import lease as leases
    from workers.active_job import ActiveJob

    body = {"kind": kind, "model": model or settings.model_name} | ({"deadline_window_s": 600} if kind == "batch"
                                                                     else {})
    job_id = _submit(settings, keys, max_tokens=4, **body)
    qos = (QoSSpec(QoSClass.BATCH, Tier.PAID, ttlt_s=600.0) if kind == "batch"
           else QoSSpec(QoSClass.INTERACTIVE, Tier.PAID, ttft_s=60.0, tbt_s=10.0))
    with session_scope(settings.sqlalchemy_url) as s:
        job = ActiveJob(leases.acquire(s, job_id, worker.worker_id, 30),
                        Request(job_id, [1] * 8, SamplingParams(max_tokens=4), qos, 0.0), s.get(Job, job_id).created_at)
    worker.active.add(job)
    return job_id


def test_a_stopping_worker_gives_each_job_back_to_the_queue_dispatch_sent_it_to(settings, keys):
    """A configured LoRA adapter's job goes back to the adapter's own queue, not to the model's, which a worker of the
    model without that adapter (another deployment, or one a rolling change has not reached) reads and would fail it
    on; a batch job goes back to its queue's batch list, an interactive one to the interactive list."""
    settings.lora_modules = {"sql-lora": "/adapters/sql"}
    worker = GpuWorker(settings)
    adapted = _leased(settings, keys, worker, "interactive", "sql-lora")
    batch = _leased(settings, keys, worker, "batch")
    plain = _leased(settings, keys, worker, "interactive")
    worker.stop(grace_s=0)
    assert _next_taken(settings, "coserve.sql-lora", batch=False) == [adapted]
    assert _next_taken(settings, "coserve.tiny", batch=False) == [plain]
    assert _next_taken(settings, "coserve.tiny", batch=True) == [batch]
    with session_scope(settings.sqlalchemy_url) as s:
        assert {s.get(Job, j).status for j in (adapted, batch, plain)} == {"dispatched"}


def test_an_adapters_job_from_the_workers_own_queue_goes_back_to_the_adapters_queue(settings, keys):
    """Prefix routing sent an adapter's job to this worker's own queue; with no room for it here it goes back to the
    shared queue of the adapter, which every worker serving the adapter reads (not the model's)."""
    settings.lora_modules = {"sql-lora": "/adapters/sql"}
    settings.routing = "prefix"
    worker = GpuWorker(settings.model_copy(update={"max_inflight": 1}))
    _leased(settings, keys, worker, "interactive")  # the engine's one slot, taken
    job_id = _submit(settings, keys, max_tokens=4, model="sql-lora")
    worker.stopping.set()  # no wait for room after the hand-back (as at a shutdown)
    worker.accept(job_id, queue=f"coserve.worker.{worker.worker_id}")
    assert _next_taken(settings, "coserve.sql-lora", batch=False) == [job_id]
    assert _next_taken(settings, "coserve.tiny", batch=False) == []


def test_a_heartbeat_that_ran_into_the_stop_does_not_bring_the_stopped_workers_row_back(settings, keys, monkeypatch):
    """The heartbeat thread looks at the worker's jobs; before it writes its beat, the worker stops and deletes its
    row. The beat does not write the row again (the stopped worker looked live, and was routed to, until it went
    stale)."""

    worker = GpuWorker(settings)
    worker.heartbeat()  # registered, as a running worker is
    real = worker.active.snapshot

    def stop_meanwhile():
        jobs = real()  # what this beat read
        worker.stop(grace_s=0)
        return jobs

    monkeypatch.setattr(worker.active, "snapshot", stop_meanwhile)
    worker.heartbeat()
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(WorkerState, worker.worker_id) is None


def test_a_job_routed_to_a_stopping_worker_goes_to_the_shared_queue_at_its_next_beat(settings, keys):
    """A warm shutdown stopped the worker's consumer; it beats until its running jobs finish (the stop grace), so an
    API still routes to it: what waits on its own queue goes to the model's queue at each beat, not after the grace
    (``stop``)."""
    from tests.integration.test_worker_room import _routed_here

    settings.routing = "prefix"
    worker = GpuWorker(settings)
    worker.heartbeat()  # registered, as a running worker is
    routed = _routed_here(settings, keys, worker)
    worker.shutting_down = True  # Celery's warm shutdown began (or the engine was given up on)
    worker.heartbeat()
    assert _next_taken(settings, f"coserve.worker.{worker.worker_id}", batch=False) == []
    assert _next_taken(settings, "coserve.tiny", batch=False) == [routed]


def test_a_job_routed_to_a_worker_after_it_stopped_goes_to_the_shared_queue_before_it_exits(settings, keys,
                                                                                            monkeypatch):
    """A worker that stops with no job running stops at once, and an API whose view of the workers was read before
    (it trusts one for ``routing.REFRESH_S``) still sends a job to its own queue after its last reroute. The stop
    passes such a job to the model's queue once those views are stale, instead of leaving it on a queue nobody reads
    until another worker's next sweep (``sweep_seconds``), or, with no other worker, until one starts."""
    from app.services import routing
    from tests.integration.test_worker_room import _routed_here

    monkeypatch.setattr(routing, "REFRESH_S", 3.0)  # room for the late send on a busy box
    settings.routing = "prefix"
    worker = GpuWorker(settings)
    worker.heartbeat()  # registered, as a running worker is

    def row_gone() -> bool:
        with session_scope(settings.sqlalchemy_url) as s:
            return s.get(WorkerState, worker.worker_id) is None

    stop = threading.Thread(target=worker.stop, kwargs={"grace_s": 0}, daemon=True)
    stop.start()
    wait_for(row_gone, 10, "the stop to delete the worker's row (its own queue rerouted in that transaction)")
    routed = _routed_here(settings, keys, worker)  # by an API's view read before the stop
    stop.join(10)
    assert not stop.is_alive()
    assert _next_taken(settings, f"coserve.worker.{worker.worker_id}", batch=False) == []
    assert _next_taken(settings, "coserve.tiny", batch=False) == [routed]


def test_a_worker_whose_stopping_beat_went_stale_passes_its_own_queue_on_once(settings, keys, monkeypatch):
    """A warm shutdown whose grace outlasted the APIs' views of the workers (its beat said ``stopping`` longer than
    ``routing.REFRESH_S`` ago): no API routes here any more, so the stop passes what waits on its own queue to the
    model's queue once, in the transaction that deletes its row, with no second pass after it (that pass, for the jobs
    views read before the beat still send, found nothing more to do)."""
    from app.services import routing
    from tests.integration.test_worker_room import _routed_here

    settings.routing = "prefix"
    worker = GpuWorker(settings)
    worker.shutting_down = True  # Celery's warm shutdown began: the beat says so
    worker.heartbeat()
    worker.unroutable_at -= routing.REFRESH_S + 1.0  # the grace went on past the views read before that beat
    routed = _routed_here(settings, keys, worker)  # sent by a view of then, before the grace ended
    real_reroute, passes = gpu_worker.reroute, []

    def reroute(session, redis_url, queues):  # the real pass, counted
        passes.append(queues)
        return real_reroute(session, redis_url, queues)

    monkeypatch.setattr(gpu_worker, "reroute", reroute)
    worker.stop(grace_s=0)
    assert passes == [[f"coserve.worker.{worker.worker_id}"]]
    assert _next_taken(settings, "coserve.tiny", batch=False) == [routed]


def test_a_job_routed_to_a_predecessor_that_served_its_adapter_goes_to_the_adapters_queue(settings, keys):
    """An API routed a configured adapter's job to w1's own queue by a view of the w1 that served the adapter; w1 was
    restarted under its id without it. The job goes to the adapter's queue for a worker that serves it, instead of
    failing here as an adapter unloaded."""
    settings.lora_modules = {"sql-lora": "/adapters/sql"}
    settings.routing = "prefix"
    with session_scope(settings.sqlalchemy_url) as s:
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="a", max_tokens=4, model="sql-lora"),
                            settings, dispatch=False).job.id
        assert dispatch.dispatch(s, settings.redis_url, job_id, "sql-lora", queue="coserve.worker.w1")
    redis.Redis.from_url(settings.redis_url).delete("coserve.worker.w1")  # its message taken by the consumer
    worker = GpuWorker(settings.model_copy(update={"lora_modules": {}, "worker_id": "w1"}))  # restarted without it
    worker.accept(job_id, queue="coserve.worker.w1")
    assert _next_taken(settings, "coserve.sql-lora", batch=False) == [job_id]
    with session_scope(settings.sqlalchemy_url) as s:
        assert (s.get(Job, job_id).status, s.get(Job, job_id).attempt) == ("dispatched", 0)  # never leased here
    assert _next_taken(settings, "coserve.worker.w1", batch=False) == []
    assert _next_taken(settings, "coserve.tiny", batch=False) == []  # not the model's: its workers lack the adapter



def test_a_stopping_worker_says_so_at_once_and_the_api_routes_to_it_no_more(settings, keys, client):
    """A warm shutdown began (Celery's signal handler calls ``begin_shutdown``, as an engine given up on does): the
    worker beats at once, not at its next period, with ``stopping`` in its state, so a fresh view of the workers
    routes its key to the model's queue, /readyz says no worker takes jobs, and the dashboard shows it stopping,
    though it is live (it beats until its grace ends)."""
    from app.services.routing import Router, route_key, worker_queue

    settings.routing = "prefix"
    settings.heartbeat_seconds = 30.0  # the worker beats only when woken; the API counts it live for 91 s
    worker = GpuWorker(settings)
    worker.heartbeat()  # registered, as a running worker is
    key = route_key(keys.tenant_id, settings.model_name, prompt="hello")

    def routed_to() -> str:  # a view of the workers read now (a process's router trusts one for a second)
        return Router(settings.sqlalchemy_url, 60.0, settings.routing_slack).queue(settings.model_name, key)

    def says_stopping() -> bool:
        with session_scope(settings.sqlalchemy_url) as s:
            return bool(s.get(WorkerState, worker.worker_id).state.get("stopping"))

    assert routed_to() == worker_queue(worker.worker_id) and not says_stopping()
    assert client.get("/readyz").status_code == 200
    beats = threading.Thread(target=worker._heartbeat_loop, daemon=True)
    beats.start()
    worker.begin_shutdown()
    wait_for(says_stopping, 10, "the beat the shutdown woke")
    assert routed_to() == f"coserve.{settings.model_name}"
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["checks"]["workers"] == "error: no live worker taking jobs (1 draining or stopping)"
    shown = client.get("/admin/api/overview", headers=keys.header(keys.admin)).json()["workers"]
    assert [(w["id"], w["alive"], w["stopping"]) for w in shown] == [(worker.worker_id, True, True)]
    worker.stop(grace_s=0)
    beats.join(10)
    assert not beats.is_alive()  # the stop woke it to end


def test_a_configured_adapters_stray_message_on_the_models_queue_goes_to_the_adapters_queue(settings, keys):
    """A configured adapter's job whose message came on the model's queue (given back there by an older coserve's
    worker or sweeper) reaches a worker without the adapter: it goes on to the adapter's queue, for a worker that
    serves it, instead of failing here while another worker serves it. Never leased here; and a worker that reads
    the adapter's queue serves the adapter, so it does not come back."""
    settings.lora_modules = {"sql-lora": "/adapters/sql"}
    with session_scope(settings.sqlalchemy_url) as s:
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="a", max_tokens=4, model="sql-lora"),
                            settings, dispatch=False).job.id
        assert dispatch.dispatch(s, settings.redis_url, job_id, "sql-lora", queue="coserve.tiny")
    redis.Redis.from_url(settings.redis_url).delete("coserve.tiny")  # its message taken by the consumer
    worker = GpuWorker(settings.model_copy(update={"lora_modules": {}}))  # a worker of the model without it
    worker.accept(job_id, queue="coserve.tiny")
    assert _next_taken(settings, "coserve.sql-lora", batch=False) == [job_id]
    with session_scope(settings.sqlalchemy_url) as s:
        assert (s.get(Job, job_id).status, s.get(Job, job_id).attempt) == ("dispatched", 0)  # never leased here
    assert _next_taken(settings, "coserve.tiny", batch=False) == []


def test_a_worker_started_after_an_adapter_it_cannot_serve_was_loaded_leaves_its_jobs_to_one_that_does(
        settings, keys, client, tmp_path, caplog):
    """A rolling deploy: adapter rt16 (rank 16) was loaded while the model's live workers served rank 16; then w-small
    started with max_lora_rank 8 in its engine (its heartbeat says so: ``lora``). It says loudly that it cannot serve
    rt16 (its log, its heartbeat, the API's /readyz), and hands rt16's job back to the model's queue while w-big
    (hand-built heartbeat) serves it, never leasing it; once none does, the job fails here saying why and what to do."""
    from types import SimpleNamespace

    from app.services import lora_adapters
    from app.services.transitions import utcnow

    settings.runtime_lora = True
    lora = tmp_path / "rt16"
    lora.mkdir()
    (lora / "adapter_config.json").write_text('{"r": 16}')
    (lora / "adapter_model.safetensors").write_bytes(b"")
    lora_adapters.load(settings, "rt16", str(lora))
    big = {"served": ["tiny"], "runtime_lora": True, "lora": {"runtime": True, "max_lora_rank": 16, "max_loras": 2}}
    with session_scope(settings.sqlalchemy_url) as s:
        s.add(WorkerState(id="w-big", model="tiny", queue="coserve.tiny", device="cpu", state=big,
                          heartbeat_at=utcnow()))
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="a", max_tokens=4, model="rt16"),
                            settings, dispatch=False).job.id
        assert dispatch.dispatch(s, settings.redis_url, job_id, "tiny", queue="coserve.tiny")
    redis.Redis.from_url(settings.redis_url).delete("coserve.tiny")  # its message taken by the consumer
    worker = GpuWorker(settings.model_copy(update={"worker_id": "w-small"}))
    worker.engine = SimpleNamespace(lora_limits={"runtime": True, "max_lora_rank": 8, "max_loras": 2},
                                    executor=SimpleNamespace(now=lambda: 100.0))
    worker.heartbeat()  # as its registration at start does
    assert "worker w-small cannot serve the runtime LoRA adapter 'rt16': its rank 16 is above the max_lora_rank 8" \
        in caplog.text
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(WorkerState, "w-small").state["lora_unserved"] == {
            "rt16": "its rank 16 is above the max_lora_rank 8 of its vLLM engine"}
    ready = client.get("/readyz").json()["checks"]
    assert ready["lora_unserved"].startswith("warning: worker 'w-small' cannot serve the runtime adapter 'rt16' "
                                             "(its rank 16 is above the max_lora_rank 8"), ready
    worker.accept(job_id, queue="coserve.tiny")
    assert _next_taken(settings, "coserve.tiny", batch=False) == [job_id]  # for w-big
    with session_scope(settings.sqlalchemy_url) as s:
        assert (s.get(Job, job_id).status, s.get(Job, job_id).attempt) == ("dispatched", 0)  # never leased here
        s.delete(s.get(WorkerState, "w-big"))  # gone: nobody else serves rt16
    worker.accept(job_id, queue="coserve.tiny")
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, job_id)
        assert job.status == "failed" and "cannot be served by worker 'w-small' (its rank 16 is above the " \
            "max_lora_rank 8 of its vLLM engine), and no other live worker of the model serves it" in job.error, \
            job.error


def _rt16_with_two_workers(settings, keys, tmp_path, *, loaded_after_start: bool = False,
                           before_load: Callable[[GpuWorker], None] | None = None):
    """Runtime adapter rt16 (rank 16), w-big (hand-built heartbeat) serving it, w-small (max_lora_rank 8 in its
    engine) registered, and a job of rt16 whose message w-small's consumer took; returns (w-small, the job's id).
    ``loaded_after_start``: rt16 loaded after w-small's registration, by a load that read the live workers before
    it (held to w-big alone), so w-small's registration did not see it; ``before_load`` is called with w-small just
    before that load."""
    from datetime import timedelta
    from types import SimpleNamespace

    from app.services import lora_adapters
    from app.services.transitions import utcnow

    settings.runtime_lora = True
    lora = tmp_path / "rt16"
    lora.mkdir()
    (lora / "adapter_config.json").write_text('{"r": 16}')
    (lora / "adapter_model.safetensors").write_bytes(b"")
    big = {"served": ["tiny"], "runtime_lora": True, "lora": {"runtime": True, "max_lora_rank": 16, "max_loras": 2}}
    with session_scope(settings.sqlalchemy_url) as s:
        s.add(WorkerState(id="w-big", model="tiny", queue="coserve.tiny", device="cpu", state=big,
                          heartbeat_at=utcnow() + timedelta(minutes=10)))  # live all through the test
    worker = GpuWorker(settings.model_copy(update={"worker_id": "w-small"}))
    worker.engine = SimpleNamespace(lora_limits={"runtime": True, "max_lora_rank": 8, "max_loras": 2},
                                    executor=SimpleNamespace(now=lambda: 100.0))
    if loaded_after_start:
        worker._register()
        if before_load is not None:
            before_load(worker)
        limits = {"w-big": big["lora"]}  # the live workers as the load read them, before w-small registered
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(lora_adapters, "worker_limits", lambda _settings: limits)
            lora_adapters.load(settings, "rt16", str(lora))
    else:
        lora_adapters.load(settings, "rt16", str(lora))
        worker._register()
    with session_scope(settings.sqlalchemy_url) as s:
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="a", max_tokens=4, model="rt16"),
                            settings, dispatch=False).job.id
        assert dispatch.dispatch(s, settings.redis_url, job_id, "tiny", queue="coserve.tiny")
    redis.Redis.from_url(settings.redis_url).delete("coserve.tiny")  # its message taken by the consumer
    return worker, job_id


def test_a_job_of_an_adapter_loaded_between_a_workers_registration_and_its_next_beat_goes_to_one_that_serves_it(
        settings, keys, tmp_path):
    """rt16 (rank 16) was loaded just after w-small (max_lora_rank 8) registered, by a load held to the workers live a
    moment before (w-big). w-small's first job of rt16, before its next beat, is not leased into an engine that
    cannot serve it (its job failed there): it goes back for w-big."""
    worker, job_id = _rt16_with_two_workers(settings, keys, tmp_path, loaded_after_start=True)
    worker.stopping.set()  # no pause after the hand-back: the test goes on at once
    worker.accept(job_id, queue="coserve.tiny")
    with session_scope(settings.sqlalchemy_url) as s:
        assert (s.get(Job, job_id).status, s.get(Job, job_id).attempt) == ("dispatched", 0)  # never leased here
    assert _next_taken(settings, "coserve.tiny", batch=False) == [job_id]  # for w-big
    assert worker.lora_unserved == {"rt16": "its rank 16 is above the max_lora_rank 8 of its vLLM engine"}


def test_a_beats_older_read_of_the_adapters_never_replaces_the_intakes_newer_one(settings, keys, tmp_path,
                                                                                  monkeypatch):
    """The heartbeat and the intake both note the adapters w-small cannot serve (``_check_loras``). A beat read them
    before rt16 (rank 16, above w-small's 8) was loaded, and wrote what it read only after the intake, taking a job
    of rt16, had read and noted rt16 as unserved: that older read must not win. It did: w-small then leased the job
    into an engine that cannot serve it (where it fails) while w-big serves rt16."""
    from app.services import lora_adapters

    beat_read, beat_may_write = threading.Event(), threading.Event()
    unserved = lora_adapters.unserved

    def beat_pauses_after_its_read(said, adapters):
        if threading.current_thread().name == "beat":
            beat_read.set()
            assert beat_may_write.wait(10)
        return unserved(said, adapters)

    monkeypatch.setattr(lora_adapters, "unserved", beat_pauses_after_its_read)

    def beat(worker: GpuWorker) -> None:  # the heartbeat's check, its read made before rt16 is loaded
        def check() -> None:
            with session_scope(settings.sqlalchemy_url) as s:
                GpuWorker._check_loras(worker, s)
        beat.thread = threading.Thread(target=check, name="beat", daemon=True)
        beat.thread.start()
        assert beat_read.wait(10)

    worker, job_id = _rt16_with_two_workers(settings, keys, tmp_path, loaded_after_start=True, before_load=beat)
    intake_check = worker._check_loras

    def intake_then_beat_writes(session):  # the beat's older read lands just after the intake's newer one
        result = intake_check(session)
        beat_may_write.set()
        beat.thread.join(10)
        return result

    monkeypatch.setattr(worker, "_check_loras", intake_then_beat_writes)
    worker.stopping.set()  # no pause after the hand-back: the test goes on at once
    worker.accept(job_id, queue="coserve.tiny")
    assert not beat.thread.is_alive()
    with session_scope(settings.sqlalchemy_url) as s:
        assert (s.get(Job, job_id).status, s.get(Job, job_id).attempt) == ("dispatched", 0)  # never leased here
    assert _next_taken(settings, "coserve.tiny", batch=False) == [job_id]  # for w-big
    assert worker.lora_unserved == {"rt16": "its rank 16 is above the max_lora_rank 8 of its vLLM engine"}
    assert worker.lora_checked == {"rt16"}


def test_a_worker_that_handed_a_job_back_for_a_busy_peer_waits_for_it_to_be_taken_not_taking_it_each_second(
        settings, keys, tmp_path):
    """w-small cannot serve rt16 and handed its job back for w-big, which is busy: its message waits at the head of
    the model's queue, the next w-big takes. w-small takes no message meanwhile (taking it again each second only
    handed it back again: a Celery task, Redis writes and log lines a second, for as long as w-big was busy), and
    goes on once w-big took it; where no worker serves rt16 any more it goes on at once (it takes the job and fails
    it, saying why)."""
    worker, job_id = _rt16_with_two_workers(settings, keys, tmp_path)
    r = redis.Redis.from_url(settings.redis_url)
    returned: list[list[str]] = []

    def accept() -> None:
        worker.accept(job_id, queue="coserve.tiny")
        returned.append(_next_taken(settings, "coserve.tiny", batch=False))  # what waits there as it goes on

    intake = threading.Thread(target=accept, daemon=True)
    intake.start()
    wait_for(lambda: _next_taken(settings, "coserve.tiny", batch=False) == [job_id], 10, "the hand-back")
    intake.join(3 * gpu_worker.DRAIN_PAUSE_S)
    r.rpop("coserve.tiny")  # w-big took it
    intake.join(10)
    assert returned == [[]], returned  # it went on once w-big had taken the job, not while it waited for w-big
    assert dispatch.send_back(settings.redis_url, job_id, "coserve.tiny")  # w-big handed it back: full meanwhile
    r.delete("coserve.tiny")  # w-small took it again
    intake = threading.Thread(target=accept, daemon=True)
    intake.start()
    wait_for(lambda: _next_taken(settings, "coserve.tiny", batch=False) == [job_id], 10, "the hand-back")
    with session_scope(settings.sqlalchemy_url) as s:
        s.delete(s.get(WorkerState, "w-big"))  # gone: nobody else serves rt16
    intake.join(10)
    assert returned[1:] == [[job_id]], returned  # it goes on to take the job again, and fails it
    assert not intake.is_alive()


def test_a_worker_with_runtime_lora_off_says_nothing_of_runtime_adapter_rows_left_from_before(settings, caplog):
    """Runtime adapters were loaded once; now COSERVE_RUNTIME_LORA is off on the API and every worker, so no job may
    name them (the API serves none). A worker starting says no error for each of their rows left in SQL, nor names
    them in its heartbeat (the API's /readyz would warn of each)."""
    from types import SimpleNamespace

    from app.db.models import LoraAdapter
    from app.services.transitions import utcnow

    with session_scope(settings.sqlalchemy_url) as s:
        for name in ("old-a", "old-b"):
            s.add(LoraAdapter(name=name, model="tiny", path=f"/gone/{name}", rank=8, loaded_at=utcnow()))
    worker = GpuWorker(settings.model_copy(update={"runtime_lora": False, "worker_id": "w-off"}))
    worker.engine = SimpleNamespace(lora_limits={"runtime": False, "max_lora_rank": None, "max_loras": None},
                                    executor=SimpleNamespace(now=lambda: 100.0))
    worker._register()
    assert "cannot serve the runtime LoRA adapter" not in caplog.text
    with session_scope(settings.sqlalchemy_url) as s:
        assert "lora_unserved" not in s.get(WorkerState, "w-off").state
