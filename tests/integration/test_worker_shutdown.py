"""A worker's shutdown and drain: what happens to the jobs it runs and to the message it holds (real SQLite, real
Redis; a real worker process for the signals)."""

from __future__ import annotations

import signal
import threading

import pytest
import redis
from celery.worker import state as celery_state
from sqlalchemy import select

from app.auth import authenticate
from app.db.models import Job, JobEvent, JobStatus
from app.db.session import session_scope
from app.schemas import JobCreate
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


def test_a_cold_shutdown_gives_the_running_job_back_at_once(settings, keys, start_worker):
    """SIGQUIT (Celery's cold shutdown: "terminate all running tasks") hands the running job back to the head of the
    queue, dispatched for the next worker, instead of letting it run on for the warm shutdown's grace."""
    worker = start_worker("w1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build", COSERVE_STEP_DELAY_S="0.01")
    job_id = _submit(settings, keys, dispatch=True, max_tokens=400, ignore_eos=True)  # 400 steps of 10 ms at least
    r = redis.Redis.from_url(settings.redis_url)
    wait_for(lambda: r.xlen(stream_key(job_id)) >= 4, 60, "the job to stream")
    worker.send_signal(signal.SIGQUIT)
    worker.wait(60)
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, job_id)
        assert (job.status, job.attempt, job.worker_id, job.completion_tokens) == ("dispatched", 1, None, None)
    assert _details(settings, job_id)[-2:] == ["worker w1 shut down", "given back at shutdown"]
    assert _next_taken(settings, "coserve.tiny", batch=False) == [job_id]  # one message: no sweep sends it twice


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
