"""An interactive job does not wait behind a batch backlog: batch jobs' messages go on their queue's lowest-priority
list (kombu's Redis priorities), a worker with no batch room hands the batch message back and takes no message until
it has room or an interactive job its reserve can take waits, and batch jobs leave the interactive reserve of the
engine's slots free, so the interactive job starts while they run.
A real worker process with room for three jobs, one of them kept for interactive jobs, a real Redis and API."""

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
    # no stop grace: the batch jobs still run when the test ends, and the grace would only wait them out
    with api_and_worker(tmp_path, redis_server, long_tiny_model_dir, COSERVE_MAX_INFLIGHT="3",
                        COSERVE_INTERACTIVE_RESERVE="1", COSERVE_STOP_GRACE_SECONDS="0") as service:
        settings, keys, client = service
        db_url = settings.sqlalchemy_url
        batch = [client.post("/v1/jobs", headers=H(keys.paid), json={
            "prompt": f"Tell me about the sea, part {i}.", "kind": "batch", "deadline_window_s": 3600,
            "max_tokens": 1500, "ignore_eos": True}).json()["id"] for i in range(BACKLOG)]
        # the batch jobs' two slots full, the rest on the queue (the third taken and handed back to the head)
        on_list = redis.Redis.from_url(redis_server).llen
        wait_for(lambda: _running(db_url) >= 2 and on_list(queue_lists("coserve.tiny")[1]) == BACKLOG - 2, 60,
                 "a batch backlog")
        running = _running(db_url)  # batch jobs fill what they may of the engine
        on_batch_list = on_list(queue_lists("coserve.tiny")[1])
        interactive = client.post("/v1/jobs", headers=H(keys.paid), json={
            "prompt": "Hello", "max_tokens": 4, "ttft_ms": 60_000, "tbt_ms": 60_000}).json()["id"]
        wait_for(lambda: _started_at(db_url, interactive), 60, "the interactive job to start")
        with session_scope(db_url) as s:
            started = _started_at(db_url, interactive)
            before = list(s.scalars(select(Job.id).where(Job.id.in_(batch), Job.started_at.is_not(None),
                                                         Job.started_at < started)))
            ended_before = list(s.scalars(select(Job.id).where(Job.id.in_(batch), Job.finished_at < started)))
    # FIFO it waited for all ten; with every slot open to batch jobs, for one of them to end. Now it takes the
    # reserved slot beside the two running: none ended before it started, the worker waiting for batch room took it
    assert ended_before == []
    assert len(before) == 2, before
    assert running == 2
    assert on_batch_list == BACKLOG - 2  # kombu's lowest-priority list of the model's queue


def _running(db_url: str) -> int:
    with session_scope(db_url) as s:
        return len(s.scalars(select(Job.id).where(Job.status == "running")).all())


def _started_at(db_url: str, job_id: str):
    with session_scope(db_url) as s:
        return s.scalar(select(Job.started_at).where(Job.id == job_id))
