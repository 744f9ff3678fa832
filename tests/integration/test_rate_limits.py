"""Per-tenant rate limits: the buckets in a real Redis, and the API's 429s (real app, SQL migrated by Alembic)."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from datetime import UTC, datetime

import pytest
import redis

from app.db.models import Job, JobStatus
from app.db.session import session_scope
from app.services.rate_limits import Limits, RateLimiter
from app.services.streaming import StreamEvent, publish
from tests.conftest import Keys
from tests.integration.test_message_batch_state import ended_message_batch
from tests.integration.test_tool_calls_streamed_or_not import taking_jobs
from tests.postgres import TEST_DATABASE

pytestmark = pytest.mark.integration

H = Keys.header


def test_buckets_take_both_costs_or_neither_and_refill_over_the_minute(redis_url):
    limiter = RateLimiter(redis_url)
    limits = Limits(requests_per_minute=2, tokens_per_minute=100)
    t = 1000.0
    first = limiter.take("ten_a", limits, 60, now=t)
    assert first.allowed and first.requests_left == 1 and first.tokens_left == 40
    over = limiter.take("ten_a", limits, 50, now=t)  # 50 tokens > 40 left: refused, and nothing is taken
    assert not over.allowed and over.tokens_wait_s == pytest.approx(6.0)  # 10 tokens at 100 per 60 s
    assert "tokens per minute" in over.message() and over.headers()["retry-after"] == "6"
    second = limiter.take("ten_a", limits, 40, now=t)  # the request the refusal did not take is still there
    assert second.allowed and second.requests_left == 0 and second.tokens_left == 0
    third = limiter.take("ten_a", limits, 1, now=t)
    assert not third.allowed and third.requests_wait_s == pytest.approx(30.0)  # one request per 30 s
    assert "requests per minute" in third.message() and third.headers()["retry-after"] == "30"
    later = limiter.take("ten_a", limits, 1, now=t + 30)  # refilled: one request, 50 tokens
    assert later.allowed and later.tokens_left == pytest.approx(49)
    headers = later.headers()
    assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "1m0s" and "retry-after" not in headers
    assert limiter.take("ten_b", limits, 60, now=t).allowed  # another tenant's buckets are its own
    huge = limiter.take("ten_b", limits, 101, now=t + 3600)  # more than the bucket ever holds
    assert not huge.allowed and huge.too_large and "request too large" in huge.message()
    assert "retry-after" not in huge.headers()  # waiting would not help
    assert limiter.take("ten_c", Limits(), 10**9, now=t).allowed  # no limits: nothing asked of Redis


def test_a_charge_given_back_returns_to_the_bucket_and_never_past_full(redis_url):
    from app.services.rate_limits import Charge

    limiter = RateLimiter(redis_url)
    limits = Limits(requests_per_minute=2, tokens_per_minute=100)
    t = 1000.0
    assert limiter.take("ten_g", limits, 60, now=t).allowed
    limiter.give_back([Charge("ten_g", limits, 1, 60)], now=t + 6)  # 10 tokens refilled meanwhile
    back = limiter.take("ten_g", limits, 0, requests=0, now=t + 6)
    assert back.requests_left == pytest.approx(2) and back.tokens_left == pytest.approx(100)  # full, not over
    assert limiter.take("ten_g", limits, 100, now=t + 6).allowed
    limiter.give_back([Charge("ten_g", limits, 0, 30)], now=t + 6)
    assert limiter.take("ten_g", limits, 0, requests=0, now=t + 6).tokens_left == pytest.approx(30)


def test_buckets_refill_by_redis_clock_not_the_api_hosts(redis_url, monkeypatch):
    """Every API host's charges are measured on Redis's clock: a host whose clock runs an hour ahead found a
    bucket another host had just drained full again."""
    import time as clock

    limiter = RateLimiter(redis_url)
    limits = Limits(tokens_per_minute=100)
    assert limiter.take("ten_s", limits, 100).allowed  # drained
    ahead = clock.time() + 3600
    monkeypatch.setattr(clock, "time", lambda: ahead)  # this host's clock, an hour ahead of the others'
    refused = limiter.take("ten_s", limits, 50)
    assert not refused.allowed and refused.tokens_wait_s > 20  # what is left of a minute's refill, not an hour's


def test_a_limit_changed_mid_minute_counts_what_the_tenant_used_against_the_new_one(redis_url):
    """The buckets kept what was left, not what was used: a tenant that spent its 5 requests and whose operator
    raised the limit to 100 was refused (remaining 0 of 100) though it had used 5 of them; one that spent 115
    tokens and whose limit was lowered to 20 had 20 more at once (remaining 20, reset 0ms)."""
    limiter = RateLimiter(redis_url)
    t = 1000.0
    for _ in range(5):
        assert limiter.take("ten_r", Limits(requests_per_minute=5), 0, now=t).allowed
    raised = limiter.take("ten_r", Limits(requests_per_minute=100), 0, now=t)
    assert raised.allowed and raised.requests_left == pytest.approx(94)  # 5 and this one used of 100
    assert limiter.take("ten_l", Limits(tokens_per_minute=1000), 115, now=t).allowed
    lowered = limiter.take("ten_l", Limits(tokens_per_minute=20), 1, now=t)
    assert not lowered.allowed and lowered.tokens_left == 0  # the minute's 115 used up the new 20
    assert lowered.headers()["x-ratelimit-reset-tokens"] == "1m0s"  # and no more than a minute to wait
    assert limiter.take("ten_l", Limits(tokens_per_minute=20), 20, now=t + 60).allowed


def test_without_redis_requests_go_through():
    limiter = RateLimiter("redis://127.0.0.1:1/0")  # nothing listens there
    assert limiter.take("ten_a", Limits(1, 1), 10).allowed


def test_the_api_answers_429_over_a_tenants_limits(client, keys):
    assert client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 2},
                        headers=H(keys.paid)).status_code == 403
    assert client.patch("/v1/admin/tenants/ten_nope", json={"requests_per_minute": 2},
                        headers=H(keys.admin)).status_code == 404
    bad = client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 0},
                       headers=H(keys.admin))
    assert bad.status_code == 422 and "requests_per_minute" in bad.text
    r = client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 2}, headers=H(keys.admin))
    assert r.status_code == 200 and r.json()["requests_per_minute"] == 2 and r.json()["tokens_per_minute"] is None
    listed = client.get("/v1/admin/tenants", headers=H(keys.admin)).json()
    assert [t["name"] for t in listed] == ["acme", "globex", "ops"] and listed[0] == r.json()
    assert client.get(f"/v1/admin/tenants/{keys.tenant_id}", headers=H(keys.admin)).json() == r.json()
    assert client.get("/v1/admin/tenants", headers=H(keys.paid)).status_code == 403
    assert client.get("/v1/admin/tenants/ten_nope", headers=H(keys.admin)).status_code == 404

    job = {"prompt": "hello", "max_tokens": 4}
    taken = [client.post("/v1/jobs", json=job, headers=H(keys.paid)) for _ in range(2)]
    assert [r.status_code for r in taken] == [201, 201]
    # every answer says where the tenant stands, as OpenAI's do
    assert [r.headers["x-ratelimit-remaining-requests"] for r in taken] == ["1", "0"]
    assert taken[0].headers["x-ratelimit-limit-requests"] == "2" and "x-ratelimit-limit-tokens" not in taken[0].headers
    refused = client.post("/v1/jobs", json=job, headers=H(keys.free))  # the tenant's bucket, whichever key
    assert refused.status_code == 429 and "requests per minute: limit 2" in refused.json()["detail"]
    assert refused.headers["x-ratelimit-limit-requests"] == "2" and int(refused.headers["retry-after"]) >= 29
    chat = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                       headers=H(keys.paid))
    assert chat.status_code == 429 and chat.json()["error"]["code"] == "rate_limit_exceeded"
    assert chat.json()["error"]["type"] == "requests" and "retry-after" in chat.headers
    assert client.post("/v1/jobs", json=job, headers=H(keys.other)).status_code == 201  # other tenants go on
    assert (f'coserve:rate_limited_requests_total{{limit="requests",tenant_id="{keys.tenant_id}"}} 2.0'
            in client.get("/metrics", headers=H(keys.admin)).text)  # the operator sees the refusals (two so far)
    import openai  # the official client raises its RateLimitError (and would wait retry-after before a retry)

    oai = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=keys.paid, http_client=client, max_retries=0)
    with pytest.raises(openai.RateLimitError) as limited:
        oai.responses.create(model="tiny", input="hi", background=True)
    assert limited.value.code == "rate_limit_exceeded" and limited.value.response.headers["retry-after"]

    # tokens: a request may use its prompt and max_tokens; one larger than the minute's tokens never fits
    r = client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": None,
                                                                  "tokens_per_minute": 64}, headers=H(keys.admin))
    assert r.json() == {**r.json(), "requests_per_minute": None, "tokens_per_minute": 64}
    big = client.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 100,
                                             "background": True}, headers=H(keys.paid))
    assert big.status_code == 429 and "request too large" in big.json()["error"]["message"]
    assert big.json()["error"]["type"] == "tokens" and "retry-after" not in big.headers
    # waiting never makes it fit: the official client, which retries a 429 twice by default, sends it once
    sent = []
    client.event_hooks["request"].append(sent.append)
    try:
        with pytest.raises(openai.RateLimitError, match="request too large"):
            sdk = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=keys.paid, http_client=client)
            sdk.responses.create(model="tiny", input="hi", max_output_tokens=100, background=True)
    finally:
        client.event_hooks["request"].remove(sent.append)
    assert len(sent) == 1 and big.headers["x-should-retry"] == "false"
    fits = client.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 16,
                                              "background": True}, headers=H(keys.paid))
    assert fits.status_code == 200, fits.text
    assert 0 <= int(fits.headers["x-ratelimit-remaining-tokens"]) <= 64 - 16
    client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"tokens_per_minute": None}, headers=H(keys.admin))
    assert client.post("/v1/jobs", json=job, headers=H(keys.paid)).status_code == 201  # no limits: as before


def test_a_request_of_several_choices_and_prompts_counts_once(settings, keys, redis_url):
    """OpenAI counts a request once and each prompt's tokens once, with every choice's max_tokens."""
    from app.api.openai_compat import _submit_choices
    from app.auth import Principal
    from app.db.session import get_sessionmaker
    from app.openai_schemas import CompletionRequest, OpenAIError, choice_specs

    limiter = RateLimiter(redis_url)
    body = CompletionRequest.model_validate({"model": "tiny", "prompt": ["word " * 150, "four"], "max_tokens": 5,
                                             "n": 2})
    specs = [c for p in body.prompt_inputs() for c in choice_specs(body.job_spec(**p, tiers=settings.tiers), 2)]
    session = get_sessionmaker(settings.sqlalchemy_url)()
    try:
        principal = Principal("k", keys.tenant_id, "paid", False, Limits(requests_per_minute=1,
                                                                          tokens_per_minute=2000))
        jobs, headers = _submit_choices(session, principal, settings, specs, "/v1/completions", limiter=limiter, n=2)
        assert headers["x-ratelimit-remaining-requests"] == "0"
        prompts = sum(j.prompt_tokens for j in jobs[::2])
        assert len(jobs) == 4
        assert prompts > 150
        left = limiter.take(keys.tenant_id, Limits(tokens_per_minute=2000), 0, requests=0).tokens_left
        # each prompt once: counted twice, 150 more would be gone; the bucket refills 33 tokens a second meanwhile
        assert 2000 - prompts - 4 * 5 <= left < 2000 - prompts - 4 * 5 + 100
        with pytest.raises(OpenAIError) as refused:  # the one request of the minute is spent
            _submit_choices(session, principal, settings, specs[:1], "/v1/completions", limiter=limiter)
        assert refused.value.status_code == 429 and refused.value.type == "requests"
    finally:
        session.close()


def test_a_request_of_several_choices_is_charged_whole_or_not_at_all(settings, keys, redis_url):
    """n choices are one charge: a request whose total is over the tokens per minute is too large (no retry-after)
    and takes nothing, though each choice alone would fit; one whose total fits passes."""
    from app.api.openai_compat import _submit_choices
    from app.auth import Principal
    from app.db.session import get_sessionmaker
    from app.openai_schemas import CompletionRequest, OpenAIError, choice_specs

    limiter = RateLimiter(redis_url)
    limits = Limits(tokens_per_minute=100)
    principal = Principal("k", keys.tenant_id, "paid", False, limits)

    def choices(n: int) -> list:
        body = CompletionRequest.model_validate({"model": "tiny", "prompt": "hello", "max_tokens": 40, "n": n})
        return choice_specs(body.job_spec(**body.prompt_inputs()[0], tiers=settings.tiers), n)

    session = get_sessionmaker(settings.sqlalchemy_url)()
    try:
        with pytest.raises(OpenAIError) as refused:
            _submit_choices(session, principal, settings, choices(3), "/v1/completions", limiter=limiter, n=3)
        assert refused.value.status_code == 429 and refused.value.type == "tokens"
        assert "request too large" in refused.value.message and "retry-after" not in refused.value.headers
        assert limiter.take(keys.tenant_id, limits, 0, requests=0).tokens_left == 100  # nothing was taken
        jobs, headers = _submit_choices(session, principal, settings, choices(2), "/v1/completions",
                                        limiter=limiter, n=2)
        assert len(jobs) == 2 and int(headers["x-ratelimit-remaining-tokens"]) <= 100 - 2 * 40
    finally:
        session.close()


def test_concurrent_retries_with_one_idempotency_key_are_charged_once(client, keys, redis_url):
    """Retries racing with the same Idempotency-Key all answer the one job; only the request that wrote it is
    charged, so none is refused."""
    from concurrent.futures import ThreadPoolExecutor

    client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 5}, headers=H(keys.admin))
    job = {"prompt": "hello", "max_tokens": 4}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: client.post("/v1/jobs", json=job, headers={
            **H(keys.paid), "Idempotency-Key": "retry-1"}), range(8)))
    assert sorted(r.status_code for r in answers) == [200] * 7 + [201], [r.text for r in answers]
    assert len({r.json()["id"] for r in answers}) == 1
    left = RateLimiter(redis_url).take(keys.tenant_id, Limits(requests_per_minute=5), 0, requests=0).requests_left
    assert 4 <= left < 4.5  # one request taken (the bucket refills 1/12 a second meanwhile)


@pytest.mark.skipif(TEST_DATABASE != "sqlite", reason="PostgreSQL's INTEGER column cannot hold the value an older "
                    "coserve stored in SQLite, the case this test guards")
def test_a_stored_limit_over_the_apis_bound_still_reads(client, keys, db_url):
    """A limit over MAX_RATE that an older `coserve keys limits` stored (SQLite) made the admin reads answer 500."""
    from sqlalchemy import update

    from app.db.models import Tenant
    from app.db.session import session_scope

    with session_scope(db_url) as s:
        s.execute(update(Tenant).where(Tenant.id == keys.tenant_id).values(tokens_per_minute=3_000_000_000))
    assert client.get("/v1/admin/tenants", headers=H(keys.admin)).status_code == 200
    r = client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 5}, headers=H(keys.admin))
    assert r.status_code == 200 and r.json()["tokens_per_minute"] == 3_000_000_000, r.text


def test_one_call_judges_many_charges_in_turn(redis_url):
    from app.services.rate_limits import Charge

    limiter = RateLimiter(redis_url)
    two = Limits(requests_per_minute=2)
    said = limiter.take_many([Charge("ten_m", two, 1, 5), Charge("ten_n", Limits(), 1, 5), Charge("ten_m", two, 1, 5),
                              Charge("ten_m", two, 1, 5), Charge("ten_m", two, 0, 5)], now=50.0)
    assert [d.allowed for d in said] == [True, True, True, False, True]  # a further job of a request costs none
    assert said[2].requests_left == 0 and said[3].requests_wait_s == pytest.approx(30.0)


def test_the_group_commit_writer_refuses_what_the_limits_do_not_let_through(settings, keys):
    """Three jobs of a tenant allowed two requests a minute, submitted at once: two are written, one is refused
    and never reaches SQL."""
    from concurrent.futures import wait

    from app.auth import Principal
    from app.db.models import Job
    from app.db.session import session_scope
    from app.schemas import JobCreate
    from app.services.job_writer import JobWriter
    from app.services.jobs import build_job, rate_charge
    from app.services.rate_limits import RateLimited

    principal = Principal("k", keys.tenant_id, "paid", False, Limits(requests_per_minute=2))
    writer = JobWriter(settings)
    try:
        jobs = [build_job(settings, principal, JobCreate(prompt="hi", max_tokens=2)) for _ in range(3)]
        futures = [writer.submit(job, "test", rate_charge(principal, job)) for job in jobs]
        wait(futures, timeout=30)
    finally:
        writer.close()
    refused = [f for f in futures if isinstance(f.exception(), RateLimited)]
    written = [f.result() for f in futures if f.exception() is None]
    assert len(refused) == 1 and len(written) == 2
    # (the writer may take them in two batches, a moment apart: the bucket refills a little in between)
    assert sorted(w.rate.requests_left for w in written) == pytest.approx([0, 1], abs=0.01)
    with session_scope(settings.sqlalchemy_url) as s:
        assert {j.id for j in s.query(Job).filter(Job.tenant_id == keys.tenant_id)} == {w.job.id for w in written}


SUMMARIZE = {"documents": [{"id": "d0", "text": "The river runs to the sea. It is wide and slow."}], "deadline": "30m",
             "max_summary_tokens": 12, "chunk_tokens": 160, "overlap_tokens": 16}


def test_a_summarization_start_counts_against_the_tenants_requests_per_minute(client, keys):
    """POST /v1/summarize was never limited: a tenant over its requests per minute started runs without bound (their
    jobs count against the batch queue limit only at each run's first step). A start is one request, as a batch's
    creation is; a retry under its Idempotency-Key answers the run without a charge."""
    client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 1}, headers=H(keys.admin))
    key = {**H(keys.paid), "Idempotency-Key": "sum-1"}
    first = client.post("/v1/summarize", json=SUMMARIZE, headers=key)
    assert first.status_code == 201 and first.headers["x-ratelimit-remaining-requests"] == "0", first.text
    again = client.post("/v1/summarize", json=SUMMARIZE, headers=key)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"], again.text
    assert not any(h.startswith("x-ratelimit-") for h in again.headers)  # not charged: no bucket to show
    refused = client.post("/v1/summarize", json=SUMMARIZE, headers=H(keys.free))  # the tenant's bucket, any key
    assert refused.status_code == 429, refused.text
    assert "requests per minute: limit 1; try again in" in refused.json()["detail"], refused.text
    assert refused.headers["x-ratelimit-limit-requests"] == "1" and int(refused.headers["retry-after"]) >= 59
    listed = client.get("/v1/summarize", headers=H(keys.paid)).json()["data"]
    assert [r["id"] for r in listed] == [first.json()["id"]]  # the refused start wrote no run
    assert client.post("/v1/summarize", json=SUMMARIZE, headers=H(keys.other)).status_code == 201


def test_token_counting_routes_have_their_own_requests_per_minute(client, keys):
    """Anthropic's count_tokens, OpenAI's input_tokens and vLLM's /tokenize and /detokenize were never limited: a
    tenant made the API tokenize without bound. They share a bucket of the tenant's requests per minute apart from
    its generation requests', as Anthropic limits count_tokens apart from messages: counting before each message
    does not halve what a tenant may send."""
    client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 3}, headers=H(keys.admin))
    messages = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    counted = client.post("/v1/messages/count_tokens", json=messages, headers=H(keys.paid))
    assert counted.status_code == 200 and counted.headers["anthropic-ratelimit-requests-remaining"] == "2", counted.text
    tokenized = client.post("/tokenize", json={"prompt": "Hello world"}, headers=H(keys.free))
    assert tokenized.status_code == 200 and tokenized.headers["x-ratelimit-remaining-requests"] == "1"
    detokenized = client.post("/detokenize", json={"tokens": tokenized.json()["tokens"]}, headers=H(keys.paid))
    assert detokenized.status_code == 200, detokenized.text
    refused = client.post("/v1/messages/count_tokens", json=messages, headers=H(keys.paid))
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error", refused.text
    assert "requests per minute: limit 3" in refused.json()["error"]["message"], refused.text
    assert refused.headers["anthropic-ratelimit-requests-limit"] == "3" and int(refused.headers["retry-after"]) >= 19
    assert not any(h.startswith("x-ratelimit-") for h in refused.headers)
    inputs = client.post("/v1/responses/input_tokens", json={"model": "tiny", "input": "hi"}, headers=H(keys.paid))
    assert inputs.status_code == 429 and inputs.json()["error"]["code"] == "rate_limit_exceeded", inputs.text
    again = client.post("/tokenize", json={"prompt": "Hello world"}, headers=H(keys.paid))
    assert again.status_code == 429 and "retry-after" in again.headers
    job = {"prompt": "hello", "max_tokens": 4}  # the generation requests' bucket is untouched
    assert [client.post("/v1/jobs", json=job, headers=H(keys.paid)).status_code for _ in range(4)] == [201] * 3 + [429]
    assert client.post("/tokenize", json={"prompt": "Hi"}, headers=H(keys.other)).status_code == 200


def test_a_batch_create_counts_against_the_tenants_requests_per_minute(client, keys):
    """POST /v1/batches and POST /v1/messages/batches were never limited: a tenant over its requests per minute
    created batches without bound. A create is one request and no tokens now, as OpenAI counts a batch's creation
    among its requests (its queue limit counts the tokens): not charged where its checks refuse it, a 429 in each
    API's shape over the limit, no batch written."""
    client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 2}, headers=H(keys.admin))
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}}
    upload = client.post("/v1/files", headers=H(keys.paid), data={"purpose": "batch"},
                         files={"file": ("in.jsonl", f"{json.dumps(line)}\n".encode())}).json()
    create = {"input_file_id": upload["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    missing = client.post("/v1/batches", json=create | {"input_file_id": "file-none"}, headers=H(keys.paid))
    assert missing.status_code == 404, missing.text  # refused by its checks: not charged
    made = [client.post("/v1/batches", json=create, headers=H(keys.paid)) for _ in range(2)]
    assert [(m.status_code, m.headers["x-ratelimit-remaining-requests"]) for m in made] == [(200, "1"), (200, "0")]
    anthropic = {"x-api-key": keys.free}  # the tenant's bucket, any key
    request = {"custom_id": "r", "params": {"model": "tiny", "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "Hi"}]}}
    twice = client.post("/v1/messages/batches", json={"requests": [request, request]}, headers=anthropic)
    assert twice.status_code == 400, twice.text  # a custom_id used twice: refused by its checks, not charged
    # a message batch's create takes from the Message Batches bucket, as Anthropic counts its calls apart
    message_batches = [client.post("/v1/messages/batches", json={"requests": [request]}, headers=anthropic)
                       for _ in range(2)]
    assert [(m.status_code, m.headers["anthropic-ratelimit-requests-remaining"]) for m in message_batches] == [
        (200, "1"), (200, "0")], [m.text for m in message_batches]
    refused = client.post("/v1/batches", json=create, headers=H(keys.paid))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded", refused.text
    assert "requests per minute: limit 2; try again in" in refused.json()["error"]["message"], refused.text
    assert refused.headers["x-ratelimit-limit-requests"] == "2" and int(refused.headers["retry-after"]) >= 29
    refused = client.post("/v1/messages/batches", json={"requests": [request]}, headers=anthropic)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error", refused.text
    assert refused.headers["anthropic-ratelimit-requests-limit"] == "2" and "retry-after" in refused.headers
    assert not any(h.startswith("x-ratelimit-") for h in refused.headers)
    batches = client.get("/v1/batches", headers=H(keys.paid)).json()["data"]
    assert {b["id"] for b in batches} == {m.json()["id"] for m in made}  # the refused creates wrote no batch
    other = client.post("/v1/messages/batches", json={"requests": [request]}, headers={"x-api-key": keys.other})
    assert other.status_code == 200, other.text  # another tenant's buckets are its own


def test_a_counting_routes_refusals_are_counted_apart_from_the_generation_routes(client, keys):
    """The counting routes' refusals were counted in /metrics under limit="requests", with the chat and jobs routes':
    an operator could not tell a tenant hammering /tokenize from one hammering chat. They count under their own
    bucket's name."""
    client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 1}, headers=H(keys.admin))
    assert client.post("/tokenize", json={"prompt": "Hi"}, headers=H(keys.paid)).status_code == 200
    assert client.post("/tokenize", json={"prompt": "Hi"}, headers=H(keys.paid)).status_code == 429
    assert client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 4}, headers=H(keys.paid)).status_code == 201
    metrics = client.get("/metrics", headers=H(keys.admin)).text
    assert f'coserve:rate_limited_requests_total{{limit="counting_requests",tenant_id="{keys.tenant_id}"}} 1.0' \
        in metrics, metrics
    assert f'limit="requests",tenant_id="{keys.tenant_id}"' not in metrics  # no generation request was refused


def test_a_message_batchs_reads_count_against_a_bucket_of_their_own(client, keys):
    """Anthropic limits every Message Batches endpoint by requests per minute, apart from Messages; coserve limited
    the create alone, so a tenant polled, listed and downloaded without bound. Retrieve, list, results, cancel and
    delete take from a bucket of the tenant's requests per minute of their own, with the create (polling does not
    eat what it may send), a results download charged once, before its first byte; over it a 429 in Anthropic's
    shape."""
    client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 4}, headers=H(keys.admin))
    batch = ended_message_batch(client, keys)  # a create and a cancel: two of the Message Batches bucket's four
    anthropic = {"x-api-key": keys.free}  # the tenant's bucket, any key
    polled = client.get(f"/v1/messages/batches/{batch['id']}", headers=anthropic)
    assert polled.status_code == 200 and polled.headers["anthropic-ratelimit-requests-remaining"] == "1", polled.text
    results = client.get(f"/v1/messages/batches/{batch['id']}/results", headers=anthropic)
    assert results.status_code == 200 and results.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert [json.loads(line)["result"]["type"] for line in results.text.splitlines()] == ["canceled", "canceled"]
    listed = client.get("/v1/messages/batches", headers=anthropic)
    assert listed.status_code == 429 and listed.json()["error"]["type"] == "rate_limit_error", listed.text
    assert "requests per minute: limit 4" in listed.json()["error"]["message"], listed.text
    assert listed.headers["anthropic-ratelimit-requests-limit"] == "4" and int(listed.headers["retry-after"]) >= 14
    assert not any(h.startswith("x-ratelimit-") for h in listed.headers)
    deleted = client.delete(f"/v1/messages/batches/{batch['id']}", headers=anthropic)
    assert deleted.status_code == 429, deleted.text  # refused before it deleted anything
    job = {"prompt": "hello", "max_tokens": 4}  # the generation requests' bucket: none of it taken
    statuses = [client.post("/v1/jobs", json=job, headers=H(keys.paid)).status_code for _ in range(5)]
    assert statuses == [201, 201, 201, 201, 429]
    assert client.get(f"/v1/messages/batches/{batch['id']}", headers={"x-api-key": keys.other}).status_code == 404
    metrics = client.get("/metrics", headers=H(keys.admin)).text
    assert f'limit="message_batches_requests",tenant_id="{keys.tenant_id}"}} 2.0' in metrics, metrics


def test_a_message_batch_call_for_a_batch_it_does_not_find_is_charged(client, keys):
    """A retrieve, cancel, delete or results download of a batch coserve does not find (a 404) takes a request from
    the Message Batches bucket, as one that finds it does: Anthropic limits the HTTP requests to every Message
    Batches endpoint, and OpenAI's limits count unsuccessful requests too (help.openai.com/en/articles/5955604:
    resending a failing request does not get round them). The charge comes before the lookup, so a client polling a
    deleted batch, or guessing ids, is held to its rate as one polling a live batch is; the generation requests'
    bucket is untouched."""
    client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 3}, headers=H(keys.admin))
    anthropic = {"x-api-key": keys.paid}
    missing = [client.get("/v1/messages/batches/msgbatch_none", headers=anthropic),
               client.post("/v1/messages/batches/msgbatch_none/cancel", headers=anthropic),
               client.get("/v1/messages/batches/msgbatch_none/results", headers=anthropic)]
    assert [(m.status_code, m.json()["error"]["type"]) for m in missing] == [(404, "not_found_error")] * 3, [
        m.text for m in missing]
    refused = client.delete("/v1/messages/batches/msgbatch_none", headers=anthropic)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error", refused.text
    assert "requests per minute: limit 3" in refused.json()["error"]["message"], refused.text
    assert client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 4}, headers=H(keys.paid)).status_code == 201


def test_the_tokenizers_configuration_and_the_model_list_are_not_limited(client, keys, settings):
    """GET /tokenizer_info and GET /v1/models do the same small work whatever a client sends (the loaded tokenizer's
    configuration, the served model's names), unlike /tokenize and /detokenize, whose work grows with the text: they
    take from no bucket, as vLLM's answer them and as Anthropic and OpenAI list their limits for the routes that
    generate, count tokens or batch. Reading them leaves a tenant's counting and generation buckets whole."""
    client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 1}, headers=H(keys.admin))
    settings.enable_tokenizer_info_endpoint = True
    reads = [client.get(path, headers=H(keys.paid)) for path in ("/tokenizer_info", "/v1/models", "/v1/models/tiny")
             for _ in range(3)]
    assert [r.status_code for r in reads] == [200] * 9, [r.text for r in reads]
    assert not any(h.startswith("x-ratelimit-") for r in reads for h in r.headers)
    tokenized = client.post("/tokenize", json={"prompt": "Hello world"}, headers=H(keys.paid))
    assert tokenized.status_code == 200 and tokenized.headers["x-ratelimit-remaining-requests"] == "0", tokenized.text
    assert client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 4}, headers=H(keys.paid)).status_code == 201


def test_a_message_batch_calls_refusal_after_its_charge_says_where_the_limit_stands(client, keys):
    """A Message Batches call is charged before it looks for the batch, but its 404 (a batch not found) and its 409
    (a delete of a batch not ended) dropped the charge's ``anthropic-ratelimit-*`` headers: a client charged for
    the call could not see its remaining budget on that answer, as Anthropic's and OpenAI's errors show it."""
    client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 5}, headers=H(keys.admin))
    anthropic = {"x-api-key": keys.paid}
    missing = [client.get("/v1/messages/batches/msgbatch_none", headers=anthropic),
               client.post("/v1/messages/batches/msgbatch_none/cancel", headers=anthropic),
               client.get("/v1/messages/batches/msgbatch_none/results", headers=anthropic)]
    assert [(m.status_code, m.headers.get("anthropic-ratelimit-requests-remaining")) for m in missing] == [
        (404, "4"), (404, "3"), (404, "2")], [m.text for m in missing]
    assert all(m.headers["anthropic-ratelimit-requests-limit"] == "5" and "request-id" in m.headers
               for m in missing)
    request = {"custom_id": "r", "params": {"model": "tiny", "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "Hi"}]}}
    made = client.post("/v1/messages/batches", json={"requests": [request]}, headers=anthropic)
    assert made.status_code == 200 and made.headers["anthropic-ratelimit-requests-remaining"] == "1", made.text
    open_batch = client.delete(f"/v1/messages/batches/{made.json()['id']}", headers=anthropic)
    assert open_batch.status_code == 409, open_batch.text  # not ended: a cancel first
    assert open_batch.headers.get("anthropic-ratelimit-requests-remaining") == "0", open_batch.headers
    assert not any(h.startswith("x-ratelimit-") for r in (*missing, open_batch) for h in r.headers)


def test_a_counting_calls_refusal_after_its_charge_says_where_the_limit_stands(client, keys):
    """/tokenize and /detokenize are charged before they look up the model, but their 404 for a model not served
    dropped the charge's ``x-ratelimit-*`` headers (the Responses and Anthropic counts' refusals after their charge
    theirs): a client charged for the call could not see its remaining budget on that answer, as OpenAI's and
    Anthropic's errors show it."""
    client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 4}, headers=H(keys.admin))
    unknown = [client.post("/tokenize", json={"model": "no-such-model", "prompt": "Hi"}, headers=H(keys.paid)),
               client.post("/detokenize", json={"model": "no-such-model", "tokens": [1]}, headers=H(keys.paid))]
    assert [(r.status_code, r.json()["error"]["code"], r.headers.get("x-ratelimit-remaining-requests"))
            for r in unknown] == [(404, "model_not_found", "3"), (404, "model_not_found", "2")], [
        r.text for r in unknown]
    assert all(r.headers["x-ratelimit-limit-requests"] == "4" for r in unknown)
    # a Responses request's count whose previous response is not stored: a 400 after its charge
    gone = client.post("/v1/responses/input_tokens", json={"model": "tiny", "input": "hi",
                                                           "previous_response_id": "resp_none"}, headers=H(keys.paid))
    assert gone.status_code == 400 and gone.headers.get("x-ratelimit-remaining-requests") == "1", gone.text
    counted = client.post("/v1/messages/count_tokens", headers={"x-api-key": keys.paid}, json={
        "model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]})
    assert counted.status_code == 404, counted.text  # Anthropic's count_tokens: its own headers, not OpenAI's
    assert counted.headers.get("anthropic-ratelimit-requests-remaining") == "0", counted.headers
    assert not any(h.startswith("x-ratelimit-") for h in counted.headers)


def failing_worker(settings) -> AbstractContextManager[None]:
    """A worker whose every job fails: each job not yet taken is ended ``failed`` in SQL and on its stream."""

    def fail(rds: redis.Redis, job: Job) -> None:
        with session_scope(settings.database_url) as s:
            row = s.get(Job, job.id)
            row.status, row.attempt, row.finished_at, row.error = (JobStatus.FAILED, 1, datetime.now(UTC),
                                                                   "the engine broke")
        publish(rds, job.id, StreamEvent("end", attempt=1, status="failed", data={"error": "the engine broke"}))

    return taking_jobs(settings, fail)


def test_a_generation_whose_job_failed_says_where_the_limit_stands(settings, client, keys):
    """A generation route is charged as it submits its job; where the job then fails, its error answer dropped the
    charge's headers (the success answer carried them): the client could not see its remaining budget there."""
    client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 9}, headers=H(keys.admin))
    hi = [{"role": "user", "content": "Hi"}]
    with failing_worker(settings):
        answers = [client.post("/v1/chat/completions", json={"model": "tiny", "messages": hi}, headers=H(keys.paid)),
                   client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi"}, headers=H(keys.paid)),
                   client.post("/v1/responses", json={"model": "tiny", "input": "Hi"}, headers=H(keys.paid))]
        message = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": hi},
                              headers={"x-api-key": keys.paid})
    assert [(r.status_code, r.headers.get("x-ratelimit-remaining-requests")) for r in answers] == [
        (500, "8"), (500, "7"), (500, "6")], [r.text for r in answers]
    assert message.status_code == 500 and message.headers.get("anthropic-ratelimit-requests-remaining") == "5", (
        message.text, message.headers)
