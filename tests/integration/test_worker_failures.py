"""The GPU worker's answer to an engine step that raises: its jobs go back to the queue (a new
attempt, maybe elsewhere) instead of all failing; the last allowed attempt fails (real DB and Redis,
a stand-in engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import redis
from sqlalchemy import select

from app.auth import authenticate
from app.db.models import Job, JobEvent
from app.db.session import session_scope
from app.schemas import JobCreate
from app.services.jobs import submit_job
from app.services.streaming import StreamEvent, stream_key
from tests.conftest import Keys, wait_for
from tests.redis_process import own_redis  # noqa: F401 - fixture
from workers import lease as leases
from workers.active_job import ActiveJob
from workers.gpu_worker import GpuWorker
from workers.outbox import StepRecords

pytestmark = pytest.mark.integration

H = Keys.header


class _Engine:
    has_work = False

    def __init__(self, queue_len) -> None:
        self.aborted: list[str] = []
        self.steps: list[int] = []  # the queue's length when each step began
        self.queue_len = queue_len

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def step(self) -> list:
        self.steps.append(self.queue_len())
        return []


def test_engine_error_requeues_jobs_and_fails_only_the_exhausted(settings, keys):
    url = settings.sqlalchemy_url
    settings = settings.model_copy(update={"max_attempts": 2})
    worker = GpuWorker(settings)
    r = redis.Redis.from_url(settings.redis_url)
    engine_thread = worker.attach(_Engine(lambda: r.llen("coserve.tiny")))
    with session_scope(url) as s:
        principal = authenticate(s, keys.paid)
        fresh, last = (submit_job(s, principal, JobCreate(prompt=p, max_tokens=4), settings, dispatch=False).job.id
                       for p in ("fresh", "last"))
    with session_scope(url) as s:
        s.execute(Job.__table__.update().where(Job.id == last).values(attempt=1))  # it ran once before
    with session_scope(url) as s:
        requests = [leases.acquire(s, job_id, worker.worker_id, 30) for job_id in (fresh, last)]
    for lease in requests:
        worker.active.add(ActiveJob(lease, None, None, in_engine=True))

    worker.outbox.apply(StepRecords(records=engine_thread.fail_all("engine error: boom")))
    worker.outbox.flush_events()

    assert len(worker.active) == 0 and sorted(worker.engine.aborted) == sorted(lease.request_id for lease in requests)
    with session_scope(url) as s:
        a, b = s.get(Job, fresh), s.get(Job, last)
        assert (a.status, a.attempt, a.worker_id, a.lease_expires_at) == ("dispatched", 1, None, None)
        assert b.status == "failed" and "gave up after 2 attempts" in b.error
    # sent again at once: a return to this worker before the engine takes the aborts runs beside the aborted request,
    # under its own request id (test_a_job_an_engine_error_gave_back_is_rerun_here_beside_the_abort_the_engine_...)
    assert r.llen("coserve.tiny") == 1 and worker.engine.steps == []
    end = StreamEvent.parse(r.xrange(stream_key(last))[-1][1])
    assert end.type == "end" and end.status == "failed"
    assert not r.exists(stream_key(fresh))  # its stream goes on with the next attempt
    assert fresh.encode() in r.lrange("coserve.tiny", 0, -1)[0]
    with session_scope(url) as s:
        details = s.scalars(select(JobEvent.detail).where(JobEvent.job_id == fresh).order_by(JobEvent.id)).all()
    assert details[-2:] == [f"engine error on {worker.worker_id}; requeued", "requeued after an engine error"]


def test_jobs_requeued_after_an_engine_error_go_to_the_head_first_admitted_first(settings, keys):
    """The jobs an engine error gave back ran before every message waiting: their resend puts them at the head of
    the model's queue, in the order the engine took them, ahead of a message sent while they ran."""
    from app.services.dispatch import send_job
    from tests.integration.test_worker_room import _next_taken

    worker = GpuWorker(settings)
    engine_thread = worker.attach(_Engine(lambda: 0))
    with session_scope(settings.sqlalchemy_url) as s:
        principal = authenticate(s, keys.paid)
        first, second = (submit_job(s, principal, JobCreate(prompt=p, max_tokens=4), settings, dispatch=False).job.id
                         for p in ("first", "second"))  # queued, as an engine error's give-back leaves them
    send_job(settings.redis_url, "later", settings.model_name)
    worker.outbox.apply(StepRecords(records=engine_thread._resend([first, second])))
    assert _next_taken(settings, "coserve.tiny", batch=False) == [first, second, "later"]


def test_a_configured_adapters_job_requeued_after_an_engine_error_goes_to_the_adapters_queue(settings, keys):
    """A job of a configured LoRA adapter (``COSERVE_LORA_MODULES``) an engine error gave back goes to the adapter's
    own queue, as dispatch and the sweeper send it (``back_to_queues``): on the model's queue a worker of the model
    without that adapter took it, and failed it as an adapter "unloaded before this job began"."""
    settings.lora_modules = {"sql-lora": "/adapters/sql"}
    worker = GpuWorker(settings)
    engine_thread = worker.attach(_Engine(lambda: 0))
    with session_scope(settings.sqlalchemy_url) as s:
        principal = authenticate(s, keys.paid)
        adapted, plain = (submit_job(s, principal, JobCreate(prompt="hi", max_tokens=4, model=model), settings,
                                     dispatch=False).job.id for model in ("sql-lora", "tiny"))
    with session_scope(settings.sqlalchemy_url) as s:
        for lease in [leases.acquire(s, job_id, worker.worker_id, 30) for job_id in (adapted, plain)]:
            worker.active.add(ActiveJob(lease, None, None, in_engine=True))

    worker.outbox.apply(StepRecords(records=engine_thread.fail_all("engine error: boom")))

    r = redis.Redis.from_url(settings.redis_url)
    assert [adapted.encode() in m for m in r.lrange("coserve.sql-lora", 0, -1)] == [True]
    assert [plain.encode() in m for m in r.lrange("coserve.tiny", 0, -1)] == [True]


def test_a_worker_on_the_own_engine_does_not_start_with_lora_adapters(settings):
    """The own engine serves no adapters: a worker set to serve some on it stops at start, saying why, rather
    than answer their requests with the model alone."""
    settings.lora_modules = {"sql-lora": "/adapters/sql"}
    with pytest.raises(SystemExit, match="LoRA adapters are served on the vLLM backend"):
        GpuWorker(settings)._build_engine()


class _Raising:
    """An engine whose step raises ``error`` (as one request's bad grammar or prompt can fail a whole step)."""

    has_work = True

    def __init__(self, error: Exception) -> None:
        self.error = error

    def abort(self, request_id: str) -> None:
        pass

    def step(self) -> list:
        raise self.error


def test_a_failed_steps_error_tells_no_job_of_another_tenants_request(client, settings, keys):
    """A step runs many tenants' requests: the error it raised may quote one of them (its prompt, its schema, its
    id). Each job it fails is told the error's kind only, not its text: no tenant reads another's request in its
    job's error (the worker's log keeps the whole error for the operator)."""
    url, secret = settings.sqlalchemy_url, "acme's quarterly figures: 41.7M"
    worker = GpuWorker(settings.model_copy(update={"max_attempts": 1}))  # a failed step fails its jobs at once
    engine_thread = worker.attach(_Raising(ValueError(f"grammar failed to compile for {secret!r}")))
    with session_scope(url) as s:
        theirs = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt=secret, max_tokens=4), settings,
                            dispatch=False).job.id
        mine = submit_job(s, authenticate(s, keys.other), JobCreate(prompt="hi", max_tokens=4), settings,
                          dispatch=False).job.id
    with session_scope(url) as s:
        for job_id in (theirs, mine):
            worker.active.add(ActiveJob(leases.acquire(s, job_id, worker.worker_id, 30), None, None,
                                        in_engine=True))

    worker.outbox.apply(engine_thread.iterate())
    worker.outbox.flush_events()

    for key, job_id in ((keys.other, mine), (keys.paid, theirs)):
        r = client.get(f"/v1/jobs/{job_id}", headers=H(key))
        assert r.status_code == 200 and r.json()["status"] == "failed", r.text
        assert secret not in r.text, f"a failed step's error shows a request's prompt: {r.json()['error']}"
        assert "ValueError" in r.json()["error"], r.text  # what kind of error it was, still said
    end = StreamEvent.parse(redis.Redis.from_url(settings.redis_url).xrange(stream_key(mine))[-1][1])
    assert end.type == "end" and secret not in str(end), end


def test_a_worker_whose_engine_keeps_failing_gives_its_jobs_back_and_exits(settings, keys, start_worker, tmp_path):
    """A lost device fails every step: after ``engine_error_limit`` failed steps in a row the worker process gives
    its jobs back and exits with status 1 (as vLLM's server does when its engine dies), instead of taking jobs
    from the queue only to fail them all, one attempt after another."""
    worker = start_worker("w1", COSERVE_ENGINE_FACTORY="tests.integration.broken_engine:build",
                          COSERVE_ENGINE_ERROR_LIMIT="2")
    with session_scope(settings.sqlalchemy_url) as s:
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="hello", max_tokens=4), settings).job.id
    assert worker.wait(90) == 1
    log_text = (tmp_path / "w1.log").read_text()
    assert "the engine is broken (2 engine steps failed with no token made between them (device lost))" in log_text
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, job_id)
        # two attempts ran and failed on this worker; the job waits in the queue for a healthy one
        assert (job.status, job.attempt, job.worker_id, job.error) == ("dispatched", 2, None, None)
        details = s.scalars(select(JobEvent.detail).where(JobEvent.job_id == job_id)).all()
    assert details.count("engine error on w1; requeued") == 2
    assert redis.Redis.from_url(settings.redis_url).llen("coserve.tiny") == 1


class _Flaky:
    """Steps as told: "raise", "token" (a token made) or "quiet" (a step that ran and made none, e.g. a prefill
    chunk, or one that only took aborts)."""

    has_work = True

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.held = "held:1"  # the request id of the attempt it runs

    def abort(self, request_id: str) -> None:
        pass

    def step(self) -> list:
        what = self.script.pop(0)
        if what == "raise":
            raise RuntimeError("device lost")
        made = what == "token"
        return [SimpleNamespace(request_id=self.held, new_token_ids=[7] if made else [], new_text="x" if made else "",
                                prompt_logprobs=None, new_logprobs=None, event=None, finished=False)]


@pytest.mark.parametrize(("script", "broken"), [
    (["raise", "token", "raise", "token", "raise"], False),  # a token between failures: a bad request, not a device
    (["raise", "quiet", "raise"], True),  # a step that made nothing proves nothing
])
def test_only_failures_with_no_token_between_them_break_the_engine(settings, script, broken):
    worker = GpuWorker(settings.model_copy(update={"engine_error_limit": 2}))
    engine_thread = worker.attach(_Flaky(list(script)))
    for attempt in range(1, len(script) + 1):  # each step's job: a new attempt where a failure gave the last back
        if (held := worker.active.get("held")) is None or held.finished:
            worker.active.add(ActiveJob(lease := leases.Lease("held", attempt, worker.worker_id), None, None,
                                        in_engine=True))
            worker.engine.held = lease.request_id
        engine_thread.iterate()
    assert (engine_thread.broken is not None) is broken


def test_a_job_an_engine_error_gave_back_is_rerun_here_beside_the_abort_the_engine_has_not_taken(settings, keys):
    """A failed step gives its jobs back and aborts them in the engine, which takes the aborts at its next step. A
    rerun that comes back to this worker sooner is added beside the aborted request at once: the engine knows each
    attempt by its own request id, so the pending abort hits attempt 1 alone, and attempt 1's last word (aborted) is
    not the rerun's; the rerun runs to the end."""
    from gpu_runtime.request import RequestStatus
    from tests.integration.test_worker_threads import leased_on_sim_engine

    url = settings.sqlalchemy_url
    worker, engine, engine_thread, job_id = leased_on_sim_engine(settings, keys)
    for _ in range(4):  # attempt 1 runs
        worker.outbox.apply(engine_thread.iterate())
    first = worker.active.get(job_id)
    assert first.request.num_output_tokens > 0
    real_step = engine.executor.step

    def lost_once(plan):
        engine.executor.step = real_step
        raise RuntimeError("device hiccup")

    engine.executor.step = lost_once
    worker.outbox.apply(engine_thread.iterate())  # the step raises: attempt 1 is given back, its abort is pending
    assert len(worker.active) == 0 and worker.active.abandoned_ids() == [first.request.request_id]
    assert _job_status(url, job_id) == "dispatched"  # sent again at once
    worker.accept(job_id)  # its message comes back here before the engine took the abort
    second = worker.active.get(job_id)
    assert second is not None and second.lease.attempt == 2
    assert first.request.status is not RequestStatus.FINISHED_ABORTED  # its abort still pending
    worker.outbox.apply(engine_thread.iterate())  # the engine takes the abort: attempt 1's alone
    assert first.request.status is RequestStatus.FINISHED_ABORTED and worker.active.abandoned_ids() == []
    assert worker.active.get(job_id) is second and second.request.status is not RequestStatus.FINISHED_ABORTED
    for _ in range(60):
        worker.outbox.apply(engine_thread.iterate())
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert (job.status, job.attempt, job.completion_tokens) == ("succeeded", 2, 12)
    assert not engine.has_work


def _job_status(url: str, job_id: str) -> str:
    with session_scope(url) as s:
        return s.get(Job, job_id).status


def _leased_with_redis_away(settings, keys, own_redis) -> tuple:
    """A worker (its engine a stand-in) holding a job's lease in its engine, and then Redis stopped: (the database's
    url, the worker, its engine thread, the job's id)."""
    url = settings.sqlalchemy_url
    settings.redis_url = own_redis.url
    worker = GpuWorker(settings)
    engine_thread = worker.attach(_Engine(lambda: 0))
    with session_scope(url) as s:
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="hi", max_tokens=4), settings,
                            dispatch=False).job.id
    with session_scope(url) as s:
        worker.active.add(ActiveJob(leases.acquire(s, job_id, worker.worker_id, 30), None, None, in_engine=True))
    own_redis.stop()
    return url, worker, engine_thread, job_id


def _sent_by_the_next_sweep(url: str, own_redis, job_id: str,
                            given_back: str = "requeued after an engine error") -> None:
    """The job given back (its event's detail ``given_back``) is queued; once Redis is back the next sweep sends it to
    the head of its queue."""
    from workers.sweeper import sweep

    assert _job_status(url, job_id) == "queued"
    own_redis.start()
    with session_scope(url, immediate=True) as s:
        assert sweep(s, own_redis.url, queued_grace_s=0).dispatched == 1
    assert job_id.encode() in redis.Redis.from_url(own_redis.url).lindex("coserve.tiny", -1)  # the next taken
    with session_scope(url) as s:
        details = s.scalars(select(JobEvent.detail).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all()
    assert details[-3:] == [given_back, "broker unavailable; the sweeper will send it", "sent by the sweeper"]


def test_a_job_whose_resend_the_broker_never_took_is_sent_by_the_next_sweep(settings, keys, own_redis, monkeypatch):
    """An engine error gives a job back while Redis is away for longer than the outbox retries its message's send.
    While the send is retried the job stays dispatched (no sweep sends it ahead of its attempt's last deltas); once
    the send is given up it is back to queued, and the next sweep after Redis returns sends it to the head of its
    queue. (It was left dispatched with no message: only the sweeper's rule for a lost message sent it,
    ``max(30, 5 x lease)`` s after the mark.)"""
    from workers import outbox as outbox_module

    monkeypatch.setattr(outbox_module, "MAX_TRIES", 2)  # the ~40 s of retries of a send, in two tries
    url, worker, engine_thread, job_id = _leased_with_redis_away(settings, keys, own_redis)

    worker.outbox.apply(StepRecords(records=engine_thread.fail_all("engine error: boom")))
    assert _job_status(url, job_id) == "dispatched" and worker.outbox._retry  # its send is retried
    wait_for(lambda: worker.outbox.retry_due() or not worker.outbox._retry, 10, "the send given up")

    _sent_by_the_next_sweep(url, own_redis, job_id)


def test_a_job_whose_resend_is_held_when_the_worker_stops_is_sent_by_the_next_sweep(settings, keys, own_redis):
    """An engine error gives a job back while Redis is away: its message's send is held behind its attempt's last
    deltas when the worker stops and the outbox closes. The deltas are lost with the process (a rerun goes on from
    what readers saw); the job is back to queued at close, where the next sweep after Redis returns sends it. (It was
    left dispatched with no message: only the sweeper's rule for a lost message sent it, ``max(30, 5 x lease)`` s
    after the mark.)"""
    url, worker, engine_thread, job_id = _leased_with_redis_away(settings, keys, own_redis)

    worker.outbox.apply(StepRecords(deltas=[(job_id, StreamEvent("delta", attempt=1, text="a", token_ids=[1]))]))
    worker.outbox.apply(StepRecords(records=engine_thread.fail_all("engine error: boom")))
    assert _job_status(url, job_id) == "dispatched" and worker.outbox._held  # its send waits for the delta
    worker.outbox.start()
    worker.outbox.close(timeout=0.5)

    _sent_by_the_next_sweep(url, own_redis, job_id)


def _rerun_given_over_with_redis_away(settings, keys, own_redis, last_deltas_waiting: bool) -> tuple:
    """A worker (on the simulated engine) runs attempt 1 of a job whose lease lapsed, the sweeper resends the job, and
    Redis stops (``last_deltas_waiting``: attempt 1's last step after that, its deltas waiting in the outbox). The
    resend comes back here and the intake gives it over to the engine thread (``Supersede``), which sets attempt 1
    aside and puts the rerun's hand-back in the outbox. (The database's url, the worker, the job's id.)"""
    from tests.integration.test_worker_threads import _lapse_and_requeue, leased_on_sim_engine

    settings.redis_url = own_redis.url
    worker, _engine, engine_thread, job_id = leased_on_sim_engine(settings, keys)
    for _ in range(5):  # attempt 1 runs: its prompt and a few tokens, published
        worker.outbox.apply(engine_thread.iterate())
    worker.outbox.flush_events()
    _lapse_and_requeue(settings, job_id)
    own_redis.stop()
    if last_deltas_waiting:
        worker.outbox.apply(engine_thread.iterate())
        assert worker.outbox._events
    worker.accept(job_id)  # the resend comes back here while attempt 1 runs: given over to the engine thread
    worker.outbox.apply(engine_thread.iterate())  # takes the Supersede: attempt 1 set aside, its message to go back
    assert worker.active.get(job_id) is None and _job_status(settings.sqlalchemy_url, job_id) == "dispatched"
    return settings.sqlalchemy_url, worker, job_id


def test_a_rerun_whose_hand_back_the_broker_never_took_is_sent_by_the_next_sweep(settings, keys, own_redis,
                                                                                 monkeypatch):
    """The message of a rerun that came back to the worker still running its attempt goes back to its queue through
    the outbox, while Redis is away for longer than the outbox retries the send: once the send is given up the job is
    back to queued, and the next sweep after Redis returns sends it to the head of its queue. (It was left dispatched
    with no message: only the sweeper's rule for a lost message sent it, ``max(30, 5 x lease)`` s later.)"""
    from workers import outbox as outbox_module

    monkeypatch.setattr(outbox_module, "MAX_TRIES", 2)  # the ~40 s of retries of a send, in two tries
    url, worker, job_id = _rerun_given_over_with_redis_away(settings, keys, own_redis, last_deltas_waiting=False)
    assert worker.outbox._retry  # its send is retried
    wait_for(lambda: worker.outbox.retry_due() or not worker.outbox._retry, 10, "the send given up")

    _sent_by_the_next_sweep(url, own_redis, job_id, given_back="sent by the sweeper")


def test_a_rerun_whose_hand_back_is_held_when_the_worker_stops_is_sent_by_the_next_sweep(settings, keys, own_redis):
    """The message of a rerun that came back to the worker still running its attempt waits in the outbox behind that
    attempt's last deltas while Redis is away, when the worker stops and the outbox closes: the job is back to queued
    at close, where the next sweep after Redis returns sends it. (It was left dispatched with no message: only the
    sweeper's rule for a lost message sent it, ``max(30, 5 x lease)`` s later.)"""
    url, worker, job_id = _rerun_given_over_with_redis_away(settings, keys, own_redis, last_deltas_waiting=True)
    assert worker.outbox._held  # its send waits for the deltas
    worker.outbox.start()
    worker.outbox.close(timeout=0.5)

    _sent_by_the_next_sweep(url, own_redis, job_id, given_back="sent by the sweeper")
