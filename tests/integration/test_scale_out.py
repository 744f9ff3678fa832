"""Two worker processes share the model's queue through Redis and the same SQL DB, and prefix routing sends a
conversation's turns to one of them."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from sqlalchemy import select, update

from app.db.models import Job, WorkerState
from app.db.session import session_scope
from app.services import routing
from app.services.routing import WORKER_QUEUES, worker_queue
from app.services.transitions import utcnow
from tests.conftest import Keys, wait_for
from tests.integration.test_leases import _beat_ahead

pytestmark = pytest.mark.integration


def test_two_workers_both_take_work(client, keys, settings, start_worker):
    # each worker holds at most 2 jobs in its engine, so a burst must spread over both
    start_worker("wa", COSERVE_MAX_INFLIGHT="2")
    start_worker("wb", COSERVE_MAX_INFLIGHT="2")
    ids = [client.post("/v1/jobs", headers=Keys.header(keys.paid),
                       json={"prompt": f"Item {i}", "max_tokens": 40, "ignore_eos": True}).json()["id"]
           for i in range(8)]

    def done():
        with session_scope(settings.sqlalchemy_url) as s:
            rows = s.execute(select(Job.status, Job.worker_id).where(Job.id.in_(ids))).all()
        return rows if all(r.status == "succeeded" for r in rows) else None
    rows = wait_for(done, 120, "all jobs to succeed", interval=0.5)
    by_worker = {r.worker_id for r in rows}
    assert by_worker == {"wa", "wb"}


def _opening(tenant_id: str, worker: str, others: list[str], n: int) -> list[list[dict]]:
    """``n`` conversation openings whose prefix-routing key belongs to ``worker`` among ``others``."""
    from app.services.routing import Candidate, choose, route_key

    candidates = [Candidate(w, 0, 1024) for w in [worker, *others]]
    found = []
    for i in range(1000):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Topic {i}: tell me"}]
        if choose(route_key(tenant_id, "tiny", messages=messages), candidates, 16) == worker:
            found.append(messages)
            if len(found) == n:
                return found
    raise AssertionError("no opening found")


def _ran_on(settings, ids: list[str]) -> list[str]:
    def done():
        with session_scope(settings.sqlalchemy_url) as s:
            rows = s.execute(select(Job.id, Job.status, Job.worker_id).where(Job.id.in_(ids))).all()
        return rows if len(rows) == len(ids) and all(r.status == "succeeded" for r in rows) else None
    by_id = {r.id: r.worker_id for r in wait_for(done, 120, "the jobs to succeed", interval=0.3)}
    return [by_id[i] for i in ids]


def test_prefix_routing_keeps_a_conversation_on_its_worker_and_survives_a_dead_one(client, keys, settings,
                                                                                   start_worker, monkeypatch):
    # the worker whose prefix cache holds the conversation gets its next turn; conversations spread
    settings.lease_seconds = 300.0  # the API's and the workers': a dead worker is lost long before its leases lapse
    start_worker("wa")
    start_worker("wb")
    conversations = _opening(keys.tenant_id, "wa", ["wb"], 2) + _opening(keys.tenant_id, "wb", ["wa"], 2)
    ran: list[list[str]] = [[] for _ in conversations]
    for turn in range(3):
        ids = []
        for i, history in enumerate(conversations):
            r = client.post("/v1/jobs", headers=Keys.header(keys.paid),
                            json={"messages": history, "max_tokens": 6, "ignore_eos": True})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        for i, worker in enumerate(_ran_on(settings, ids)):
            ran[i].append(worker)
            conversations[i] = conversations[i] + [{"role": "assistant", "content": f"answer {turn}"},
                                                   {"role": "user", "content": f"and then {turn}?"}]
    assert ran == [["wa"] * 3, ["wa"] * 3, ["wb"] * 3, ["wb"] * 3]
    with session_scope(settings.sqlalchemy_url) as s:  # each heartbeat says what waits on its own queue
        assert all(isinstance(w.state.get("routed_waiting"), int) for w in s.scalars(select(WorkerState)))
    # a prompt_cache_key routes requests that share nothing else to one worker, as OpenAI's does
    ids = [client.post("/v1/jobs", headers=Keys.header(keys.paid), json={
        "prompt": f"Item {i}", "max_tokens": 4, "prompt_cache_key": "user-7"}).json()["id"] for i in range(4)]
    assert len(set(_ran_on(settings, ids))) == 1

    # a worker that beat a moment ago and then died: what was routed to it runs on another once it is stale
    r = redis.Redis.from_url(settings.redis_url)
    with session_scope(settings.sqlalchemy_url) as s:  # its beat a minute ahead: live however slow the box (lease 3 s)
        s.add(WorkerState(id="wz", model="tiny", queue="coserve.tiny", device="cpu", heartbeat_at=_beat_ahead(),
                          state={"served": ["tiny"], "in_line": 0, "max_inflight": 1024}))
    # registered, then its queue named, as a worker starting does (the other way round, a sweep in between took the
    # queue for a dead worker's and dropped it, and the job routed there waited 30 s to be sent again as lost)
    r.sadd(WORKER_QUEUES, worker_queue("wz"))
    monkeypatch.setattr(routing, "REFRESH_S", 0.0)  # the API reads the workers afresh, wz among them
    routed, later = _opening(keys.tenant_id, "wz", ["wa", "wb"], 2)
    job_id = client.post("/v1/jobs", headers=Keys.header(keys.paid),
                         json={"messages": routed, "max_tokens": 4}).json()["id"]
    wait_for(lambda: r.llen(worker_queue("wz")) == 1, 10,
             "the job on wz's own queue")  # routed to it (the API's writer sends it after its commit)
    # silent for more than three heartbeats (0.5 s), well within a lease: lost (its leases' rules are their own)
    with session_scope(settings.sqlalchemy_url) as s:
        s.execute(update(WorkerState).where(WorkerState.id == "wz")
                  .values(heartbeat_at=utcnow() - timedelta(seconds=10)))
    # no job is routed to it any more, and a sweeper gave what waited for it to the model's queue (both waited for
    # the lease, 30 s by default, and missed their TTFT)
    assert routing.job_queue(settings, "tiny", routing.route_key(keys.tenant_id, "tiny", messages=later)) != \
        worker_queue("wz")
    later_id = client.post("/v1/jobs", headers=Keys.header(keys.paid),
                           json={"messages": later, "max_tokens": 4}).json()["id"]
    assert set(_ran_on(settings, [job_id, later_id])) <= {"wa", "wb"}
    assert not r.exists(worker_queue("wz"))


def test_an_interactive_job_taken_by_a_full_worker_runs_on_a_worker_with_room(client, keys, settings, start_worker):
    """wa's one slot runs a long job when it takes an interactive job's message: the message goes back to the model's
    queue instead of waiting in wa's hands for that slot, and wb, started afterwards with room, runs the job."""
    start_worker("wa", COSERVE_MAX_INFLIGHT="1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build",
                 COSERVE_STEP_DELAY_S="0.5", COSERVE_STOP_GRACE_SECONDS="0")  # the long job outlasts the test
    h = Keys.header(keys.paid)
    long_id = client.post("/v1/jobs", headers=h, json={"prompt": "Long", "max_tokens": 400, "ignore_eos": True}).json()
    long_id = long_id["id"]

    def status(job_id: str) -> tuple[str, str | None]:
        with session_scope(settings.sqlalchemy_url) as s:
            row = s.get(Job, job_id, populate_existing=True)
            return row.status, row.worker_id
    wait_for(lambda: status(long_id) == ("running", "wa"), 60, "the long job to run on wa")
    job_id = client.post("/v1/jobs", headers=h, json={"prompt": "Hi", "max_tokens": 4}).json()["id"]
    # wa took the interactive message (kombu keeps a taken message unacked until the task returns)
    wait_for(lambda: redis.Redis.from_url(settings.redis_url).hlen("unacked") == 1, 30, "wa to take the message")
    start_worker("wb", COSERVE_MAX_INFLIGHT="1")
    wait_for(lambda: status(job_id)[0] == "succeeded", 90, "the interactive job to succeed")
    assert status(job_id) == ("succeeded", "wb")
    assert status(long_id)[0] == "running"  # wa's slot never opened: the job did not wait for it


def test_a_job_sent_longer_than_a_views_trust_after_it_goes_to_the_shared_queue_if_its_worker_stopped(
        settings, keys, start_worker, monkeypatch):
    """An API routed a job to w1 by a view read while w1 ran, and was slow before its send (a slow commit): w1 stopped
    meanwhile and passed its own queue on. The send re-reads a view older than ``routing.REFRESH_S`` and puts the job
    on the model's queue, instead of on w1's, where it waited for another worker's sweep or, with none, for a start.
    The views' clock is the test's: nothing waits on the wall clock."""
    import signal
    from types import SimpleNamespace

    from app.auth import authenticate
    from app.schemas import JobCreate
    from app.services import jobs
    from app.services.jobs import submit_job
    from tests.integration.test_worker_room import _next_taken

    now = [0.0]
    monkeypatch.setattr(routing, "time", SimpleNamespace(monotonic=lambda: now[0]))
    def submitted() -> str:
        with session_scope(settings.sqlalchemy_url) as s:
            return submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="r", max_tokens=4), settings).job.id

    w1 = start_worker("w1")
    assert _ran_on(settings, [submitted()]) == ["w1"]  # routed by the API's view, read while w1 runs
    w1.send_signal(signal.SIGTERM)
    assert w1.wait(60) == 0
    real_dispatch = jobs.dispatching.dispatch

    def slow_dispatch(*args, **kwargs):  # the job routed by that view, its commit slower than the view's trust
        now[0] += 2 * routing.REFRESH_S
        return real_dispatch(*args, **kwargs)

    monkeypatch.setattr(jobs.dispatching, "dispatch", slow_dispatch)
    job_id = submitted()
    assert _next_taken(settings, worker_queue("w1"), batch=False) == []
    assert _next_taken(settings, "coserve.tiny", batch=False) == [job_id]


def test_a_worker_restarted_with_queue_routing_runs_what_waits_on_its_own_queue(settings, keys, start_worker):
    """w1's previous life routed by prefix, and a job routed to it waits on its own queue; w1 starts again under its id
    with ``COSERVE_ROUTING=queue``, reading the model's queue only. It passes its own queue on at start, and runs the
    job, instead of leaving it where nobody reads it (its sweeper counted the message as waiting: never resent); an API
    that routes by prefix sends it nothing more there."""
    from app.auth import authenticate
    from app.schemas import JobCreate
    from app.services.dispatch import dispatch
    from app.services.jobs import submit_job

    with session_scope(settings.sqlalchemy_url) as s:
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="r", max_tokens=4), settings,
                            dispatch=False).job.id
        assert dispatch(s, settings.redis_url, job_id, settings.model_name, queue=worker_queue("w1"))
    start_worker("w1", COSERVE_ROUTING="queue")
    assert _ran_on(settings, [job_id]) == ["w1"]
    assert not redis.Redis.from_url(settings.redis_url).exists(worker_queue("w1"))
    # an API that routes by prefix sends it nothing more on the queue it does not read
    assert routing.job_queue(settings, "tiny", "k1") == "coserve.tiny"
