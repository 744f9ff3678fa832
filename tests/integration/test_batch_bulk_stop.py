"""A large batch's jobs end in bulk: a cancel, or a read after the window ended, answers at once with every job
ended and the counts right; a cancel that loses to the batch's own end answers 409; the fan-out inserts its jobs and
sends them in one batched send (the real app, Redis and SQLite; no worker: the jobs wait on their queue)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import redis
from sqlalchemy import Engine, event, func, select, update

from app.batch import fanout
from app.batch import finalize
from app.db.models import Batch, Job, JobEvent
from app.db.session import session_scope, write_guard
from app.services import dispatch
from app.services.streaming import CANCEL_CHANNEL
from app.services.transitions import utcnow
from tests.conftest import Keys
from workers.celery_app import queue_lists

pytestmark = pytest.mark.integration

PROMPT_BOUND_S = 20  # generous: one job a transaction took ~80 s for 2000 jobs on the auditor's stack
BULK_UPDATES = 50  # UPDATE statements on jobs a bulk stop of up to 2000 jobs may take (one a job before)


def _batch(client, keys, lines: int) -> str:
    """A batch of ``lines`` one-job lines, validated and fanned out (TestClient runs the fan-out before it returns)."""
    text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}}) for i in range(lines))
    auth = Keys.header(keys.paid)
    f = client.post("/v1/files", headers=auth, data={"purpose": "batch"}, files={"file": ("in.jsonl", text)}).json()
    batch = client.post("/v1/batches", headers=auth, json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                           "completion_window": "24h"}).json()
    assert client.get(f"/v1/batches/{batch['id']}", headers=auth).json()["status"] == "in_progress"
    return batch["id"]


def _job_statuses(settings, batch_id: str) -> dict[str, int]:
    with session_scope(settings.sqlalchemy_url) as s:
        rows = s.execute(select(Job.status, func.count()).where(Job.batch_id == batch_id).group_by(Job.status))
        return {status: n for status, n in rows}


def _events_to(settings, batch_id: str, status: str) -> int:
    with session_scope(settings.sqlalchemy_url) as s:
        return s.scalar(select(func.count()).select_from(JobEvent).join(Job, Job.id == JobEvent.job_id).where(
            Job.batch_id == batch_id, JobEvent.to_status == status))


@contextmanager
def _job_updates() -> Iterator[list[str]]:
    """The UPDATE statements on the jobs table that any engine runs meanwhile."""
    seen: list[str] = []

    def on_execute(_conn, _cursor, statement, *_args) -> None:
        if statement.lstrip().upper().startswith("UPDATE JOBS"):
            seen.append(statement)

    event.listen(Engine, "before_cursor_execute", on_execute)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", on_execute)


def test_cancelling_a_large_batch_answers_promptly_and_cancels_every_job(client, keys, settings):
    batch_id = _batch(client, keys, 2000)
    with session_scope(settings.sqlalchemy_url) as s, write_guard(s):  # a worker holds three of them
        running = list(s.scalars(select(Job.id).where(Job.batch_id == batch_id).order_by(Job.id).limit(3)))
        s.execute(update(Job).where(Job.id.in_(running)).values(status="running", worker_id="w1", attempt=1))
        s.commit()
    listener = redis.Redis.from_url(settings.redis_url).pubsub()
    listener.subscribe(CANCEL_CHANNEL)
    listener.get_message(timeout=1)  # the subscription's confirmation

    began = time.monotonic()
    with _job_updates() as updates:
        answer = client.post(f"/v1/batches/{batch_id}/cancel", headers=Keys.header(keys.paid))
    took = time.monotonic() - began
    assert answer.status_code == 200 and took < PROMPT_BOUND_S, (answer.text, took)
    assert len(updates) <= BULK_UPDATES
    batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert batch["status"] == "cancelled"
    assert batch["request_counts"] == {"total": 2000, "completed": 0, "failed": 2000}
    assert _job_statuses(settings, batch_id) == {"cancelled": 2000}
    assert _events_to(settings, batch_id, "cancelled") == 2000
    # only the running jobs' workers are told: the others' leases find them ended
    told = set()
    while (message := listener.get_message(timeout=1)) is not None:
        told.add(message["data"].decode())
    assert told == set(running)


def test_reading_a_batch_whose_window_ended_expires_its_jobs_promptly(client, keys, settings):
    batch_id = _batch(client, keys, 1000)
    with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
        s.execute(update(Batch).where(Batch.id == batch_id).values(expires_at=utcnow() - timedelta(minutes=1)))
        s.commit()

    began = time.monotonic()
    with _job_updates() as updates:
        batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert time.monotonic() - began < PROMPT_BOUND_S
    assert len(updates) <= BULK_UPDATES
    assert batch["status"] == "expired"
    assert batch["request_counts"] == {"total": 1000, "completed": 0, "failed": 1000}
    assert _job_statuses(settings, batch_id) == {"expired": 1000}
    assert _events_to(settings, batch_id, "expired") == 1000


def test_a_cancel_that_loses_to_the_batchs_own_end_answers_409(client, keys, settings, monkeypatch):
    batch_id = _batch(client, keys, 2)
    real_cancel = finalize.cancel_batch

    def batch_ends_first(session, batch, *args):  # between the route's read and the cancel's update
        with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
            s.execute(update(Batch).where(Batch.id == batch_id).values(status="finalizing", finalizing_at=utcnow()))
            s.commit()
        return real_cancel(session, batch, *args)

    monkeypatch.setattr(fanout, "cancel_batch", batch_ends_first)  # the cancel routes' (fanout.cancel_and_count)
    answer = client.post(f"/v1/batches/{batch_id}/cancel", headers=Keys.header(keys.paid))
    assert answer.status_code == 409, answer.text
    assert answer.headers["x-should-retry"] == "false"
    assert "finalizing" in answer.json()["error"]["message"]
    assert _job_statuses(settings, batch_id) == {"dispatched": 2}  # the cancel changed nothing


def test_the_fanout_sends_its_jobs_in_one_batched_send(client, keys, settings, monkeypatch):
    real_send = dispatch.send_jobs
    sends: list[int] = []

    def counted(redis_url, jobs):
        sends.append(len(jobs))
        return real_send(redis_url, jobs)

    monkeypatch.setattr(dispatch, "send_jobs", counted)
    batch_id = _batch(client, keys, 300)
    assert sends == [300]
    assert _job_statuses(settings, batch_id) == {"dispatched": 300}
    assert _events_to(settings, batch_id, "dispatched") == 300
    # batch jobs wait on the queue's lowest-priority list (interactive jobs come first)
    depth = redis.Redis.from_url(settings.redis_url).llen(queue_lists("coserve.tiny")[1])
    assert depth >= 300, depth
