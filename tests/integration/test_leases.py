"""Leases, guarded transitions and the sweeper against a real migrated DB and a real Redis."""

from __future__ import annotations

import json
import time

import pytest
import redis
from sqlalchemy import select

from app.auth import Principal
from app.db.models import Job, JobEvent, JobStatus
from app.db.session import session_scope
from app.schemas import JobCreate
from app.services.dispatch import send_job
from app.services.jobs import submit_job
from tests.conftest import load_runtime_adapter
from workers import lease as leases
from workers.celery_app import queue_lists
from workers.sweeper import sweep

pytestmark = pytest.mark.integration


def _job(settings, keys, dispatch=False, **qos) -> str:
    with session_scope(settings.sqlalchemy_url) as s:
        from app.auth import authenticate

        principal: Principal = authenticate(s, keys.paid)
        return submit_job(s, principal, JobCreate(prompt="hi", max_tokens=4, **qos), settings,
                          dispatch=dispatch).job.id


def _terminal_events(url, job_id):
    with session_scope(url) as s:
        return s.scalars(select(JobEvent).where(JobEvent.job_id == job_id,
                                                JobEvent.to_status.in_(["succeeded", "failed"]))).all()


def test_stale_attempt_completion_is_ignored(settings, keys):
    url = settings.sqlalchemy_url
    job_id = _job(settings, keys)
    with session_scope(url) as s:
        first = leases.acquire(s, job_id, "w1", lease_s=0.2)
        assert first is not None and first.attempt == 1
        assert leases.acquire(s, job_id, "w2", lease_s=5) is None  # already leased
    time.sleep(0.3)
    with session_scope(url) as s:
        result = sweep(s, settings.redis_url, queued_grace_s=0)
    assert result.requeued == 1 and result.dispatched == 1
    with session_scope(url) as s:
        second = leases.acquire(s, job_id, "w2", lease_s=5)
        assert second is not None and second.attempt == 2
        # w1 wakes up and tries to complete its stale attempt: nothing changes
        assert not leases.finish(s, first, JobStatus.SUCCEEDED, {"output_text": "stale"})
        assert leases.renew(s, "w1", [first], 5) == set()
        assert leases.renew(s, "w2", [second], 5) == {job_id}
        assert leases.finish(s, second, JobStatus.SUCCEEDED, {"output_text": "fresh"})
        assert not leases.finish(s, second, JobStatus.SUCCEEDED, {"output_text": "again"})  # idempotent
        job = s.get(Job, job_id)
        assert job.output_text == "fresh" and job.worker_id == "w2" and job.attempt == 2
    assert len(_terminal_events(url, job_id)) == 1
    # the sweeper's re-send is in the queue, carrying only the id
    assert job_id.encode() in b"".join(redis.Redis.from_url(settings.redis_url).lrange("coserve.tiny", 0, -1))


def test_sweeper_resends_dispatched_jobs_never_leased(settings, keys):
    url = settings.sqlalchemy_url
    job_id = _job(settings, keys, dispatch=True)
    r = redis.Redis.from_url(settings.redis_url)
    assert r.llen("coserve.tiny") == 1
    r.delete("coserve.tiny")  # the message is lost (e.g. a worker died holding it)
    with session_scope(url) as s:
        assert sweep(s, settings.redis_url, resend_after_s=3600).resent == 0  # too early
    with session_scope(url) as s:
        assert sweep(s, settings.redis_url, resend_after_s=0).resent == 1
    assert r.llen("coserve.tiny") == 1
    with session_scope(url) as s:
        assert s.get(Job, job_id).status == "dispatched"


def test_sweeper_leaves_a_backlog_in_the_queue_alone(settings, keys):
    """Old dispatched jobs whose message still waits in the queue are a backlog, not lost."""
    job_ids = [_job(settings, keys, dispatch=True) for _ in range(3)]
    r = redis.Redis.from_url(settings.redis_url)
    assert r.llen("coserve.tiny") == 3
    for _ in range(2):
        with session_scope(settings.sqlalchemy_url) as s:
            assert sweep(s, settings.redis_url, resend_after_s=0).resent == 0
    assert r.llen("coserve.tiny") == 3  # no duplicates
    r.delete("coserve.tiny")
    with session_scope(settings.sqlalchemy_url) as s:
        assert sweep(s, settings.redis_url, resend_after_s=0).resent == 3
    assert sorted(m for raw in r.lrange("coserve.tiny", 0, -1) for m in job_ids if m.encode() in raw) == sorted(job_ids)


def test_an_adapters_job_given_back_to_the_models_queue_is_not_sent_twice(settings, keys):
    """A LoRA adapter's job travels on its own queue; a worker of an older coserve gave jobs back to its model's
    queue, which every worker of the model consumes too: the sweeper looks in the queues of every model it serves."""
    settings.lora_modules = {"sql-lora": "/adapters/sql"}
    with session_scope(settings.sqlalchemy_url) as s:
        from app.auth import authenticate

        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="hi", max_tokens=4, model="sql-lora"),
                            settings, dispatch=True).job.id
    r = redis.Redis.from_url(settings.redis_url)
    assert job_id.encode() in r.lpop("coserve.sql-lora")
    r.rpush("coserve.tiny", job_id.encode())  # given back (the message carries the id, as a worker's does)
    with session_scope(settings.sqlalchemy_url) as s:
        assert sweep(s, settings.redis_url, resend_after_s=0, served=settings.served_models).resent == 0
    with session_scope(settings.sqlalchemy_url) as s:  # a sweeper that looked only in the job's own queue
        assert sweep(s, settings.redis_url, resend_after_s=0).resent == 1


def test_sweeper_resends_a_job_held_by_a_dead_worker(settings, keys):
    """A worker that waits for engine room marks the dispatched row; when its heartbeat goes stale
    the job is sent again at once (no waiting for Redis's visibility timeout)."""
    from datetime import timedelta

    from sqlalchemy import update

    from app.db.models import WorkerState
    from app.services.transitions import utcnow

    url = settings.sqlalchemy_url
    job_id = _job(settings, keys, dispatch=True)
    r = redis.Redis.from_url(settings.redis_url)
    r.delete("coserve.tiny")  # the worker took the message (unacked in its hands)
    with session_scope(url) as s:
        s.add(WorkerState(id="w1", model="tiny", queue="coserve.tiny", device="cpu"))
        s.execute(update(Job).where(Job.id == job_id).values(worker_id="w1"))
    with session_scope(url) as s:  # holder alive, message recent: nothing to do
        assert sweep(s, settings.redis_url, resend_after_s=3600, holder_stale_s=30).resent == 0
    with session_scope(url) as s:  # the holder stopped beating
        s.execute(update(WorkerState).where(WorkerState.id == "w1")
                  .values(heartbeat_at=utcnow() - timedelta(seconds=60)))
    with session_scope(url) as s:
        assert sweep(s, settings.redis_url, resend_after_s=3600, holder_stale_s=30).resent == 1
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job.status == "dispatched" and job.worker_id is None
        assert sweep(s, settings.redis_url, resend_after_s=3600, holder_stale_s=30).resent == 0  # once
    assert r.llen("coserve.tiny") == 1


def test_a_worker_restarted_under_its_id_drops_the_marks_its_predecessor_left(settings, keys):
    """The holder's id beats again, so the sweeper's stale-holder check never fires; a worker starting under it
    unmarks the jobs, and the sweeper then sends their lost message again."""
    from sqlalchemy import update

    from app.db.models import WorkerState

    url = settings.sqlalchemy_url
    job_id = _job(settings, keys, dispatch=True)
    r = redis.Redis.from_url(settings.redis_url)
    r.delete("coserve.tiny")  # the dead worker took the message (unacked in its hands)
    with session_scope(url) as s:
        s.add(WorkerState(id="w1", model="tiny", queue="coserve.tiny", device="cpu"))
        s.execute(update(Job).where(Job.id == job_id).values(worker_id="w1"))
    with session_scope(url) as s:  # w1 beats (it restarted): its mark keeps the job from being sent again
        assert sweep(s, settings.redis_url, resend_after_s=0, holder_stale_s=30).resent == 0
    with session_scope(url) as s:
        assert leases.drop_held_marks(s, "w2") == 0 and leases.drop_held_marks(s, "w1") == 1
    with session_scope(url) as s:
        assert sweep(s, settings.redis_url, resend_after_s=0, holder_stale_s=30).resent == 1
    assert r.llen("coserve.tiny") == 1


def test_guarded_transition_refuses_a_terminal_job(settings, keys):
    from app.services.transitions import NOT_TERMINAL, transition

    job_id = _job(settings, keys)
    with session_scope(settings.sqlalchemy_url) as s:
        assert transition(s, job_id, NOT_TERMINAL, JobStatus.CANCELLED)
        assert not transition(s, job_id, NOT_TERMINAL, JobStatus.CANCELLED)
        assert leases.acquire(s, job_id, "w1", 5) is None  # a cancelled job is never leased


def test_a_job_cancelled_while_held_settles_when_its_worker_dies_before_writing_it(settings, keys):
    """The API cancels a running job; its worker writes what it produced later and settles the end then. A worker
    alive keeps the job's lease (renews it) until that write; one that died lets it expire, and the sweeper settles
    the end as it stands, once (a late write of the dead attempt is refused)."""
    from datetime import timedelta

    from sqlalchemy import update

    from app.services.jobs import cancel_job
    from app.services.transitions import as_utc, utcnow

    url = settings.sqlalchemy_url
    job_id = _job(settings, keys)
    with session_scope(url) as s:
        lease = leases.acquire(s, job_id, "w1", lease_s=30)
        assert cancel_job(s, s.get(Job, job_id)) == JobStatus.RUNNING
        job = s.get(Job, job_id)
        assert job.settled_at is None and job.lease_expires_at is not None  # held: w1 writes it
        before = as_utc(job.lease_expires_at)
    with session_scope(url) as s:  # w1 beats: it keeps the lease, and is told the job is not its to run
        assert leases.renew(s, "w1", [lease], 60) == set()
        assert as_utc(s.get(Job, job_id).lease_expires_at) > before
        assert sweep(s, settings.redis_url, queued_grace_s=0).settled == 0
        assert s.get(Job, job_id).settled_at is None
    with session_scope(url) as s:  # w1 died: nothing renews the lease
        s.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    with session_scope(url) as s:
        assert sweep(s, settings.redis_url, queued_grace_s=0).settled == 1
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert (job.status, job.lease_expires_at) == ("cancelled", None) and job.settled_at is not None
        assert sweep(s, settings.redis_url, queued_grace_s=0).settled == 0  # once
        assert not leases.keep_cancelled(s, lease, {"completion_tokens": 3})  # settled: a late write is refused
        assert s.get(Job, job_id).completion_tokens is None


def test_a_live_worker_keeps_a_stopped_job_unsettled_for_one_lease_at_most(settings, keys):
    """A worker whose engine never finishes the abort of a cancelled job beats on: it renews the job's lease for one
    lease after the cancel, then lets it expire, and the sweeper settles the end as it stands."""
    from datetime import timedelta

    from sqlalchemy import update

    from app.services.jobs import cancel_job
    from app.services.transitions import as_utc, utcnow

    url = settings.sqlalchemy_url
    job_id = _job(settings, keys)
    with session_scope(url) as s:
        lease = leases.acquire(s, job_id, "w1", lease_s=30)
        assert cancel_job(s, s.get(Job, job_id)) == JobStatus.RUNNING
    with session_scope(url) as s:  # the cancel was a lease (30 s) and more ago; the abort still has not come back
        s.execute(update(Job).where(Job.id == job_id).values(finished_at=utcnow() - timedelta(seconds=31)))
        before = as_utc(s.get(Job, job_id).lease_expires_at)
    with session_scope(url) as s:
        assert leases.renew(s, "w1", [lease], 30) == set()
        assert as_utc(s.get(Job, job_id).lease_expires_at) == before  # not renewed: it lapses
    with session_scope(url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    with session_scope(url) as s:
        assert sweep(s, settings.redis_url, queued_grace_s=0).settled == 1
    with session_scope(url) as s:
        assert s.get(Job, job_id).settled_at is not None


def test_a_job_cancelled_while_held_is_settled_by_its_workers_write(settings, keys):
    """The usual end: the worker writes what it produced, which settles the end and ends its lease."""
    from app.services.jobs import cancel_job

    url = settings.sqlalchemy_url
    job_id = _job(settings, keys)
    with session_scope(url) as s:
        lease = leases.acquire(s, job_id, "w1", lease_s=30)
        assert cancel_job(s, s.get(Job, job_id)) == JobStatus.RUNNING
        assert leases.keep_cancelled(s, lease, {"completion_tokens": 3})
        job = s.get(Job, job_id)
        assert (job.completion_tokens, job.lease_expires_at) == (3, None) and job.settled_at is not None


def test_a_job_whose_workers_keep_dying_fails_after_max_attempts(settings, keys):
    url = settings.sqlalchemy_url
    job_id = _job(settings, keys)
    for attempt in (1, 2):
        with session_scope(url) as s:
            lease = leases.acquire(s, job_id, f"w{attempt}", lease_s=0.1)
            assert lease is not None and lease.attempt == attempt
        time.sleep(0.2)  # the worker died: its lease runs out
        with session_scope(url) as s:
            result = sweep(s, settings.redis_url, queued_grace_s=0, max_attempts=2)
        assert (result.requeued, result.failed) == ((1, 0) if attempt == 1 else (0, 1))
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job.status == "failed" and "gave up after 2 attempts" in job.error and job.worker_id is None
    assert len(_terminal_events(url, job_id)) == 1
    # stream readers (SSE) get the end too, so they do not wait forever
    from app.services.streaming import StreamEvent, stream_key

    entries = redis.Redis.from_url(settings.redis_url).xrange(stream_key(job_id))
    end = StreamEvent.parse(entries[-1][1])
    assert end.type == "end" and end.status == "failed" and "gave up" in end.data["error"]


def _beat_ahead():
    """A fake worker's heartbeat a minute ahead: routing counts it alive however slowly a loaded box runs the test
    (a heartbeat of now lapsed after the 3 s lease once, and the jobs went to the model's queue, not its own)."""
    from datetime import timedelta

    from app.services.transitions import utcnow

    return utcnow() + timedelta(seconds=60)


def test_jobs_routed_to_a_worker_that_died_go_back_to_the_models_queue(settings, keys):
    """Prefix routing puts a conversation's jobs on one worker's own queue; when that worker stops beating, the
    sweeper sends what waits there to the model's queue and removes the dead queue (and kombu's binding of it), a
    batch job's message from the queue's batch list to the model queue's."""
    from datetime import timedelta

    from sqlalchemy import update

    from app.db.models import WorkerState
    from app.services.routing import WORKER_QUEUES, worker_queue
    from app.services.transitions import utcnow

    url, r = settings.sqlalchemy_url, redis.Redis.from_url(settings.redis_url)
    r.sadd(WORKER_QUEUES, worker_queue("w9"))  # as the worker does when it starts
    with session_scope(url) as s:
        s.add(WorkerState(id="w9", model="tiny", queue="coserve.tiny", device="cpu", heartbeat_at=_beat_ahead(),
                          state={"served": ["tiny"], "in_line": 0, "max_inflight": 8}))
    # the same prompt: one key, one worker
    job_ids = [_job(settings, keys, dispatch=True), _job(settings, keys, dispatch=True, kind="batch",
                                                          deadline_window_s=3600)]
    own, model = queue_lists(worker_queue("w9")), queue_lists("coserve.tiny")
    assert [r.llen(key) for key in (*own, *model)] == [1, 1, 0, 0]
    r.sadd(f"_kombu.binding.{worker_queue('w9')}", "binding")  # as kombu declares a queue's binding
    with session_scope(url) as s:  # its worker is alive: its jobs wait for it, not lost
        result = sweep(s, settings.redis_url, resend_after_s=0, holder_stale_s=30)
        assert (result.rerouted, result.resent) == (0, 0)
    with session_scope(url) as s:
        s.execute(update(WorkerState).where(WorkerState.id == "w9")
                  .values(heartbeat_at=utcnow() - timedelta(seconds=60)))
    with session_scope(url) as s:
        result = sweep(s, settings.redis_url, resend_after_s=0, holder_stale_s=30)
        assert (result.rerouted, result.resent) == (2, 0)
    assert not r.exists(*own, f"_kombu.binding.{worker_queue('w9')}")
    assert not r.sismember(WORKER_QUEUES, worker_queue("w9"))  # no one's to look after any more
    assert [job_ids[i].encode() in b"".join(r.lrange(key, 0, -1)) for i, key in enumerate(model)] == [True, True]
    assert [r.llen(key) for key in model] == [1, 1]
    with session_scope(url) as s:
        assert sweep(s, settings.redis_url, resend_after_s=0, holder_stale_s=30).rerouted == 0  # once
        assert {s.get(Job, j).status for j in job_ids} == {"dispatched"}


def test_a_job_routed_to_a_queue_the_sweeper_just_dropped_is_rerouted_by_the_next_sweep(settings, keys):
    """A process routes by a view of the workers up to a second old, so it may send a job to the own queue of a
    worker that a sweeper has just found dead and dropped. The send names the queue to the sweepers again, and the
    next sweep gives the job to the model's queue at once, not after ``resend_after_s`` as a lost message."""
    from datetime import timedelta

    from app.db.models import WorkerState
    from app.services.dispatch import dispatch
    from app.services.routing import WORKER_QUEUES, worker_queue
    from app.services.transitions import utcnow

    url, r, queue = settings.sqlalchemy_url, redis.Redis.from_url(settings.redis_url), worker_queue("w8")
    r.sadd(WORKER_QUEUES, queue)
    with session_scope(url) as s:
        s.add(WorkerState(id="w8", model="tiny", queue="coserve.tiny", device="cpu",
                          heartbeat_at=utcnow() - timedelta(seconds=60), state={"served": ["tiny"]}))
    with session_scope(url) as s:
        assert sweep(s, settings.redis_url, resend_after_s=3600, holder_stale_s=30).rerouted == 0  # nothing waits
    assert not r.sismember(WORKER_QUEUES, queue) and not r.exists(queue)  # dropped
    job_id = _job(settings, keys)  # the API, by its older view, still routes to w8
    with session_scope(url) as s:
        assert dispatch(s, settings.redis_url, job_id, "tiny", queue=queue)
    assert r.llen(queue) == 1 and r.sismember(WORKER_QUEUES, queue)
    with session_scope(url) as s:
        result = sweep(s, settings.redis_url, resend_after_s=3600, holder_stale_s=30)
        assert (result.rerouted, result.resent) == (1, 0)
    assert job_id.encode() in b"".join(r.lrange("coserve.tiny", 0, -1))
    assert not r.exists(queue) and not r.sismember(WORKER_QUEUES, queue)
    assert not r.keys(f"{queue}*")  # nothing of the dropped queue is left behind


def test_a_job_of_an_unloaded_runtime_adapter_goes_back_to_its_models_queue(settings, keys, tmp_path):
    """A runtime LoRA adapter's job whose lease expired after an admin unloaded the adapter: the sweeper sends it to
    the model's queue, whose worker fails it saying the adapter was unloaded (no worker reads a queue of the
    adapter's name); so does a request that named the adapter a moment before the unload."""
    from app.auth import authenticate
    from app.services import lora_adapters, routing

    adapter = load_runtime_adapter(settings, tmp_path)
    url = settings.sqlalchemy_url
    with session_scope(url) as s:
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="hi", max_tokens=4, model="rt-lora"),
                            settings, dispatch=False).job.id
    with session_scope(url) as s:
        assert leases.acquire(s, job_id, "w1", lease_s=0.2) is not None
    lora_adapters.unload(settings, "rt-lora")
    time.sleep(0.3)
    with session_scope(url) as s:
        result = sweep(s, settings.redis_url, queued_grace_s=0)
    assert result.requeued == 1 and result.dispatched == 1
    r = redis.Redis.from_url(settings.redis_url)
    assert job_id.encode() in b"".join(r.lrange("coserve.tiny", 0, -1)) and not r.exists("coserve.rt-lora")
    assert routing.job_queue(settings, "rt-lora", None) == "coserve.tiny"
    lora_adapters.load(settings, "rt-lora", str(adapter))  # loaded again, then unloaded again
    lora_adapters.unload(settings, "rt-lora")
    assert routing.job_queue(settings, "rt-lora", None) == "coserve.tiny"


def _next_taken(r, queue: str) -> list[str]:
    """The job ids on ``queue``'s interactive list, in the order consumers take them (kombu: BRPOP, right first)."""
    return [json.loads(m)["headers"]["argsrepr"].strip("[]'") for m in reversed(r.lrange(queue, 0, -1))]


def test_a_resent_job_goes_back_to_the_head_of_its_list_oldest_first(settings, keys):
    """A holder took two messages from the head and died: their jobs go back ahead of a message sent since."""
    from datetime import timedelta

    from sqlalchemy import update

    from app.db.models import WorkerState
    from app.services.transitions import utcnow

    url, r = settings.sqlalchemy_url, redis.Redis.from_url(settings.redis_url)
    older, newer = _job(settings, keys, dispatch=True), _job(settings, keys, dispatch=True)
    r.delete("coserve.tiny")  # the worker took both messages
    send_job(settings.redis_url, "later", "tiny")
    with session_scope(url) as s:
        s.add(WorkerState(id="w1", model="tiny", queue="coserve.tiny", device="cpu",
                          heartbeat_at=utcnow() - timedelta(seconds=60)))
        s.execute(update(Job).where(Job.id.in_([older, newer])).values(worker_id="w1"))
    with session_scope(url) as s:
        assert sweep(s, settings.redis_url, resend_after_s=3600, holder_stale_s=30).resent == 2
    assert _next_taken(r, "coserve.tiny") == [older, newer, "later"]


def test_jobs_rerouted_from_a_dead_workers_queue_keep_their_place_before_later_ones(settings, keys):
    """What waited on a dead worker's own queue had waited since before a message sent to the model's queue after
    it: rerouted, it goes to the head, in the order it arrived."""
    from app.db.models import WorkerState
    from app.services.routing import WORKER_QUEUES, worker_queue
    from workers.sweeper import reroute

    url, r = settings.sqlalchemy_url, redis.Redis.from_url(settings.redis_url)
    r.sadd(WORKER_QUEUES, worker_queue("w9"))
    with session_scope(url) as s:
        s.add(WorkerState(id="w9", model="tiny", queue="coserve.tiny", device="cpu", heartbeat_at=_beat_ahead(),
                          state={"served": ["tiny"], "in_line": 0, "max_inflight": 8}))
    older, newer = _job(settings, keys, dispatch=True), _job(settings, keys, dispatch=True)  # one prompt: w9's
    assert r.llen(worker_queue("w9")) == 2
    send_job(settings.redis_url, "later", "tiny")
    with session_scope(url) as s:
        assert reroute(s, settings.redis_url, [worker_queue("w9")]) == 2
    assert _next_taken(r, "coserve.tiny") == [older, newer, "later"]


def test_the_sweeper_sends_a_job_whose_lease_expired_to_the_head_and_one_never_sent_to_the_tail(settings, keys):
    """A job that ran (its worker died) came before every message waiting; one the broker refused at submission is
    sent in its turn, behind them (a bulk of them goes out over several sweeps, each in order)."""
    from datetime import timedelta

    from sqlalchemy import update

    from app.services.transitions import utcnow

    url, r = settings.sqlalchemy_url, redis.Redis.from_url(settings.redis_url)
    ran, unsent = _job(settings, keys), _job(settings, keys)
    with session_scope(url) as s:
        assert leases.acquire(s, ran, "w1", lease_s=30) is not None
        s.execute(update(Job).where(Job.id == ran).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    send_job(settings.redis_url, "later", "tiny")
    with session_scope(url) as s:
        result = sweep(s, settings.redis_url, queued_grace_s=0)
    assert (result.requeued, result.dispatched) == (1, 2)
    assert _next_taken(r, "coserve.tiny") == [ran, "later", unsent]


def test_a_job_given_back_goes_to_the_head_however_many_messages_landed_before_the_move(settings, keys,
                                                                                         monkeypatch):
    """``send_back`` sends the message (kombu pushes it at the tail) and then moves it to the head: where other
    senders pushed many messages in between (a burst of submissions), it still ends up the next taken."""
    from app.services import dispatch

    r, sent = redis.Redis.from_url(settings.redis_url), dispatch.send_to
    send_job(settings.redis_url, "waiting", "tiny")
    burst = [f"burst{i}" for i in range(100)]

    def send_then_a_burst(redis_url, job_id, queue, priority, task_id=None):  # others send between the two steps
        ok = sent(redis_url, job_id, queue, priority, task_id=task_id)
        for other in burst:
            sent(redis_url, other, queue, priority)
        return ok

    monkeypatch.setattr(dispatch, "send_to", send_then_a_burst)
    assert dispatch.send_back(settings.redis_url, "given-back", "coserve.tiny")
    assert _next_taken(r, "coserve.tiny") == ["given-back", "waiting", *burst]


def test_batch_jobs_rerouted_from_a_dead_workers_queue_go_in_their_turn_by_age(settings, keys):
    """A batch job waiting on a dead worker's own queue goes to the model's batch list behind the batch jobs
    submitted before it and ahead of those submitted after it, not ahead of them all."""
    from app.db.models import WorkerState
    from app.services.routing import WORKER_QUEUES, worker_queue
    from workers.celery_app import BATCH_PRIORITY
    from workers.sweeper import reroute

    url, r = settings.sqlalchemy_url, redis.Redis.from_url(settings.redis_url)
    batch_list = queue_lists("coserve.tiny")[1]
    r.sadd(WORKER_QUEUES, worker_queue("w9"))
    with session_scope(url) as s:
        s.add(WorkerState(id="w9", model="tiny", queue="coserve.tiny", device="cpu", heartbeat_at=_beat_ahead(),
                          state={"served": ["tiny"], "in_line": 0, "max_inflight": 8}))

    def batch_job(on_model_queue: bool) -> str:
        job_id = _job(settings, keys, dispatch=not on_model_queue, kind="batch", deadline_window_s=3600)
        if on_model_queue:
            send_job(settings.redis_url, job_id, "tiny", BATCH_PRIORITY)
        return job_id

    older = batch_job(True)
    rerouted = [batch_job(False), batch_job(False)]  # prefix routing put these on w9's own queue
    newer = batch_job(True)
    assert r.llen(queue_lists(worker_queue("w9"))[1]) == 2
    with session_scope(url) as s:
        assert reroute(s, settings.redis_url, [worker_queue("w9")]) == 2
    assert _next_taken(r, batch_list) == [older, *rerouted, newer]
    last = batch_job(False)  # none waits that came after it: the tail
    with session_scope(url) as s:
        assert reroute(s, settings.redis_url, [worker_queue("w9")]) == 1
    assert _next_taken(r, batch_list) == [older, *rerouted, newer, last]


_TAKE_AND_DIE = """
import os, signal, sys
from workers.celery_app import get_celery
conn = get_celery(sys.argv[1]).connection_for_read()
message = conn.default_channel.basic_get(sys.argv[2], no_ack=False)  # taken, unacked: kombu's unacked hash holds it
assert message is not None
os.kill(os.getpid(), signal.SIGKILL)  # before its job is leased, as a worker killed in accept
"""


def test_a_message_a_killed_worker_took_off_its_own_queue_is_sent_again_once_it_is_lost(settings, keys):
    """A worker's consumer took a job's message off its own queue (prefix routing's) and was SIGKILLed before it
    leased the job: the message is in kombu's unacked hash, where only its visibility timeout (an hour) restores it,
    and the job is dispatched with no worker. The sweep that finds the worker lost sends the job to the head of its
    model's queue and drops the unacked copy (it waited for the lost-message rule, ``max(30, 5 x lease)`` s)."""
    import subprocess
    import sys

    from app.db.models import WorkerState
    from app.services.routing import WORKER_QUEUES, worker_queue

    url, r = settings.sqlalchemy_url, redis.Redis.from_url(settings.redis_url)
    r.sadd(WORKER_QUEUES, worker_queue("w9"))
    with session_scope(url) as s:
        s.add(WorkerState(id="w9", model="tiny", queue="coserve.tiny", device="cpu", heartbeat_at=_beat_ahead(),
                          state={"served": ["tiny"], "in_line": 0, "max_inflight": 8}))
    job_id = _job(settings, keys, dispatch=True)
    assert r.llen(worker_queue("w9")) == 1
    subprocess.run([sys.executable, "-c", _TAKE_AND_DIE, settings.redis_url, worker_queue("w9")], check=False)
    assert (r.llen(worker_queue("w9")), r.hlen("unacked")) == (0, 1)
    _sent_again_once_lost(settings, "w9", job_id)


_CONSUME_AND_DIE = """
import os, signal, sys
import redis
from workers.celery_app import consumer, get_celery
from workers.taken import record_deliveries

class Killed:  # a GPU worker SIGKILLed in accept, before it leased the job (the message taken, unacked)
    def accept(self, job_id, priority, queue):
        os.kill(os.getpid(), signal.SIGKILL)

app = get_celery(sys.argv[1])
app.coserve_worker = Killed()
record_deliveries(redis.Redis.from_url(sys.argv[1]), "w8")  # as run_worker connects it
consumer(app, [sys.argv[2]], "w8@test").start()
"""


def test_a_message_a_killed_worker_took_off_its_models_queue_is_sent_again_once_it_is_lost(settings, keys):
    """A worker's Celery consumer took a job's message off its model's shared queue (most jobs go there) and the
    worker was SIGKILLed before it leased the job: the message sits in kombu's unacked hash under the queue's name,
    naming no worker. The worker recorded the message in hand as Celery handed it over, so the sweep that finds the
    worker lost takes it back and sends its job to the head of the model's queue, as for a message off its own queue
    (it waited for the lost-message rule, ``max(30, 5 x lease)`` s)."""
    import subprocess
    import sys

    from app.db.models import WorkerState

    url, r = settings.sqlalchemy_url, redis.Redis.from_url(settings.redis_url)
    job_id = _job(settings, keys, dispatch=True)
    assert r.llen("coserve.tiny") == 1  # the model's queue (no worker to route it to)
    with session_scope(url) as s:
        s.add(WorkerState(id="w8", model="tiny", queue="coserve.tiny", device="cpu", heartbeat_at=_beat_ahead(),
                          state={"served": ["tiny"], "in_line": 0, "max_inflight": 8}))
    died = subprocess.run([sys.executable, "-c", _CONSUME_AND_DIE, settings.redis_url, "coserve.tiny"],
                          check=False, timeout=120)
    assert died.returncode == -9  # killed in its task, the message in hand
    assert (r.llen("coserve.tiny"), r.hlen("unacked")) == (0, 1)
    with session_scope(url) as s:
        result = sweep(s, settings.redis_url, resend_after_s=3600, holder_stale_s=30, silent_s=30)
    assert result.rerouted == 0  # live: its message is its own
    _sent_again_once_lost(settings, "w8", job_id)
    assert r.llen("coserve.tiny") == 1


def _sent_again_once_lost(settings, worker_id: str, job_id: str) -> None:
    """``worker_id``'s heartbeat a minute old: the sweep that finds it lost takes back the message it held (kombu's
    unacked entry and its index gone) and sends its job, still dispatched, to the head of the model's queue, once."""
    from datetime import timedelta

    from sqlalchemy import update

    from app.db.models import WorkerState
    from app.services.transitions import utcnow

    url, r = settings.sqlalchemy_url, redis.Redis.from_url(settings.redis_url)
    with session_scope(url) as s:
        s.execute(update(WorkerState).where(WorkerState.id == worker_id)
                  .values(heartbeat_at=utcnow() - timedelta(seconds=60)))
    with session_scope(url) as s:
        result = sweep(s, settings.redis_url, resend_after_s=3600, holder_stale_s=30, silent_s=30)
    assert (result.rerouted, r.hlen("unacked"), r.zcard("unacked_index")) == (1, 0, 0)
    assert job_id.encode() in r.lindex("coserve.tiny", -1)  # the next taken
    with session_scope(url) as s:
        assert s.get(Job, job_id).status == "dispatched"
        assert sweep(s, settings.redis_url, resend_after_s=3600, holder_stale_s=30, silent_s=30).rerouted == 0


def _taken_by_a_killed_consumer(settings, keys, script: str = _CONSUME_AND_DIE) -> str:
    """A job dispatched to the model's queue, whose message the Celery consumer of worker ``w8`` (``script``, its
    delivery recorded as ``run_worker`` records it) took and never acked: SIGKILLed in its task. The job's id."""
    import subprocess
    import sys

    r = redis.Redis.from_url(settings.redis_url)
    job_id = _job(settings, keys, dispatch=True)
    died = subprocess.run([sys.executable, "-c", script, settings.redis_url, "coserve.tiny"], check=False,
                          timeout=120)
    assert died.returncode == -9  # killed in its task, the message in hand
    assert r.hlen("unacked") == 1
    return job_id


def test_a_message_an_earlier_life_took_and_never_acked_is_sent_again_as_the_worker_starts(settings, keys):
    """Worker ``w8`` was killed with a job's message in hand (taken off the model's queue, unacked) and restarted
    under its id before a sweep found it lost (its new beat makes it live, so no sweep would): as it starts it takes
    that message back and sends the job, still dispatched, to the head of the model's queue (``_take_back_earlier``;
    else it waited for the lost-message rule, ``max(30, 5 x lease)`` s, or kombu's visibility timeout, an hour)."""
    from workers.gpu_worker import GpuWorker
    from workers.taken import TAKEN

    r = redis.Redis.from_url(settings.redis_url)
    job_id = _taken_by_a_killed_consumer(settings, keys)
    assert (r.llen("coserve.tiny"), r.hexists(TAKEN, "w8")) == (0, True)
    settings.worker_id = "w8"
    GpuWorker(settings)._take_back_earlier()
    assert (r.hlen("unacked"), r.zcard("unacked_index"), r.hexists(TAKEN, "w8")) == (0, 0, False)
    assert r.llen("coserve.tiny") == 1 and job_id.encode() in r.lindex("coserve.tiny", -1)  # the next taken
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, job_id).status == "dispatched"


_HAND_BACK_AND_DIE = """
import os, signal, sys
from types import SimpleNamespace
import redis
from workers.celery_app import consumer, get_celery
from workers.gpu_worker import GpuWorker
from workers.taken import record_deliveries

class HandsBackThenKilled:  # a full GPU worker hands the message back, and is SIGKILLed waiting for room
    settings = SimpleNamespace(redis_url=sys.argv[1])
    redis = redis.Redis.from_url(sys.argv[1])
    worker_id = "w8"
    handing_back = None

    def accept(self, job_id, priority, queue):
        GpuWorker._hand_back(self, job_id, queue, priority)
        os.kill(os.getpid(), signal.SIGKILL)

app = get_celery(sys.argv[1])
app.coserve_worker = HandsBackThenKilled()
record_deliveries(HandsBackThenKilled.redis, "w8")  # as run_worker connects it
consumer(app, [sys.argv[2]], "w8@test").start()
"""


def test_a_message_a_worker_handed_back_before_it_was_killed_is_not_sent_a_second_time(settings, keys):
    """A full worker hands the message in hand back to the head of its queue and waits for room, the message taken
    still unacked (late acks), when it is SIGKILLed: the job waits on its queue once. The hand-back forgot the
    worker's message in hand (``taken.forget``), so the sweep that finds the worker lost does not send the job again
    from that unacked copy (a second message: a take of the model's workers spent on nothing)."""
    from datetime import timedelta

    from app.db.models import WorkerState
    from app.services.transitions import utcnow
    from workers.taken import TAKEN

    url, r = settings.sqlalchemy_url, redis.Redis.from_url(settings.redis_url)
    with session_scope(url) as s:  # lost: its beat a minute old
        s.add(WorkerState(id="w8", model="tiny", queue="coserve.tiny", device="cpu",
                          heartbeat_at=utcnow() - timedelta(seconds=60), state={"served": ["tiny"]}))
    job_id = _taken_by_a_killed_consumer(settings, keys, _HAND_BACK_AND_DIE)
    assert r.llen("coserve.tiny") == 1 and job_id.encode() in r.lindex("coserve.tiny", -1)  # handed back
    assert not r.hexists(TAKEN, "w8")
    with session_scope(url) as s:
        result = sweep(s, settings.redis_url, resend_after_s=3600, holder_stale_s=30, silent_s=30)
    assert result.rerouted == 0 and r.llen("coserve.tiny") == 1  # the job waits on its queue once
