"""A job whose worker has no engine room for it does not keep its message in hand or lose its place: the real
worker's intake against real Redis and SQL (its messages as kombu's Redis transport holds them)."""

from __future__ import annotations

import json
import threading

import pytest

from app.services.dispatch import send_job
from app.services.notify import redis_client
from tests.conftest import wait_for
from tests.integration.test_worker_threads import _leased_jobs
from workers.celery_app import BATCH_PRIORITY, INTERACTIVE_PRIORITY, queue_lists
from workers.gpu_worker import GpuWorker

pytestmark = pytest.mark.integration


def _next_taken(settings, queue: str, batch: bool) -> list[str]:
    """The job ids on ``queue``'s interactive or batch list, in the order consumers take them (BRPOP: right first)."""
    raw = redis_client(settings.redis_url).lrange(queue_lists(queue)[1 if batch else 0], 0, -1)
    return [json.loads(m)["headers"]["argsrepr"].strip("[]'") for m in reversed(raw)]


def _worker(settings, keys, max_inflight: int, in_line: int) -> GpuWorker:
    worker = GpuWorker(settings.model_copy(update={"max_inflight": max_inflight, "interactive_reserve": 1}))
    _leased_jobs(settings, keys, worker, in_line)  # the engine's slots, taken
    return worker


def test_a_batch_job_that_gives_way_keeps_its_place_among_the_batch_jobs(settings, keys):
    """b1 was at the head of the batch list when the worker took it; with batch room gone and an interactive job
    waiting, it goes back and is still the next batch job taken (before b2 and b3, which came after it)."""
    worker = _worker(settings, keys, max_inflight=2, in_line=1)  # batch room 1: full; the interactive slot is free
    for job_id in ("b2", "b3"):
        send_job(settings.redis_url, job_id, settings.model_name, BATCH_PRIORITY)
    send_job(settings.redis_url, "i1", settings.model_name, INTERACTIVE_PRIORITY)
    worker.accept("b1", BATCH_PRIORITY)
    assert _next_taken(settings, worker.queue, batch=True) == ["b1", "b2", "b3"]
    assert _next_taken(settings, worker.queue, batch=False) == ["i1"]


def test_an_interactive_job_on_a_full_worker_goes_back_to_the_head_of_the_shared_queue(settings, keys):
    """The worker's engine is full: the interactive message it took goes back at once, ahead of i2 that came after it,
    for any worker of the model with room; this worker takes no other message until it has room again."""
    worker = _worker(settings, keys, max_inflight=1, in_line=1)
    send_job(settings.redis_url, "i2", settings.model_name, INTERACTIVE_PRIORITY)
    intake = threading.Thread(target=worker.accept, args=("i1", INTERACTIVE_PRIORITY), daemon=True)
    intake.start()
    wait_for(lambda: _next_taken(settings, worker.queue, batch=False) == ["i1", "i2"], 10, "i1 to go back")
    assert intake.is_alive()  # no room yet: the consumer is held, with no message in hand
    for job in worker.active.snapshot():
        worker.active.pop(job.job_id)
    intake.join(10)
    assert not intake.is_alive()
    assert _next_taken(settings, worker.queue, batch=False) == ["i1", "i2"]  # nothing was leased on the way


def test_jobs_a_stopping_worker_gives_back_go_to_the_head_of_the_queue_oldest_first(settings, keys):
    """The jobs a worker ran when it stopped came before every message still waiting: they go back to the head of
    the model's queue, the one that arrived first taken first, ahead of i9 that was sent while they ran."""
    worker = GpuWorker(settings)
    newer, older = _leased_jobs(settings, keys, worker, 2)
    older.request.arrival_time, newer.request.arrival_time = 1.0, 2.0
    send_job(settings.redis_url, "i9", settings.model_name, INTERACTIVE_PRIORITY)
    worker.stop(grace_s=0)
    assert _next_taken(settings, worker.queue, batch=False) == [older.job_id, newer.job_id, "i9"]


def test_a_batch_job_on_a_worker_with_no_batch_room_goes_back_to_the_head_of_the_batch_list(settings, keys):
    """The worker's batch room is full (not its interactive reserve): the batch message it took goes back at once,
    ahead of b2 that came after it, for any worker of the model with batch room; this worker takes no message until
    it has room, or until an interactive job its reserve can take waits (then it goes to take that one)."""
    worker = _worker(settings, keys, max_inflight=2, in_line=1)
    send_job(settings.redis_url, "b2", settings.model_name, BATCH_PRIORITY)
    intake = threading.Thread(target=worker.accept, args=("b1", BATCH_PRIORITY), daemon=True)
    intake.start()
    wait_for(lambda: _next_taken(settings, worker.queue, batch=True) == ["b1", "b2"], 10, "b1 to go back")
    assert intake.is_alive()  # no batch room yet: the consumer is held, with no message in hand
    send_job(settings.redis_url, "i1", settings.model_name, INTERACTIVE_PRIORITY)
    intake.join(10)
    assert not intake.is_alive()
    assert _next_taken(settings, worker.queue, batch=True) == ["b1", "b2"]  # nothing was leased on the way


def _routed_here(settings, keys, worker: GpuWorker, kind: str = "interactive") -> str:
    """A job prefix routing sent to ``worker``'s own queue (dispatched there, as an API whose view of the workers is
    up to ``routing.REFRESH_S`` old still sends it after the worker filled)."""
    from app.auth import authenticate
    from app.db.session import session_scope
    from app.schemas import JobCreate
    from app.services.dispatch import dispatch
    from app.services.jobs import submit_job
    from app.services.routing import worker_queue

    with session_scope(settings.sqlalchemy_url) as s:
        body = {"kind": kind} | ({"deadline_window_s": 3600} if kind == "batch" else {})
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="r", max_tokens=4, **body), settings,
                            dispatch=False).job.id
        assert dispatch(s, settings.redis_url, job_id, settings.model_name, queue=worker_queue(worker.worker_id))
    return job_id


def test_a_job_routed_to_a_full_workers_own_queue_goes_to_the_shared_queue_at_its_next_beat(settings, keys):
    """The worker is full (it takes nothing until a job of its own ends): a job routed to it alone by a view from
    before it filled goes to the head of the model's queue at its heartbeat, for a worker with room, instead of
    waiting here; with room again, the worker keeps what is routed to it."""
    from app.services.routing import worker_queue

    settings.routing = "prefix"
    worker = _worker(settings, keys, max_inflight=1, in_line=1)
    own = worker_queue(worker.worker_id)
    routed = _routed_here(settings, keys, worker)
    worker.heartbeat()
    assert _next_taken(settings, own, batch=False) == []
    assert _next_taken(settings, worker.queue, batch=False) == [routed]
    for job in worker.active.snapshot():
        worker.active.pop(job.job_id)
    kept = _routed_here(settings, keys, worker)
    worker.heartbeat()
    assert _next_taken(settings, own, batch=False) == [kept]


def test_a_batch_job_routed_to_a_worker_with_no_batch_room_goes_to_the_models_batch_list_at_its_next_beat(settings,
                                                                                                          keys):
    """The worker's batch room is full, its interactive reserve free: a batch job routed to it alone by a view from
    before goes to the model's batch list at its heartbeat (it would wait here until a job of the worker's ended)."""
    from app.services.routing import worker_queue

    settings.routing = "prefix"
    worker = _worker(settings, keys, max_inflight=2, in_line=1)  # batch room 1: full
    routed = _routed_here(settings, keys, worker, kind="batch")
    worker.heartbeat()
    assert _next_taken(settings, worker_queue(worker.worker_id), batch=True) == []
    assert _next_taken(settings, worker.queue, batch=True) == [routed]
