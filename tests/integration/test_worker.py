"""A real GPU-worker process (Celery consumer + engine on a tiny random Llama) behind the API."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from sqlalchemy import func, select, update

from app.db.models import Job, JobEvent, WorkerState
from app.db.session import session_scope
from app.services.streaming import StreamEvent, follow_job, stream_key
from tests.conftest import Keys, api_and_worker, wait_for

pytestmark = pytest.mark.integration


@dataclass
class Service:
    settings: Any
    keys: Keys
    client: Any


@pytest.fixture(scope="module")
def service(tmp_path_factory, redis_server, long_tiny_model_dir):
    """One API + one worker ("w1") shared by this module's tests (a worker start costs ~10 s), on the tiny
    Llama with a long context, so that a job of thousands of tokens runs long enough to cancel."""
    with api_and_worker(tmp_path_factory.mktemp("worker-service"), redis_server, long_tiny_model_dir) as service:
        yield Service(*service)


H = Keys.header
LONG = 4000  # tokens: seconds of work for the tiny model, where 480 took under a second and raced a cancel


def submit(client, key, **body):
    body.setdefault("prompt", "Tell me about the sea.")
    body.setdefault("ignore_eos", True)
    r = client.post("/v1/jobs", json=body, headers=H(key))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def status_of(client, key, job_id):
    return client.get(f"/v1/jobs/{job_id}", headers=H(key)).json()


def wait_status(client, key, job_id, statuses, timeout=60):
    return wait_for(lambda: (j := status_of(client, key, job_id))["status"] in statuses and j, timeout,
                    f"{job_id} to reach {statuses}")


def events_of(url, job_id):
    with session_scope(url) as s:
        return [(e.from_status, e.to_status) for e in s.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id))]


RELEGATION = {("running", "relegated"), ("relegated", "running")}  # the engine shed the job a while, then resumed it


def leases_of(url, job_id) -> int:
    """How many times a worker leased the job (its ``leased`` events): on a loaded machine the engine may relegate
    and resume it, so its transitions to running can outnumber its leases."""
    with session_scope(url) as s:
        return s.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.job_id == job_id,
                                                                        JobEvent.detail == "leased"))


def assert_ran_once(url, job_id, events):
    """``events`` (``events_of``) end with one lease after a dispatch, then the engine's run to success: relegated and
    resumed meanwhile, maybe."""
    lease = events.index(("dispatched", "running"))
    assert events[lease - 1] == ("queued", "dispatched"), events
    assert set(events[lease + 1:-1]) <= RELEGATION and events[-1][1] == "succeeded", events
    assert leases_of(url, job_id) == 1, events


def test_the_worker_answers_celery_control_under_its_node_name(service):
    """The worker's Celery node is ``<worker id>@<host>``, as `celery worker -n w1@%h` names it (it was ``w1@%h``)."""
    from workers.celery_app import get_celery

    replies = get_celery(service.settings.redis_url).control.ping(timeout=5)
    assert [name for reply in replies for name in reply] == [f"w1@{socket.gethostname()}"]


def test_jobs_run_stream_and_report_metrics(service):
    client, keys, settings = service.client, service.keys, service.settings
    assert client.get("/readyz").status_code == 200 and client.get("/health").status_code == 200
    ids = [submit(client, keys.paid, max_tokens=12) for _ in range(3)]
    ids.append(submit(client, keys.free, kind="batch", deadline_window_s=600, max_tokens=5,
                      messages=[{"role": "user", "content": "hi"}], prompt=None))
    for job_id in ids:
        job = wait_status(client, keys.paid, job_id, {"succeeded", "failed"})
        assert job["status"] == "succeeded", job
        assert job["output_text"] and job["worker_id"] == "w1" and job["attempt"] == 1
        assert job["completion_tokens"] == job["sampling"]["max_tokens"] and job["finish_reason"] == "length"
        m = job["metrics"]
        assert m["ttft_s"] > 0 and m["ttlt_s"] >= m["ttft_s"] and m["tbt_p99_s"] >= m["tbt_p50_s"] > 0
        assert 0 <= m["queue_s"] <= m["ttft_s"]
        assert m["slo_met"] in (True, False)
        events = events_of(settings.sqlalchemy_url, job_id)
        assert events[:3] == [(None, "queued"), ("queued", "dispatched"), ("dispatched", "running")], events
        assert_ran_once(settings.sqlalchemy_url, job_id, events)
        # the Redis stream holds the same text as SQL, then one terminal event (published once the result's write
        # committed: a reader that saw the job end in SQL may come before the last step's events)
        rds = redis.Redis.from_url(settings.redis_url)
        evs = wait_for(lambda: (got := [StreamEvent.parse(f) for _id, f in rds.xrange(stream_key(job_id))])
                       and got[-1].type == "end" and got, 10, "the stream's end")
        assert "".join(e.text for e in evs if e.type == "delta") == job["output_text"]
        assert [e.type for e in evs].count("end") == 1 and evs[-1].status == "succeeded"
    state = wait_for(lambda: (st := _worker_state(settings)).get("active_jobs") == 0 and st, 10, "a fresh heartbeat")
    assert "kv_usage" in state and "queues" in state


def test_the_own_engines_inter_token_latency_is_vllms_histogram_on_metrics(service):
    """A dashboard built for vLLM reads ``vllm:inter_token_latency_seconds`` (one observation per engine step that
    gave a request tokens after its first, vLLM's buckets, ``model_name``): the worker on the own engine observes it
    and the API's /metrics carries it, labelled with the worker (it was missing: the jobs' rows keep no gaps)."""
    from prometheus_client.parser import text_string_to_metric_families

    from app.observability.engine_metrics import INTER_TOKEN_LATENCY_BUCKETS

    client, keys = service.client, service.keys
    job_id = submit(client, keys.paid, max_tokens=12)
    assert wait_status(client, keys.paid, job_id, {"succeeded", "failed"})["status"] == "succeeded"

    def itl() -> list:
        text = client.get("/metrics", headers=H(keys.admin)).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        family = fams.get("vllm:inter_token_latency_seconds")
        return [s for s in family.samples if s.labels.get("worker_id") == "w1"] if family else []
    samples = wait_for(lambda: (got := itl()) and got[-1].value and got, 15, "the worker's ITL on /metrics")
    count = next(s.value for s in samples if s.name.endswith("_count"))
    buckets = [s for s in samples if s.name.endswith("_bucket")]
    assert count >= 1 and next(s.value for s in samples if s.name.endswith("_sum")) > 0, samples
    assert [float(s.labels["le"]) for s in buckets] == [*INTER_TOKEN_LATENCY_BUCKETS, float("inf")]
    assert {s.labels["model_name"] for s in samples} == {service.settings.model_name}
    assert client.get("/metrics", headers=H(keys.admin)).text.count("# TYPE vllm:inter_token_latency_seconds ") == 1


def test_vllms_request_gauges_count_the_own_engines_batch_and_queue(service):
    """``vllm:num_requests_running`` is vLLM's requests in the engine's batch, and ``vllm:num_requests_waiting`` those
    the engine holds that wait; they were the jobs' SQL states by tier, where every job a worker leased (up to
    COSERVE_MAX_INFLIGHT, 1024) is running, so a dashboard saw a worker's backlog as its batch. Now they are each
    worker's engine's, as a vLLM worker's are (the jobs not yet in an engine: ``coserve:num_requests_waiting``)."""
    from prometheus_client.parser import text_string_to_metric_families

    client, keys = service.client, service.keys

    def gauges() -> dict:
        text = client.get("/metrics", headers=H(keys.admin)).text
        return {(f.name, s.labels.get("worker_id")): s for f in text_string_to_metric_families(text)
                if f.name in ("vllm:num_requests_running", "vllm:num_requests_waiting") for s in f.samples}
    job_id = submit(client, keys.paid, max_tokens=LONG)
    wait_for(lambda: status_of(client, keys.paid, job_id)["first_token_at"], 60, "the long job's first token")
    got = wait_for(lambda: (g := gauges()).get(("vllm:num_requests_running", "w1")) and g[
        ("vllm:num_requests_running", "w1")].value and g, 15, "the engine's batch on /metrics")
    running, waiting = got[("vllm:num_requests_running", "w1")], got[("vllm:num_requests_waiting", "w1")]
    assert (running.value, waiting.value) == (1, 0), got
    assert "tier" not in running.labels and running.labels["model_name"] == service.settings.model_name
    assert {worker for _name, worker in got} == {"w1"}, got  # no SQL series under vLLM's name beside the engine's
    client.post(f"/v1/jobs/{job_id}/cancel", headers=H(keys.paid))
    wait_status(client, keys.paid, job_id, {"cancelled"})


def _followed(settings, job_id: str) -> list:
    """Every event of ``job_id``'s stream as a client following it from the start gets them, to its end."""
    from redis.asyncio import Redis

    async def follow():
        r = Redis.from_url(settings.redis_url)
        try:
            return [ev async for ev in follow_job(r, job_id, block_ms=200)]
        finally:
            await r.aclose()

    return asyncio.run(asyncio.wait_for(follow(), 60))


def test_follow_job_yields_deltas_until_the_end(service):
    client, keys, settings = service.client, service.keys, service.settings
    job_id = submit(client, keys.paid, max_tokens=20)
    evs = _followed(settings, job_id)
    assert evs[-1].terminal and evs[-1].status == "succeeded"
    text = "".join(e.text for e in evs if e.type == "delta")
    assert text == status_of(client, keys.paid, job_id)["output_text"]
    assert sum(len(e.token_ids) for e in evs) == 20


def test_cancel_aborts_a_running_job(service):
    client, keys, settings = service.client, service.keys, service.settings
    job_id = submit(client, keys.paid, max_tokens=LONG, prompt="a")
    wait_status(client, keys.paid, job_id, {"running"})
    r = client.post(f"/v1/jobs/{job_id}/cancel", headers=H(keys.paid))
    assert r.json()["status"] == "cancelled"
    # the worker drops it (its engine holds no job) and never overwrites the cancel
    wait_for(lambda: _worker_state(settings)["active_jobs"] == 0, 30, "the worker to abort the job")
    job = status_of(client, keys.paid, job_id)
    assert job["status"] == "cancelled" and job["finish_reason"] == "cancelled"
    # what it produced before the cancel stays (no text where the cancel came before its first token, no count
    # where it came before the engine began the prompt), written before the cancel's reply
    assert (job["output_text"] is None) == (job["completion_tokens"] is None), job
    assert (r.json()["output_text"], r.json()["completion_tokens"]) == (job["output_text"], job["completion_tokens"])
    assert [e for e in events_of(settings.sqlalchemy_url, job_id) if e[1] in ("succeeded", "cancelled")] == [
        ("running", "cancelled")]


def _streamed(settings, job_id) -> tuple[str, int, list[str]]:
    """The job's stream so far: its deltas' text, their token count, and the other events' types."""
    evs = [StreamEvent.parse(f) for _id, f in redis.Redis.from_url(settings.redis_url).xrange(stream_key(job_id))]
    deltas = [e for e in evs if e.type == "delta"]
    return "".join(e.text for e in deltas), sum(len(e.token_ids) for e in deltas), [e.type for e in evs
                                                                                     if e.type != "delta"]


def _cancelled_with_tokens(service, key, job_id, cancel_path) -> dict:
    """Cancels the job once it has streamed some tokens: the reply comes once the worker wrote what it produced."""
    client, settings = service.client, service.settings
    seen = wait_for(lambda: (n := _streamed(settings, job_id)[1]) >= 8 and n, 60, f"{job_id} to generate")
    r = client.post(cancel_path, headers=H(key))
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    job = status_of(client, key, job_id)  # at once: the cancel waited for the worker's word
    assert job["status"] == "cancelled" and job["finish_reason"] == "cancelled", job
    assert job["output_text"] and seen <= job["completion_tokens"] < LONG and job["prompt_tokens"] > 0, job
    reply = r.json()
    usage = reply["usage"] if "usage" in reply else reply  # a Response's usage, or the job itself
    assert usage.get("output_tokens", usage.get("completion_tokens")) == job["completion_tokens"], reply
    # the text and tokens its stream carried, the API's end, and the worker's word that it wrote the rest
    text, _tokens, others = _streamed(settings, job_id)
    assert text == job["output_text"] and others == ["end", "kept"]
    assert [e for e in events_of(settings.sqlalchemy_url, job_id) if e[1] in ("succeeded", "cancelled")] == [
        ("running", "cancelled")]
    return job


def test_a_job_cancelled_while_it_runs_keeps_its_output_and_is_billed(service):
    client, keys = service.client, service.keys
    key = keys.other  # globex: no other test here runs its jobs, so its usage is this job's
    since = int(time.time()) - 60
    job_id = submit(client, key, max_tokens=LONG, prompt="a")
    job = _cancelled_with_tokens(service, key, job_id, f"/v1/jobs/{job_id}/cancel")
    r = client.get("/v1/organization/usage/completions", params={"start_time": since, "bucket_width": "1h"},
                   headers=H(key))
    assert r.status_code == 200, r.text
    results = [x for b in r.json()["data"] for x in b["results"]]
    assert [(x["num_model_requests"], x["input_tokens"], x["output_tokens"]) for x in results] == [
        (1, job["prompt_tokens"], job["completion_tokens"])]


def test_a_cancelled_background_response_shows_its_output_and_usage(service):
    client, keys = service.client, service.keys
    r = client.post("/v1/responses", headers=H(keys.paid), json={
        "model": "tiny", "input": "Tell me a long story", "max_output_tokens": LONG, "background": True,
        "ignore_eos": True})
    assert r.status_code == 200 and r.json()["status"] == "queued", r.text
    resp_id, job_id = r.json()["id"], r.headers["x-coserve-job-id"]
    job = _cancelled_with_tokens(service, keys.paid, job_id, f"/v1/responses/{resp_id}/cancel")
    body = client.get(f"/v1/responses/{resp_id}", headers=H(keys.paid)).json()
    assert body["status"] == "cancelled" and body["error"] is None  # as OpenAI's: cancelled is no error
    (item,) = body["output"]
    assert (item["type"], item["status"], item["content"][0]["text"]) == ("message", "incomplete", job["output_text"])
    assert (body["usage"]["input_tokens"], body["usage"]["output_tokens"]) == (job["prompt_tokens"],
                                                                              job["completion_tokens"])


def _sse(client, key, job_id, events: list | None = None, *, last_event_id: str | None = None,
         ids: list | None = None) -> list[tuple[str, dict]]:
    """The native stream's events, appended to ``events`` as they come (another thread may watch them); each
    event's SSE id (None where it has none) to ``ids``."""
    import json

    events, name, event_id = [] if events is None else events, None, None
    headers = H(key) | ({"Last-Event-ID": last_event_id} if last_event_id is not None else {})
    with client.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
                if ids is not None:
                    ids.append(event_id)
                event_id = None
    return events


def test_native_stream_sends_token_deltas_until_the_end(service):
    client, keys = service.client, service.keys
    job_id = submit(client, keys.paid, max_tokens=16, stream=True)
    events = _sse(client, keys.paid, job_id)
    job = status_of(client, keys.paid, job_id)
    deltas = [d for name, d in events if name == "delta"]
    assert len(deltas) > 1 and sum(len(d["token_ids"]) for d in deltas) == 16  # token by token, not at once
    assert "".join(d["text"] for d in deltas) == job["output_text"]
    assert events[-1] == ("end", {"id": job_id, "status": "succeeded", "finish_reason": "length", "error": None,
                                  "error_code": None, "prompt_tokens": job["prompt_tokens"], "completion_tokens": 16,
                                  "cached_tokens": 0,  # the own engine keeps no prefix cache
                                  "reasoning_tokens": None})  # no reasoning parser read it
    # a finished job replays; other tenants cannot follow it
    assert _sse(client, keys.paid, job_id) == events
    assert client.get(f"/v1/jobs/{job_id}/stream", headers=H(keys.other)).status_code == 404


def test_native_stream_resumes_after_the_last_event_id(service):
    client, keys = service.client, service.keys
    job_id = submit(client, keys.paid, max_tokens=12, stream=True)
    ids: list = []
    events = _sse(client, keys.paid, job_id, ids=ids)
    assert ids[-1] == f"{job_id}:end" and all(i is not None for i in ids[:-1])  # every delta names its position
    for k in range(len(events) - 1):  # a reconnect after each delta gets exactly the rest
        rest_ids: list = []
        assert _sse(client, keys.paid, job_id, last_event_id=ids[k], ids=rest_ids) == events[k + 1:]
        assert rest_ids == ids[k + 1:]
    headers = H(keys.paid)
    after_end = client.get(f"/v1/jobs/{job_id}/stream", headers=headers | {"Last-Event-ID": "end"})
    assert after_end.status_code == 204 and after_end.content == b""  # EventSource stops reconnecting
    bad = client.get(f"/v1/jobs/{job_id}/stream", headers=headers | {"Last-Event-ID": "7"})
    assert bad.status_code == 422 and "Last-Event-ID" in bad.text
    other = client.get(f"/v1/jobs/{job_id}/stream", headers=H(keys.other) | {"Last-Event-ID": "end"})
    assert other.status_code == 404


def test_a_last_event_id_of_another_job_is_refused(service):
    """An event id was a bare position (``12.3.0``): a reconnect to the wrong job with another job's id read it as a
    position in this one and silently skipped its events. An id now names its job, and another job's is a 422 that
    says whose it is; an id of the old shape (already given to clients) still resumes where it says."""
    client, keys = service.client, service.keys
    first, second = (submit(client, keys.paid, max_tokens=6, stream=True) for _ in range(2))
    ids: list = []
    events = _sse(client, keys.paid, first, ids=ids)
    assert ids[0].startswith(f"{first}:") and ids[-1] == f"{first}:end", ids
    _sse(client, keys.paid, second)  # ended: a wrong id would resume it (or end it) silently
    for wrong in (ids[0], ids[-1]):
        r = client.get(f"/v1/jobs/{second}/stream", headers=H(keys.paid) | {"Last-Event-ID": wrong})
        assert r.status_code == 422 and first in r.text and second in r.text, r.text
    assert _sse(client, keys.paid, first, last_event_id=ids[0].split(":")[1]) == events[1:]  # an old id
    after_end = client.get(f"/v1/jobs/{first}/stream", headers=H(keys.paid) | {"Last-Event-ID": "end"})
    assert after_end.status_code == 204


def test_native_stream_read_after_its_redis_stream_expired_still_has_the_token_ids(service):
    """Once a job's Redis stream is gone (its TTL after the end, or a Redis that restarted empty), the stream is
    SQL's text as one delta: it came without the token ids SQL keeps, so a client read the text but no ids, and a
    reconnect with a live delta's id got the rest of the text without the rest of the ids."""
    client, keys = service.client, service.keys
    job_id = submit(client, keys.paid, max_tokens=8, stream=True, return_token_ids=True)
    ids: list = []
    live = [d for name, d in _sse(client, keys.paid, job_id, ids=ids) if name == "delta"]
    job = status_of(client, keys.paid, job_id)
    assert [t for d in live for t in d["token_ids"]] == job["output_token_ids"] and len(job["output_token_ids"]) == 8
    redis.Redis.from_url(service.settings.redis_url).delete(stream_key(job_id))  # as its TTL deletes it
    replay = [d for name, d in _sse(client, keys.paid, job_id) if name == "delta"]
    assert "".join(d["text"] for d in replay) == job["output_text"]
    assert [t for d in replay for t in d["token_ids"]] == job["output_token_ids"]
    rest = [d for name, d in _sse(client, keys.paid, job_id, last_event_id=ids[0]) if name == "delta"]
    assert [t for d in rest for t in d["token_ids"]] == job["output_token_ids"][len(live[0]["token_ids"]):]


def test_native_stream_read_after_its_redis_stream_expired_sends_the_ids_the_live_one_sent(service):
    """The live stream sends every delta's token ids; once the Redis stream was gone its replay from SQL had them only
    for a job that asked return_token_ids, so the replay of any other job had none, its ids named other positions
    than the live ones (no token counted) and a reconnect with a live id got the rest of the text without its ids.
    The job resource still shows the ids only where the job asked for them."""
    client, keys = service.client, service.keys
    job_id = submit(client, keys.paid, max_tokens=8, stream=True)
    ids: list = []
    live = [d for name, d in _sse(client, keys.paid, job_id, ids=ids) if name == "delta"]
    redis.Redis.from_url(service.settings.redis_url).delete(stream_key(job_id))  # as its TTL deletes it
    replay_ids: list = []
    replay = [d for name, d in _sse(client, keys.paid, job_id, ids=replay_ids) if name == "delta"]
    assert [t for d in replay for t in d["token_ids"]] == [t for d in live for t in d["token_ids"]]
    assert replay_ids[-2:] == ids[-2:]  # the last delta's id and the end's, as the live stream named them
    rest = [d for name, d in _sse(client, keys.paid, job_id, last_event_id=ids[2]) if name == "delta"]
    assert len(live) > 3 and "".join(d["text"] for d in rest) == "".join(d["text"] for d in live[3:])
    assert [t for d in rest for t in d["token_ids"]] == [t for d in live[3:] for t in d["token_ids"]]
    assert status_of(client, keys.paid, job_id)["output_token_ids"] is None


def test_native_stream_of_a_cancelled_job_ends(service):
    client, keys = service.client, service.keys
    job_id = submit(client, keys.paid, max_tokens=LONG, prompt="a")
    wait_status(client, keys.paid, job_id, {"running"})
    client.post(f"/v1/jobs/{job_id}/cancel", headers=H(keys.paid))
    events = _sse(client, keys.paid, job_id)
    assert events[-1][0] == "end" and events[-1][1]["status"] == "cancelled"
    wait_for(lambda: _worker_state(service.settings)["active_jobs"] == 0, 30, "the worker to abort the job")


def test_a_stream_read_while_its_job_is_cancelled_ends_with_the_text_and_usage_the_job_kept(service):
    """The cancel's end reached the stream before the worker took the abort: a live reader stopped there, short of
    the text the worker made meanwhile and without the usage it kept. It reads on to the worker's word now."""
    import threading

    client, keys, settings = service.client, service.keys, service.settings
    job_id = submit(client, keys.paid, max_tokens=LONG, prompt="b")
    events: list[tuple[str, dict]] = []
    reader = threading.Thread(target=_sse, args=(client, keys.paid, job_id, events))
    reader.start()
    wait_for(lambda: any(name == "delta" for name, _ in events), 60, "a streamed token")
    client.post(f"/v1/jobs/{job_id}/cancel", headers=H(keys.paid))
    reader.join(60)
    text = [data["text"] for name, data in events if name == "delta"]
    end = events[-1][1]
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, job_id)
        kept_text, kept_tokens = job.output_text, job.completion_tokens
    assert end["status"] == "cancelled" and kept_tokens and end["completion_tokens"] == kept_tokens
    assert "".join(text) == kept_text


def test_a_request_the_engine_cannot_admit_fails_alone(service):
    """A seed the generator rejects (the API bounds it; this one slips past) fails its own job at
    admission; the jobs already running in the same engine are not touched."""
    from app.auth import authenticate
    from app.schemas import JobCreate
    from app.services.dispatch import dispatch
    from app.services.jobs import submit_job

    client, keys, settings = service.client, service.keys, service.settings
    url = settings.sqlalchemy_url
    running = submit(client, keys.paid, max_tokens=120)
    wait_status(client, keys.paid, running, {"running"})
    with session_scope(url) as s:
        spec = JobCreate(prompt="poison", max_tokens=4, temperature=0.7, seed=1)
        bad = submit_job(s, authenticate(s, keys.paid), spec, settings, dispatch=False).job.id
        s.execute(update(Job).where(Job.id == bad).values(sampling={**spec.sampling(16), "seed": 2**70}))
    with session_scope(url) as s:
        assert dispatch(s, settings.redis_url, bad, "tiny")
    job = wait_status(client, keys.paid, bad, {"failed", "succeeded"})
    # the engine's own words, and the client's request to fix (an OpenAI route answers it with a 400)
    assert job["status"] == "failed" and "refused the request: Overflow" in job["error"], job
    assert job["error_code"] == "invalid_request"
    assert wait_status(client, keys.paid, running, {"succeeded", "failed"}, timeout=120)["status"] == "succeeded"
    assert status_of(client, keys.paid, running)["attempt"] == 1
    end = StreamEvent.parse(redis.Redis.from_url(settings.redis_url).xrange(stream_key(bad))[-1][1])
    assert end.type == "end" and end.status == "failed"


def _worker_state(settings, worker_id="w1"):
    with session_scope(settings.sqlalchemy_url) as s:
        s.expire_all()
        row = s.get(WorkerState, worker_id)
        return row.state if row else {}


def test_job_accepted_while_broker_down_is_dispatched_by_the_sweeper(service, monkeypatch):
    client, keys, settings = service.client, service.keys, service.settings
    good = settings.redis_url
    monkeypatch.setattr(settings, "redis_url", "redis://127.0.0.1:1/0")  # the API sees the broker down
    # a TTFT target longer than the sweeper's grace period, so the job is not relegated on arrival
    job_id = submit(client, keys.paid, max_tokens=4, ttft_ms=60_000)
    # the API's send failed and was undone; the job is accepted and waits in SQL
    wait_for(lambda: ("dispatched", "queued") in events_of(settings.sqlalchemy_url, job_id), 20,
             "the API's failed send to be undone")
    monkeypatch.setattr(settings, "redis_url", good)
    # the worker's sweeper (it reaches Redis) sends it after its grace period; it runs once
    job = wait_status(client, keys.paid, job_id, {"succeeded"})
    events = events_of(settings.sqlalchemy_url, job_id)
    assert events[:3] == [(None, "queued"), ("queued", "dispatched"), ("dispatched", "queued")]
    assert_ran_once(settings.sqlalchemy_url, job_id, events)
    assert job["attempt"] == 1


def _consumed_queues(settings) -> list[str] | None:
    """The queues the worker's Celery consumer reads, as it answers Celery's inspect (None: no answer)."""
    from workers.celery_app import get_celery

    answer = get_celery(settings.redis_url).control.inspect(timeout=1.0).active_queues() or {}
    return next(([q["name"] for q in queues] for name, queues in answer.items() if name.startswith("w1@")), None)


def _message_ids(settings) -> list[str]:
    """The task ids of the messages waiting on the model's interactive list."""
    import json

    raw = redis.Redis.from_url(settings.redis_url).lrange("coserve.tiny", 0, -1)
    return [json.loads(m)["headers"]["id"] for m in raw]


def test_draining_worker_takes_no_new_jobs(service, monkeypatch):
    """A draining worker stops consuming (rather than taking each message and handing it back, about once a
    second): a job's message waits in the broker, untouched, and the worker reads its queues again once undrained.
    A job that prefix routing sent to the worker's own queue by a view from before the drain goes to the model's
    queue, for the other workers (it waited there until the worker served again)."""
    from app.services import routing

    client, keys, settings = service.client, service.keys, service.settings
    monkeypatch.setattr(routing, "REFRESH_S", 0.0)
    first = submit(client, keys.paid, max_tokens=1)  # the API reads the workers afresh
    monkeypatch.setattr(routing, "REFRESH_S", 3600.0)  # and keeps that view
    assert wait_status(client, keys.paid, first, {"succeeded"})["worker_id"] == "w1"
    own = redis.Redis.from_url(settings.redis_url)
    with session_scope(settings.sqlalchemy_url) as s:
        s.execute(update(WorkerState).where(WorkerState.id == "w1").values(draining=True))
    try:
        wait_for(lambda: _consumed_queues(settings) == [], 20, "the draining worker to stop consuming")
        job_id = submit(client, keys.paid, max_tokens=4)  # routed to w1, which the API still sees serving
        sent = wait_for(lambda: _message_ids(settings), 10, "the job's message on the model's queue")
        assert own.llen(routing.worker_queue("w1")) == 0
        time.sleep(2)
        assert status_of(client, keys.paid, job_id)["status"] == "dispatched"
        assert len(sent) == 1 and _message_ids(settings) == sent  # never taken and handed back (a new message)
        assert client.get("/readyz").status_code == 503  # a draining worker does not make the service ready
    finally:
        with session_scope(settings.sqlalchemy_url) as s:
            s.execute(update(WorkerState).where(WorkerState.id == "w1").values(draining=False))
    assert wait_status(client, keys.paid, job_id, {"succeeded"})["worker_id"] == "w1"


def test_a_job_run_again_after_its_lease_lapsed_goes_on_from_what_it_streamed(service):
    """A lease that lapsed mid-job (a late heartbeat; a worker that died is the same to the sweeper): the sweeper sends
    the job again, the worker stops attempt 1, and attempt 2 goes on from the tokens attempt 1 streamed instead of
    generating them again; a client following the stream gets the job's text once, with no divergence."""
    from tests.integration.test_worker_threads import _lapse_and_requeue

    client, key, settings = service.client, service.keys.paid, service.settings
    tokens = 1200  # a few seconds of work: it runs on well past the lapse
    job_id = submit(client, key, max_tokens=tokens, prompt="a", temperature=0.0)
    seen = wait_for(lambda: (n := _streamed(settings, job_id)[1]) >= 8 and n, 60, f"{job_id} to generate")
    _lapse_and_requeue(settings, job_id)
    job = wait_status(client, key, job_id, {"succeeded", "failed"}, timeout=120)
    assert (job["status"], job["attempt"], job["completion_tokens"]) == ("succeeded", 2, tokens), job
    evs = [StreamEvent.parse(f) for _id, f in redis.Redis.from_url(settings.redis_url).xrange(stream_key(job_id))]
    first = [e.token_ids for e in evs if e.type == "delta" and e.attempt == 1]
    produced = [t for ids in first for t in ids]
    # attempt 2's stream begins with those tokens (at its offset 0) and its engine made only the rest
    resumed = next(e for e in evs if e.type == "delta" and e.attempt == 2)
    assert len(produced) >= seen and (resumed.offset, resumed.data["token_offset"]) == (0, 0)
    assert resumed.token_ids == produced, (len(resumed.token_ids), len(produced))
    assert evs[-1].data["metrics"]["num_output_tokens"] == tokens - len(produced)
    from app.services.truncation import fed_prompt

    with session_scope(settings.sqlalchemy_url) as s:  # the prompt billed as fed, not with the tokens fed after it
        assert job["prompt_tokens"] == len(fed_prompt(settings, s.get(Job, job_id))), job
    followed = _followed(settings, job_id)
    kinds = [e.type for e in followed]
    assert "error" not in kinds and kinds[-1] == "end", followed[-1]  # no stream_diverged
    assert "".join(e.text for e in followed if e.type == "delta") == job["output_text"]
    assert sum(len(e.token_ids) for e in followed) == tokens
