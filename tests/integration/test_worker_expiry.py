"""A job the scheduler relegated under overload and then gave up on (issue 18 item 3) ends in SQL as
expired, its SLO missed, and its stream ends with status expired: the real engine thread and outbox
over the real DB and Redis, the engine's outputs handed in as the engine makes them."""

from __future__ import annotations

import pytest
import redis
from sqlalchemy import select

from app.db.models import Job
from app.db.session import session_scope
from app.services.streaming import StreamEvent, stream_key
from gpu_runtime.engine import RequestOutput
from gpu_runtime.metrics import request_metrics
from gpu_runtime.request import RequestStatus
from tests.integration.test_worker_threads import _leased_jobs, _OneStep
from workers.gpu_worker import GpuWorker

pytestmark = pytest.mark.integration


def test_a_relegated_job_that_expires_is_recorded_as_expired(settings, keys):
    worker = GpuWorker(settings)
    (job,) = _leased_jobs(settings, keys, worker, 1, in_engine=True)
    req = job.request
    req.status = RequestStatus.RELEGATED
    relegated = RequestOutput(job.request_id, status=req.status, event="relegated")
    engine_thread = worker.attach(_OneStep([relegated]))
    worker.outbox.apply(engine_thread.iterate())
    url = settings.sqlalchemy_url
    with session_scope(url) as s:
        assert s.scalar(select(Job.status).where(Job.id == job.job_id)) == "relegated"

    req.status, req.finish_time = RequestStatus.FINISHED_EXPIRED, 100.0  # as the engine finishes it
    expired = RequestOutput(job.request_id, status=req.status, event="expired", metrics=request_metrics(req))
    engine_thread = worker.attach(_OneStep([expired]))
    worker.outbox.apply(engine_thread.iterate())
    with session_scope(url) as s:
        row = s.execute(select(Job.status, Job.slo_met, Job.error, Job.finished_at, Job.relegation_count)
                        .where(Job.id == job.job_id)).one()
    assert row.status == "expired" and row.slo_met is False and row.finished_at is not None
    assert "overload" in row.error and row.relegation_count == 1
    assert job.job_id not in worker.active
    worker.outbox.flush_events()
    r = redis.Redis.from_url(settings.redis_url)
    events = [StreamEvent.parse(raw) for _id, raw in r.xrange(stream_key(job.job_id))]
    assert [(e.type, e.status) for e in events] == [("status", "relegated"), ("end", "expired")]


def test_a_job_relegated_after_its_first_tokens_keeps_them_when_it_expires(settings, keys):
    """A stream sent its first tokens and the engine ran them: the expired job keeps its text and token counts (its
    usage, the metrics' counters), as a cancelled one does, and says how far it got."""
    worker = GpuWorker(settings)
    (job,) = _leased_jobs(settings, keys, worker, 1, in_engine=True)
    req = job.request
    req.scheduled_time, req.token_times = req.arrival_time + 0.1, [req.arrival_time + 0.2, req.arrival_time + 0.3]
    req.status = RequestStatus.RELEGATED
    began = RequestOutput(job.request_id, new_token_ids=[5, 6], new_text="Hello there", status=req.status,
                          event="relegated")
    worker.outbox.apply(worker.attach(_OneStep([began])).iterate())
    req.status, req.finish_time = RequestStatus.FINISHED_EXPIRED, req.arrival_time + 100.0
    expired = RequestOutput(job.request_id, status=req.status, event="expired", metrics=request_metrics(req))
    worker.outbox.apply(worker.attach(_OneStep([expired])).iterate())
    with session_scope(settings.sqlalchemy_url) as s:
        row = s.execute(select(Job.status, Job.output_text, Job.completion_tokens, Job.prompt_tokens, Job.ttft_s,
                               Job.error).where(Job.id == job.job_id)).one()
    assert row.status == "expired" and row.output_text == "Hello there" and row.completion_tokens == 2
    assert row.prompt_tokens == req.prompt_len and abs(row.ttft_s - 0.2) < 1e-6
    assert "after 2 of its tokens" in row.error
    worker.outbox.flush_events()
    r = redis.Redis.from_url(settings.redis_url)
    end = [e for e in (StreamEvent.parse(raw) for _id, raw in r.xrange(stream_key(job.job_id))) if e.type == "end"]
    assert end[0].status == "expired" and end[0].data["completion_tokens"] == 2
