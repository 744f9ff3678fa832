"""Kill -9 a worker mid-generation: every accepted job still completes exactly once."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis
from sqlalchemy import func, select

from app.auth import authenticate
from app.db.models import Job, JobEvent
from app.db.session import session_scope
from app.schemas import JobCreate
from app.services.jobs import submit_job
from app.services.streaming import stream_key
from tests.conftest import Keys, wait_for

pytestmark = pytest.mark.integration

H = Keys.header
N_JOBS = 6
MAX_TOKENS = 80


def test_sigkill_mid_generation_every_job_succeeds_once(client, keys, settings, start_worker):
    url = settings.sqlalchemy_url
    # w1's steps are slowed (0.1 s each) so that its four jobs are still running when the test looks, however
    # loaded the box is: unslowed, they all ended before a loaded test process looked
    w1 = start_worker("w1", COSERVE_MAX_INFLIGHT="4", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build",
                      COSERVE_STEP_DELAY_S="0.1")
    ids = []
    for i in range(N_JOBS):
        r = client.post("/v1/jobs", headers=H(keys.paid),
                        json={"prompt": f"Story number {i}:", "max_tokens": MAX_TOKENS, "ignore_eos": True})
        assert r.status_code == 201
        ids.append(r.json()["id"])
    rds = redis.Redis.from_url(settings.redis_url)

    def mid_generation():
        with session_scope(url) as s:
            running = s.scalars(select(Job.id).where(Job.status == "running")).all()
        return [j for j in running if rds.xlen(stream_key(j)) >= 3]

    wait_for(mid_generation, 60, "a job to be mid-generation")

    def waiting_on_the_queue():  # w1's engine is full: the 5th message it took went back to the queue's head
        with session_scope(url) as s:
            # relegated (a loaded box misses the TTFT) is still in w1's engine
            running = s.scalar(select(func.count()).select_from(Job).where(Job.status.in_(["running", "relegated"])))
            waiting = s.scalars(select(Job.id).where(Job.status == "dispatched", Job.worker_id.is_(None))).all()
        # (fewer than N_JOBS - 4 wait where one of the four ended first and w1 took the next)
        return running == 4 and rds.llen("coserve.tiny") == len(waiting) and waiting
    # 60 s: the heaviest files now run beside this one (tests/file_order.py), and CI once took longer than 30
    held = wait_for(waiting_on_the_queue, 60, "w1 to run four jobs and hand the rest back")
    # the jobs mid-generation as w1 dies (looked at just before: one seen earlier may have ended while the test
    # waited on a loaded box, and w1 took the next)
    victims = wait_for(mid_generation, 60, "a job to be mid-generation")
    os.killpg(w1.pid, signal.SIGKILL)  # the worker and anything it started, no chance to clean up
    w1.wait(10)
    with session_scope(url) as s:
        interrupted = s.scalars(select(Job.id).where(Job.status.in_(["running", "relegated"]))).all()
    assert set(victims) <= set(interrupted)

    start_worker("w2")
    restarted = time.monotonic()

    def taken_by_w2():
        with session_scope(url) as s:
            return all(s.get(Job, j).worker_id == "w2" for j in held)
    # on the queue, not in w1's hands: taken as soon as w2 starts, not after Redis's hour-long visibility
    # timeout or the sweeper's age rule (a minute): TTFT targets are seconds
    wait_for(taken_by_w2, 120, "w2 to get the jobs w1 had no room for")
    assert time.monotonic() - restarted < 30

    def all_done():
        with session_scope(url) as s:
            return s.scalar(select(func.count()).select_from(Job).where(
                Job.id.in_(ids), Job.status.in_(["succeeded", "failed", "cancelled", "expired"]))) == N_JOBS
    wait_for(all_done, 180, "every job to finish after the restart", interval=0.5)

    with session_scope(url) as s:
        jobs = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_(ids)))}
        terminal = s.execute(select(JobEvent.job_id, func.count()).where(
            JobEvent.job_id.in_(ids), JobEvent.to_status.in_(["succeeded", "failed", "cancelled", "expired"]))
            .group_by(JobEvent.job_id)).all()
        requeues = s.execute(select(JobEvent.job_id).where(
            JobEvent.job_id.in_(ids), JobEvent.detail.like("lease of w1 expired%"))).scalars().all()
    assert all(j.status == "succeeded" for j in jobs.values()), {k: j.status for k, j in jobs.items()}
    assert dict(terminal) == {j: 1 for j in ids}  # one terminal transition per job
    assert all(j.output_text and j.completion_tokens == MAX_TOKENS for j in jobs.values())
    # the interrupted jobs were requeued when w1's lease ran out and finished on w2, attempt 2
    assert set(interrupted) <= set(requeues)
    for job_id in interrupted:
        assert jobs[job_id].worker_id == "w2" and jobs[job_id].attempt == 2
    for job_id in held:  # never leased by w1: its first run
        assert jobs[job_id].worker_id == "w2" and jobs[job_id].attempt == 1


def test_a_message_redelivered_after_its_job_was_resent_and_ran_runs_nothing_twice(settings, keys, start_worker):
    """A consumer SIGKILLed with a job's message in hand (before any lease) leaves it unacked in Redis, which restores
    it only after the visibility timeout (an hour). The sweeper sends the job again once its message is lost
    (``_resend_lost``) and a worker runs it; the old message, restored an hour later, is acked and dropped by the
    lease in SQL: the job is not run a second time."""
    import subprocess
    import sys
    from datetime import timedelta

    from sqlalchemy import update

    from app.services.transitions import utcnow
    from workers.celery_app import get_celery

    rds = redis.Redis.from_url(settings.redis_url)
    with session_scope(settings.sqlalchemy_url) as s:
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="r", max_tokens=4), settings).job.id
    take_and_die = ("import os, sys; from workers.celery_app import get_celery; "
                    "conn = get_celery(sys.argv[1]).connection(); "
                    "assert conn.default_channel.basic_get('coserve.tiny', no_ack=False) is not None; "
                    "os.kill(os.getpid(), 9)")
    consumer = subprocess.run([sys.executable, "-c", take_and_die, settings.redis_url], check=False)
    assert consumer.returncode == -signal.SIGKILL
    assert (rds.llen("coserve.tiny"), rds.hlen("unacked")) == (0, 1)  # in a dead consumer's hands
    with session_scope(settings.sqlalchemy_url) as s:  # the sweeper's resend age past (max(30, 5 x lease) s)
        s.execute(update(Job).where(Job.id == job_id).values(dispatched_at=utcnow() - timedelta(seconds=60)))
    start_worker("w1")

    def status() -> tuple[str, int]:
        with session_scope(settings.sqlalchemy_url) as s:
            job = s.get(Job, job_id, populate_existing=True)
            return job.status, job.attempt
    wait_for(lambda: status() == ("succeeded", 1), 60, "the job, sent again by the sweeper, to succeed")
    # an hour on: the old message is past the visibility timeout, and Redis hands it out again
    [tag] = rds.hkeys("unacked")
    rds.zadd("unacked_index", {tag: time.time() - 2 * 3600})
    with get_celery(settings.redis_url).connection() as conn:
        conn.default_channel.qos.restore_visible(num=10, interval=1)
    wait_for(lambda: rds.llen("coserve.tiny") == 0 and rds.hlen("unacked") == 0, 30,
             "w1 to take the restored message and ack it")
    assert status() == ("succeeded", 1)
    with session_scope(settings.sqlalchemy_url) as s:
        leased = s.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.job_id == job_id,
                                                                           JobEvent.detail == "leased"))
    assert leased == 1  # one lease: the restored message was dropped, not run
