"""An interactive job does not wait behind a batch backlog: batch jobs' messages go on their queue's lowest-priority
list (kombu's Redis priorities), and a batch job waiting for engine room gives way to a waiting interactive one.
A real worker process with room for two jobs, a real Redis and API."""

from __future__ import annotations

import pytest
import redis
from sqlalchemy import select

from app.db.models import Job
from app.db.session import session_scope
from tests.conftest import Keys, api_and_worker, wait_for
from workers.celery_app import queue_lists

pytestmark = pytest.mark.integration

H = Keys.header
BACKLOG = 10


def test_an_interactive_job_is_taken_before_a_batch_backlog(tmp_path, redis_server, long_tiny_model_dir):
    with api_and_worker(tmp_path, redis_server, long_tiny_model_dir, COSERVE_MAX_INFLIGHT="2") as service:
        settings, keys, client = service
        db_url = settings.sqlalchemy_url
        batch = [client.post("/v1/jobs", headers=H(keys.paid), json={
            "prompt": f"Tell me about the sea, part {i}.", "kind": "batch", "deadline_window_s": 3600,
            "max_tokens": 1500, "ignore_eos": True}).json()["id"] for i in range(BACKLOG)]
        # the engine full with two of them, a third held waiting for room, the rest on the queue
        wait_for(lambda: _running(db_url) == 2 and _held(db_url), 60, "a batch backlog")
        on_batch_list = redis.Redis.from_url(redis_server).llen(queue_lists("coserve.tiny")[1])
        interactive = client.post("/v1/jobs", headers=H(keys.paid), json={
            "prompt": "Hello", "max_tokens": 4, "ttft_ms": 60_000, "tbt_ms": 60_000}).json()["id"]
        wait_for(lambda: _started_at(db_url, interactive), 60, "the interactive job to start")
        with session_scope(db_url) as s:
            before = list(s.scalars(select(Job.id).where(Job.id.in_(batch), Job.started_at.is_not(None),
                                                         Job.started_at < _started_at(db_url, interactive))))
    # FIFO it waited for all ten; now for a slot: the two running, and at most the one held when it came
    assert len(before) <= 3, before
    assert on_batch_list == BACKLOG - 3  # kombu's lowest-priority list of the model's queue


def _running(db_url: str) -> int:
    with session_scope(db_url) as s:
        return len(s.scalars(select(Job.id).where(Job.status == "running")).all())


def _held(db_url: str) -> bool:
    with session_scope(db_url) as s:
        return s.scalar(select(Job.id).where(Job.status == "dispatched", Job.worker_id.is_not(None))) is not None


def _started_at(db_url: str, job_id: str):
    with session_scope(db_url) as s:
        return s.scalar(select(Job.started_at).where(Job.id == job_id))
