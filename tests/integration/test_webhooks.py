"""OpenAI's Webhook Endpoints API with the official client (real app, real SQLite migrated by Alembic), and the
signed deliveries: checked with the client's own ``webhooks.unwrap``, retried until answered, given up on."""

from __future__ import annotations

import json
import re
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import openai
import pytest
from sqlalchemy import select, update

from app.db.models import Tenant, WebhookDelivery, WebhookEndpoint, utcnow
from app.db.session import session_scope
from app.services.transitions import as_utc
from app.services.webhooks import CLAIM_S, EVENT_TYPES, deliver_due, emit, new_secret
from tests.sql_statements import query_plan, statements

pytestmark = pytest.mark.integration


def client_for(client, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=key, http_client=client, max_retries=0)


@pytest.fixture
def oai(client, keys) -> openai.OpenAI:
    return client_for(client, keys.paid)


def test_endpoints_are_created_listed_changed_and_deleted_per_tenant(oai, client, keys):
    made = oai.webhooks.create(event_types=["batch.completed", "batch.failed"], name="pipeline",
                               url="https://example.com/hooks")
    assert made.signing_secret.startswith("whsec_") and made.signing_secret_hint.endswith(made.signing_secret[-4:])
    assert made.object == "webhook_endpoint" and made.event_types == ["batch.completed", "batch.failed"]
    got = oai.webhooks.retrieve(made.id)
    assert got.url == "https://example.com/hooks" and not hasattr(got, "signing_secret")
    assert [e.id for e in oai.webhooks.list()] == [made.id]

    changed = oai.webhooks.update(made.id, name="renamed", event_types=["batch.expired"])
    assert (changed.name, changed.event_types, changed.url) == ("renamed", ["batch.expired"], made.url)

    other = client_for(client, keys.other)  # another tenant sees none of it
    assert list(other.webhooks.list()) == []
    with pytest.raises(openai.NotFoundError):
        other.webhooks.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        other.webhooks.delete(made.id)

    gone = oai.webhooks.delete(made.id)
    assert gone.deleted and gone.object == "webhook_endpoint.deleted"
    with pytest.raises(openai.NotFoundError):
        oai.webhooks.retrieve(made.id)


@pytest.mark.parametrize("fields, param", [
    ({"event_types": ["eval.run.succeeded"]}, "event_types"),
    ({"event_types": []}, "event_types"),
    ({"url": "ftp://example.com/x"}, "url"),
    ({"url": "not a url"}, "url"),
    ({"url": "http://[::1"}, "url"), ({"url": "http://ex\uff03ample.com/"}, "url"),  # a 500 before
    ({"url": "http://a..b/x"}, "url"), ({"url": "http://a\u0000b/x"}, "url"),  # accepted, then never sendable
    ({"url": "http://example.com:99999/x"}, "url"), ({"url": "http://[::1]:65536/x"}, "url"),
    ({"url": "http://example.com:0/x"}, "url"), ({"url": "http://exa mple.com/x"}, "url"),
])
def test_bad_endpoints_are_400s_naming_the_field(oai, fields, param):
    body = {"event_types": ["batch.completed"], "name": "n", "url": "https://example.com/h", **fields}
    with pytest.raises(openai.BadRequestError) as exc:
        oai.webhooks.create(**body)
    assert param in (exc.value.body.get("param") or ""), exc.value.body


def test_a_test_delivery_is_signed_as_the_official_client_checks(oai, webhook_receiver):
    made = oai.webhooks.create(event_types=["batch.completed"], name="t", url=webhook_receiver.url)
    webhook_receiver.statuses.append(204)
    result = oai.webhooks.test(made.id, event_type="batch.completed")
    assert (result.status_code, result.success, result.webhook_endpoint_id) == (204, True, made.id)
    body, headers = webhook_receiver.received[-1]
    event = oai.webhooks.unwrap(body, headers, secret=made.signing_secret)
    assert event.type == "batch.completed" and event.data.id.startswith("batch_")
    with pytest.raises(openai.InvalidWebhookSignatureError):
        oai.webhooks.unwrap(body, headers, secret="whsec_" + "A" * 44)

    kept = oai.webhooks.rotate_secret(made.id, keep_old_secret_active_for_24_hours=True)
    assert kept.signing_secret != made.signing_secret
    oai.webhooks.test(made.id, event_type="batch.failed")
    body, headers = webhook_receiver.received[-1]
    for secret in (kept.signing_secret, made.signing_secret):  # both sign for a day
        assert oai.webhooks.unwrap(body, headers, secret=secret).type == "batch.failed"
    fresh = oai.webhooks.rotate_secret(made.id)  # the old ones stop at once
    oai.webhooks.test(made.id, event_type="batch.expired")
    body, headers = webhook_receiver.received[-1]
    assert oai.webhooks.unwrap(body, headers, secret=fresh.signing_secret).type == "batch.expired"
    for secret in (kept.signing_secret, made.signing_secret):
        with pytest.raises(openai.InvalidWebhookSignatureError):
            oai.webhooks.unwrap(body, headers, secret=secret)

    webhook_receiver.statuses.append(500)  # an answer, but not a 2xx: sent, as the SDK's success says
    result = oai.webhooks.test(made.id, event_type="batch.completed")
    assert (result.status_code, result.success) == (500, True)
    with pytest.raises(openai.BadRequestError):  # nothing listens there
        dead = oai.webhooks.update(made.id, url="http://127.0.0.1:9/none")
        oai.webhooks.test(dead.id, event_type="batch.completed")


def test_an_event_is_retried_until_answered_and_given_up_after_its_attempts(oai, db_url, keys, webhook_receiver):
    made = oai.webhooks.create(event_types=["batch.completed"], name="r", url=webhook_receiver.url)
    oai.webhooks.create(event_types=["batch.failed"], name="not this one", url=webhook_receiver.url)
    webhook_receiver.statuses.extend([500, 503])
    with session_scope(db_url) as s:
        assert emit(s, keys.tenant_id, "batch.completed", "batch_abc") == 1
        s.commit()
        send = {"retry_s": 30.0, "max_attempts": 5, "timeout_s": 5.0}
        assert deliver_due(s, **send) == 0  # 500
        row = s.scalars(select(WebhookDelivery)).one()
        assert (row.attempts, row.last_status, row.delivered_at) == (1, 500, None)
        assert deliver_due(s, **send) == 0  # not due for 30 s
        for _ in range(2):  # time passes: due again, then 503, then 200
            s.execute(update(WebhookDelivery).values(next_attempt_at=utcnow() - timedelta(seconds=1)))
            s.commit()
            delivered = deliver_due(s, **send)
        assert delivered == 1
        s.refresh(row)
        assert row.attempts == 3 and row.delivered_at is not None and row.last_status == 200
    bodies = {b for b, _ in webhook_receiver.received}
    ids = {h["webhook-id"] for _, h in webhook_receiver.received}
    assert len(webhook_receiver.received) == 3 and len(bodies) == 1 and ids == {row.id}  # the same message each time
    event = oai.webhooks.unwrap(bodies.pop(), webhook_receiver.received[-1][1], secret=made.signing_secret)
    assert (event.type, event.data.id) == ("batch.completed", "batch_abc")

    webhook_receiver.statuses.extend([500] * 5)
    with session_scope(db_url) as s:
        emit(s, keys.tenant_id, "batch.completed", "batch_def")
        s.commit()
        assert deliver_due(s, retry_s=30.0, max_attempts=1, timeout_s=5.0) == 0
        last = s.scalars(select(WebhookDelivery).where(WebhookDelivery.body.contains("batch_def"))).one()
        assert last.failed_at is not None and last.attempts == 1  # given up: not due again
        s.execute(update(WebhookDelivery).values(next_attempt_at=utcnow() - timedelta(seconds=1)))
        s.commit()
        assert deliver_due(s, retry_s=30.0, max_attempts=1, timeout_s=5.0) == 0
    assert sum(b"batch_def" in b for b, _ in webhook_receiver.received) == 1
    assert json.loads(webhook_receiver.received[-1][0])["type"] == "batch.completed"


def test_a_disabled_tenants_deliveries_are_held_until_it_is_enabled(oai, db_url, keys, webhook_receiver):
    oai.webhooks.create(event_types=["batch.cancelled"], name="held", url=webhook_receiver.url)
    with session_scope(db_url) as s:
        assert emit(s, keys.tenant_id, "batch.cancelled", "batch_held") == 1
        s.execute(update(Tenant).where(Tenant.id == keys.tenant_id).values(disabled=True))
        s.commit()
        assert deliver_due(s, retry_s=30.0, max_attempts=5, timeout_s=5.0) == 0
        row = s.scalars(select(WebhookDelivery)).one()
        assert (row.attempts, row.delivered_at, row.failed_at) == (0, None, None)  # held: not tried, not dropped
        s.execute(update(Tenant).where(Tenant.id == keys.tenant_id).values(disabled=False))
        s.commit()
        assert deliver_due(s, retry_s=30.0, max_attempts=5, timeout_s=5.0) == 1
    assert [json.loads(b)["data"]["id"] for b, _ in webhook_receiver.received] == ["batch_held"]


def test_a_background_responses_end_is_an_event_and_other_jobs_ends_are_not(oai, db_url, keys):
    """The transition that ends a job writes the event: cancelled, failed, expired, completed, or incomplete (its
    max_output_tokens reached), for background Responses API jobs only."""
    from app.db.models import Job, JobStatus
    from app.services.transitions import transition

    oai.webhooks.create(event_types=["response.completed", "response.failed", "response.cancelled",
                                     "response.incomplete"], name="r", url="https://example.com/h")
    background = {"endpoint": "/v1/responses", "response": {"background": True, "store": True}}
    cases = [(background, JobStatus.CANCELLED, None, "response.cancelled"),
             (background, JobStatus.FAILED, None, "response.failed"),
             (background, JobStatus.EXPIRED, None, "response.failed"),
             (background, JobStatus.SUCCEEDED, "stop", "response.completed"),
             (background, JobStatus.SUCCEEDED, "length", "response.incomplete"),
             ({"endpoint": "/v1/responses", "response": {"store": True}}, JobStatus.SUCCEEDED, "stop", None),
             ({"endpoint": "/v1/chat/completions"}, JobStatus.CANCELLED, None, None)]
    with session_scope(db_url) as s:
        for i, (kind, to, reason, _) in enumerate(cases):
            s.add(Job(id=f"job_{i:024d}", tenant_id=keys.tenant_id, kind="interactive", tier="paid", model="tiny",
                      sampling={}, status="running", **kind))
        s.commit()
        for i, (_, to, reason, _) in enumerate(cases):  # ends that settle as they are written (a worker's)
            assert transition(s, f"job_{i:024d}", JobStatus.RUNNING, to,
                              values={"finish_reason": reason, "settled_at": utcnow()})
            assert not transition(s, f"job_{i:024d}", JobStatus.RUNNING, to)  # ended once: one event
        s.commit()
        sent = {json.loads(d.body)["data"]["id"]: d.type for d in s.scalars(select(WebhookDelivery))}
    assert sent == {f"resp_{i:024d}": event for i, (*_, event) in enumerate(cases) if event is not None}


def test_with_private_targets_off_internal_urls_are_refused_and_never_called(settings, keys, db_url,
                                                                             webhook_receiver):
    from fastapi.testclient import TestClient

    from app.auth import clear_cache
    from app.main import create_app

    clear_cache()
    with TestClient(create_app(settings.model_copy(update={"webhook_private_targets": False}))) as strict:
        oai = client_for(strict, keys.paid)
        # and IPv6 addresses that carry an internal IPv4 one (Python counts them global): NAT64, IPv4-compatible,
        # 6to4, Teredo
        for url in (webhook_receiver.url, "http://localhost:9/x", "http://10.1.2.3/x", "http://[::1]/x",
                    "http://169.254.169.254/latest/meta-data", "http://[64:ff9b::7f00:1]/x", "http://[::7f00:1]/x",
                    "http://[2002:a01:203::1]/x", "http://[2001:0:4136:e378:8000:63bf:f5fe:fdfc]/x"):
            with pytest.raises(openai.BadRequestError) as exc:
                oai.webhooks.create(event_types=["batch.completed"], name="n", url=url)
            assert exc.value.body["param"] == "url" and "public" in exc.value.body["message"], exc.value.body
        public = oai.webhooks.create(event_types=["batch.completed"], name="n", url="https://93.184.215.14/hook")
        with pytest.raises(openai.BadRequestError):
            oai.webhooks.update(public.id, url=webhook_receiver.url)
        oai.webhooks.delete(public.id)
    with session_scope(db_url) as s:  # made while they were allowed: its events are not sent now
        s.add(WebhookEndpoint(id="we_internal", tenant_id=keys.tenant_id, name="n", url=webhook_receiver.url,
                              event_types=["batch.completed"], secret=new_secret()))
        s.commit()
        emit(s, keys.tenant_id, "batch.completed", "batch_x")
        s.commit()
        assert deliver_due(s, retry_s=30.0, max_attempts=3, timeout_s=5.0, private_targets=False) == 0
        row = s.scalars(select(WebhookDelivery)).one()
        assert row.attempts == 1 and "private address" in row.last_error
    assert webhook_receiver.received == []


def test_with_private_targets_off_a_delivery_goes_to_the_address_that_was_checked(keys, db_url, webhook_receiver,
                                                                                  monkeypatch):
    """DNS rebinding: the endpoint's name answers a vetted address to the check and another one after it. The POST
    goes to the checked address (the name resolved once), with the name as its Host. Loopback stands in for a
    public address here (the check is told it is public), and the rebound answer is another loopback address
    the receiver does not listen on."""
    import ipaddress
    import socket


    real = socket.getaddrinfo
    answers = iter(["127.0.0.1", "127.0.0.2", "127.0.0.2"])
    asked = []

    def rebinding(host, *args, **kwargs):
        if host != "hooks.rebind.test":
            return real(host, *args, **kwargs)
        asked.append(host)
        return real(next(answers), *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.setattr(ipaddress.IPv4Address, "is_global", property(lambda self: True))
    port = webhook_receiver.url.split(":")[2].split("/")[0]
    with session_scope(db_url) as s:
        s.add(WebhookEndpoint(id="we_rebind", tenant_id=keys.tenant_id, name="n", event_types=["batch.completed"],
                              url=f"http://hooks.rebind.test:{port}/hook", secret=new_secret()))
        s.commit()
        emit(s, keys.tenant_id, "batch.completed", "batch_rebind")
        s.commit()
        assert deliver_due(s, retry_s=30.0, max_attempts=3, timeout_s=5.0, private_targets=False) == 1
    assert asked == ["hooks.rebind.test"]  # resolved once, for the check
    ((body, headers),) = webhook_receiver.received
    assert json.loads(body)["data"]["id"] == "batch_rebind" and headers["host"] == f"hooks.rebind.test:{port}"


def _pinned_delivery(keys, db_url, receiver, monkeypatch, host: str, resolve) -> tuple[str, dict]:
    """One event delivered with private targets off to ``http://{host}:<the receiver's port>/hook``, names resolved
    by ``resolve`` (loopback standing in for public addresses): the port, and the headers the receiver got."""
    import ipaddress
    import socket

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(ipaddress.IPv4Address, "is_global", property(lambda self: True))
    port = receiver.url.split(":")[2].split("/")[0]
    with session_scope(db_url) as s:
        add_endpoint(s, keys.tenant_id, f"http://{host}:{port}/hook")
        emit(s, keys.tenant_id, "batch.completed", "batch_pinned")
        s.commit()
        assert deliver_due(s, retry_s=30.0, max_attempts=3, timeout_s=5.0, private_targets=False) == 1, \
            s.scalars(select(WebhookDelivery.last_error)).all()
    ((body, headers),) = receiver.received
    assert json.loads(body)["data"]["id"] == "batch_pinned"
    return port, headers


def test_with_private_targets_off_an_endpoint_with_an_international_name_is_delivered_to(keys, db_url,
                                                                                        webhook_receiver, monkeypatch):
    """A host name with non-ASCII letters (IDNA): the pinned POST names it as DNS and TLS do (its xn-- form) in its
    Host header. Its Unicode form there was no header httpx could send: every attempt failed, then it was given up
    on. Loopback stands in for a public address, as above."""
    import socket

    real = socket.getaddrinfo

    def resolve(host, *a, **kw):
        return real("127.0.0.1" if host in ("bücher.test", "xn--bcher-kva.test") else host, *a, **kw)
    port, headers = _pinned_delivery(keys, db_url, webhook_receiver, monkeypatch, "Bücher.test", resolve)
    assert headers["host"] == f"xn--bcher-kva.test:{port}"


def test_a_pinned_target_keeps_the_host_for_tls_and_the_host_header():
    import ipaddress

    from app.services.webhooks import Target

    t = Target.pinned("https://u:p@hooks.example.com:8443/a?b=1", ipaddress.ip_address("93.184.215.14"))
    assert t == Target("https://u:p@93.184.215.14:8443/a?b=1", "hooks.example.com:8443", "hooks.example.com")
    t = Target.pinned("https://hooks.example.com/a", ipaddress.ip_address("2606:2800:21f:cb07:6820:80da:af6b:8b2c"))
    assert t.url == "https://[2606:2800:21f:cb07:6820:80da:af6b:8b2c]/a" and t.host_header == "hooks.example.com"


def test_a_delivery_to_a_url_that_cannot_be_sent_to_counts_its_attempts(keys, db_url):
    with session_scope(db_url) as s:  # stored before URLs were checked this closely
        s.add(WebhookEndpoint(id="we_bad", tenant_id=keys.tenant_id, name="n", url="http://a..b/x",
                              event_types=["batch.completed"], secret=new_secret()))
        s.commit()
        emit(s, keys.tenant_id, "batch.completed", "batch_x")
        s.commit()
        assert deliver_due(s, retry_s=30.0, max_attempts=1, timeout_s=5.0) == 0
        row = s.scalars(select(WebhookDelivery)).one()
        assert row.attempts == 1 and row.failed_at is not None and row.last_status is None and row.last_error


def test_a_change_raced_by_the_endpoints_deletion_is_a_404(settings, keys):
    """The change reads the endpoint afresh inside its write: one that a deletion overtook answered 500 (the row it
    had read was gone by its UPDATE), on SQLite as on PostgreSQL (tests/integration/test_postgres.py)."""
    import threading

    from fastapi.testclient import TestClient

    from app.main import create_app

    auth = {"Authorization": f"Bearer {keys.paid}"}
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        for _ in range(10):
            hook = client.post("/v1/webhook_endpoints", headers=auth, json={
                "url": "https://example.com/hook", "event_types": ["batch.completed"], "name": "n"}).json()["id"]
            start, answers = threading.Barrier(2), {}

            def call(name, method, path, body=None):
                start.wait()
                answers[name] = client.request(method, path, headers=auth, json=body).status_code
            threads = [threading.Thread(target=call, args=("change", "POST", f"/v1/webhook_endpoints/{hook}",
                                                           {"name": "m"})),
                       threading.Thread(target=call, args=("delete", "DELETE", f"/v1/webhook_endpoints/{hook}"))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert answers["change"] in (200, 404) and answers["delete"] == 200, answers


def test_the_event_types_are_listed_as_the_official_client_reads_them(oai):
    assert oai.webhooks.event_types.list().data == list(EVENT_TYPES)


def test_the_wait_before_an_attempt_stays_at_the_hour_however_many_came_before():
    """``webhook_max_attempts`` has no ceiling: past its 1025th attempt the doubling overflowed a float, the
    attempt went unrecorded, and the delivery was sent again at every claim's end (for ever) instead of hourly."""
    from app.services.webhooks import MAX_RETRY_S, Policy

    policy = Policy(retry_s=5.0, max_attempts=5000, timeout_s=10.0)
    assert [policy.wait(n, None) for n in (1, 2, 11, 1025, 4999)] == [5.0, 10.0, MAX_RETRY_S, MAX_RETRY_S, MAX_RETRY_S]


def test_the_timeout_is_kept_well_inside_the_claim_of_a_delivery_being_sent():
    from pydantic import ValidationError

    from app.settings import Settings

    with pytest.raises(ValidationError):
        Settings(webhook_timeout_s=CLAIM_S)


@contextmanager
def scripted_endpoint(answer: Callable[[socketserver.BaseRequestHandler], None]) -> Iterator[str]:
    """An HTTP endpoint that reads each POST whole, then lets ``answer`` write to the connection as it likes
    (``self.request``): trickle, hang, or ask to be called later."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            data = b""
            while b"\r\n\r\n" not in data and (chunk := self.request.recv(65536)):
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
            while len(body) < length and (chunk := self.request.recv(65536)):
                body += chunk
            try:
                answer(self)
            except OSError:
                pass  # the sender hung up

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        server.shutdown()
        server.server_close()


def trickled(head: bytes, then: bytes, for_s: float = 40.0):
    """Answers ``head`` at once, then ``then`` over and over a byte every 0.2 s, for ``for_s``: every read the
    sender makes gets a byte well inside any per-read timeout."""
    def answer(handler):
        handler.request.sendall(head)
        ends = time.monotonic() + for_s
        while time.monotonic() < ends:
            for byte in then:
                handler.request.sendall(bytes([byte]))
                time.sleep(0.2)
    return answer


def answered(status: str, headers: str = ""):
    def answer(handler):
        handler.request.sendall(f"HTTP/1.1 {status}\r\n{headers}content-length: 0\r\n\r\n".encode())
    return answer


def add_endpoint(s, tenant_id: str, url: str, event_type: str = "batch.completed", name: str = "we_x") -> None:
    s.add(WebhookEndpoint(id=name, tenant_id=tenant_id, name="n", url=url, event_types=[event_type],
                          secret=new_secret()))
    s.commit()


@pytest.mark.parametrize("head, then, status", [
    (b"HTTP/1.1 200 OK\r\n", b"x-slow: 1\r\n", None),  # the head trickles: no answer by the deadline
    (b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n", b"x", 200),  # delivered: a 2xx's body is not read
    (b"HTTP/1.1 500 Oops\r\ncontent-length: 100000\r\n\r\n", b"x", 500),  # what of its text came in time
])
def test_an_attempt_ends_at_the_timeout_however_slowly_the_endpoint_answers(keys, db_url, head, then, status):
    """httpx's timeout bounds each read: an endpoint trickling its answer held the worker's webhook thread (and
    the delivery's claim ran out, so another worker sent it again) for as long as it liked."""
    with scripted_endpoint(trickled(head, then)) as url, session_scope(db_url) as s:
        add_endpoint(s, keys.tenant_id, url)
        emit(s, keys.tenant_id, "batch.completed", "batch_slow")
        s.commit()
        started = time.monotonic()
        deliver_due(s, retry_s=30.0, max_attempts=3, timeout_s=1.0)
        took = time.monotonic() - started
        row = s.scalars(select(WebhookDelivery)).one()
    assert took < 15, f"the attempt took {took:.1f} s"  # the endpoint trickles for 40 s
    assert (row.attempts, row.last_status) == (1, status), (row.last_status, row.last_error)
    assert status == 200 or "within 1 s" in row.last_error or row.last_error.startswith("x")


def test_a_test_delivery_ends_at_the_timeout(settings, keys):
    """``/test`` sends from the API's threadpool: a trickling endpoint held a thread for ever per call."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    with scripted_endpoint(trickled(b"HTTP/1.1 200 OK\r\n", b"x-slow: 1\r\n")) as url, \
            TestClient(create_app(settings.model_copy(update={"webhook_timeout_s": 1.0}))) as api:
        oai = client_for(api, keys.paid)
        made = oai.webhooks.create(event_types=["batch.completed"], name="slow", url=url)
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as exc:
            oai.webhooks.test(made.id, event_type="batch.completed")
        took = time.monotonic() - started
    assert took < 15 and "within 1 s" in exc.value.body["message"], (took, exc.value.body)


def test_a_hanging_endpoint_holds_up_neither_another_tenants_events_nor_its_own_backlog(keys, db_url):
    """The endpoints are sent to at once, an endpoint's deliveries one after the other until one fails: the
    hanging endpoint answers only once the other tenant's event arrived, so it has to be sent meanwhile."""
    other_arrived = threading.Event()

    def hang(handler):
        other_arrived.wait(20)
        answered("500 Internal Server Error")(handler)

    def ok(handler):
        other_arrived.set()
        answered("200 OK")(handler)

    with scripted_endpoint(hang) as slow, scripted_endpoint(ok) as fast, session_scope(db_url) as s:
        globex = s.scalar(select(Tenant.id).where(Tenant.name == "globex"))
        add_endpoint(s, globex, slow, "batch.failed", name="we_hang")
        add_endpoint(s, keys.tenant_id, fast, name="we_ok")
        for i in range(10):  # the hanging endpoint's are due first
            emit(s, globex, "batch.failed", f"batch_{i}")
        s.commit()
        emit(s, keys.tenant_id, "batch.completed", "batch_ok")
        s.commit()
        assert deliver_due(s, retry_s=30.0, max_attempts=3, timeout_s=2.0) == 1
        tried = s.execute(select(WebhookDelivery.attempts, WebhookDelivery.last_status)
                          .where(WebhookDelivery.endpoint_id == "we_hang")).all()
    assert sorted(tried, key=lambda t: -t[0]) == [(1, 500)] + [(0, None)] * 9, tried


@pytest.mark.parametrize("retry_after, wait_s", [("600", 600), ("in two hours", 3600)])  # a date, capped
def test_the_next_attempt_waits_as_long_as_a_retry_after_asks(keys, db_url, retry_after, wait_s):
    if retry_after == "in two hours":  # written here: a test id must not change between collections
        retry_after = format_datetime(datetime.now(UTC) + timedelta(hours=2), usegmt=True)
    with scripted_endpoint(answered("429 Too Many Requests", f"retry-after: {retry_after}\r\n")) as url, \
            session_scope(db_url) as s:
        add_endpoint(s, keys.tenant_id, url)
        emit(s, keys.tenant_id, "batch.completed", "batch_busy")
        s.commit()
        before = utcnow()
        deliver_due(s, retry_s=1.0, max_attempts=5, timeout_s=5.0)
        row = s.scalars(select(WebhookDelivery)).one()
    assert row.last_status == 429
    waited = (as_utc(row.next_attempt_at) - before).total_seconds()
    assert wait_s - 60 < waited <= wait_s + 60, waited


def test_settled_deliveries_go_after_the_retention_and_the_due_query_reads_pending_ones_only(keys, db_url):
    """Given-up rows stayed in the due index's range for ever, slowing every poll of every worker."""
    from app.services.webhooks import delete_settled, due_query

    old, new = utcnow() - timedelta(days=8), utcnow() - timedelta(days=1)
    with session_scope(db_url) as s:
        add_endpoint(s, keys.tenant_id, "https://example.com/h")
        for name, made, settled in (("wh_delivered", old, {"delivered_at": old}), ("wh_gaveup", old,
                                    {"failed_at": old}), ("wh_pending", old, {}), ("wh_recent", new,
                                    {"delivered_at": new})):
            s.add(WebhookDelivery(id=name, endpoint_id="we_x", event_id="evt", type="batch.completed", body="{}",
                                  created_at=made, next_attempt_at=made, **settled))
        s.commit()
        assert delete_settled(s, timedelta(days=7)) == 2
        assert set(s.scalars(select(WebhookDelivery.id))) == {"wh_pending", "wh_recent"}
        with statements(with_parameters=True) as seen:
            s.execute(due_query(50)).all()
        plan = query_plan(s.connection(), *seen[-1])
    assert "ix_webhook_deliveries_pending" in plan, plan


def test_a_sender_whose_claim_lapsed_does_not_write_over_the_next_senders_delivery(oai, db_url, keys,
                                                                                   webhook_receiver, monkeypatch):
    """A sender stalls past its claim: another worker claims the delivery, sends it and records it delivered; the
    first one's late answer (a 500, its last attempt) is not recorded over it (the delivery showed delivered and
    given up, with the 500)."""
    from app.services import webhooks

    oai.webhooks.create(event_types=["batch.completed"], name="late", url=webhook_receiver.url)
    webhook_receiver.statuses.extend([200, 500])  # the second sender's answer, then the stalled one's
    real = webhooks.send
    send = {"retry_s": 30.0, "max_attempts": 1, "timeout_s": 5.0}

    def stalled_past_its_claim(*args, **kwargs):
        monkeypatch.setattr(webhooks, "send", real)
        with session_scope(db_url) as other:  # meanwhile its claim lapses and another worker delivers it
            other.execute(update(WebhookDelivery).values(next_attempt_at=utcnow() - timedelta(seconds=1)))
            other.commit()
            assert deliver_due(other, **send) == 1
        return real(*args, **kwargs)

    with session_scope(db_url) as s:
        emit(s, keys.tenant_id, "batch.completed", "batch_late")
        s.commit()
        monkeypatch.setattr(webhooks, "send", stalled_past_its_claim)
        deliver_due(s, **send)
        row = s.scalars(select(WebhookDelivery)).one()
        assert (row.attempts, row.last_status, row.failed_at) == (1, 200, None) and row.delivered_at is not None
    assert len(webhook_receiver.received) == 2


def test_a_deliverys_log_lines_show_no_credentials_of_its_url(oai, db_url, keys, caplog, webhook_receiver):
    """A tenant's URL may carry a token its receiver checks (user:password@, ?token=): the log lines of a delivery
    (httpx's about the request it sent, the one that gives a delivery up) show the URL without them."""
    made = oai.webhooks.create(event_types=["batch.completed"], name="t",
                               url="http://hook-user:pw-s3cret@127.0.0.1:9/hook?token=tok-s3cret")
    oai.webhooks.create(event_types=["batch.completed"], name="ok", url=webhook_receiver.url + "?token=tok-s3cret")
    with session_scope(db_url) as s, caplog.at_level("DEBUG"):
        assert emit(s, keys.tenant_id, "batch.completed", "batch_abc") == 2
        s.commit()
        assert deliver_due(s, retry_s=30.0, max_attempts=1, timeout_s=5.0) == 1  # nothing listens at the first
    assert "HTTP Request: POST " + webhook_receiver.url in caplog.text
    given_up = [r.getMessage() for r in caplog.records if "gave up webhook" in r.getMessage()]
    assert given_up and made.id in given_up[0] and "http://127.0.0.1:9/hook" in given_up[0], given_up
    assert "s3cret" not in caplog.text


def test_a_cancelled_responses_event_is_sent_once_what_its_worker_produced_can_be_read(oai, db_url, keys,
                                                                                      webhook_receiver):
    """A background response cancelled while a worker ran it shows its output so far and its usage once that worker
    writes them, after the cancel: its ``response.cancelled`` goes out then (or once the sweeper settles an end whose
    worker died), so the receiver that fetches the response at the event sees what it will keep. It went out with the
    cancel, and the fetch showed a response with no output and no usage, for good as far as the event said."""
    from app.db.models import Job, JobStatus
    from app.responses_schemas import job_id_of
    from app.services.cancel import stop_job_ids
    from workers import lease as leases

    oai.webhooks.create(event_types=["response.cancelled"], name="r", url=webhook_receiver.url)
    made = [oai.responses.create(model="tiny", input="hi", background=True) for _ in range(2)]
    seen: dict[str, object] = {}

    def deliver(s) -> None:  # the receiver fetches each response it hears of, as a handler does
        deliver_due(s, retry_s=30.0, max_attempts=5, timeout_s=5.0)
        for body, _ in webhook_receiver.received:
            resp_id = json.loads(body)["data"]["id"]
            seen.setdefault(resp_id, oai.responses.retrieve(resp_id).usage)

    with session_scope(db_url) as s:
        jobs = {r.id: job_id_of(r.id) for r in made}
        held = {r: leases.acquire(s, job, "w1", lease_s=30) for r, job in jobs.items()}
        assert stop_job_ids(s, list(jobs.values()), JobStatus.CANCELLED, "cancelled by the client", None) == 2
        deliver(s)
        first, second = made
        assert leases.keep_cancelled(s, held[first.id], {"output_text": "so", "prompt_tokens": 1,
                                                         "completion_tokens": 1})
        deliver(s)
        s.execute(update(Job).where(Job.id == jobs[second.id]).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        s.commit()
        assert leases.settle_lapsed(s, utcnow(), 10) == 1  # its worker died: the end settles as it stands
        s.commit()
        deliver(s)
    assert seen[first.id] is not None and seen[first.id].output_tokens == 1, seen  # its usage, at its event
    assert list(seen) == [first.id, second.id] and len(webhook_receiver.received) == 2


@pytest.mark.parametrize("private_targets, through_proxy", [(False, False), (True, True)])
def test_a_pinned_delivery_never_goes_through_the_proxy_the_environment_names(keys, db_url, webhook_receiver,
                                                                              monkeypatch, private_targets,
                                                                              through_proxy):
    """With private targets off the POST goes to the address that was checked, never to a proxy named by the
    environment (it would connect where it resolves the name itself, past the check); allowed, it goes through that
    proxy as the operator's other outbound HTTP does. Loopback stands in for a public address, as above."""
    import ipaddress

    proxied = []

    def proxy(handler):
        proxied.append(1)
        handler.request.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    monkeypatch.setattr(ipaddress.IPv4Address, "is_global", property(lambda self: True))
    for name in ("no_proxy", "NO_PROXY", "HTTP_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    with scripted_endpoint(proxy) as proxy_url, session_scope(db_url) as s:
        for name in ("http_proxy", "all_proxy"):
            monkeypatch.setenv(name, proxy_url.removesuffix("/hook"))
        add_endpoint(s, keys.tenant_id, webhook_receiver.url)
        emit(s, keys.tenant_id, "batch.completed", "batch_proxy")
        s.commit()
        assert deliver_due(s, retry_s=30.0, max_attempts=3, timeout_s=5.0, private_targets=private_targets) == 1
    assert (len(proxied), len(webhook_receiver.received)) == ((1, 0) if through_proxy else (0, 1))


def test_with_private_targets_off_a_delivery_goes_to_the_next_checked_address_where_one_is_down(keys, db_url,
                                                                                              webhook_receiver,
                                                                                              monkeypatch):
    """A name with two addresses, the first refusing connections: the attempt goes on to the second (checked as
    well) and is delivered; only the first was tried before, and every attempt failed. Loopback stands in for public
    addresses, 127.0.0.2 (where the receiver does not listen) for one that is down."""
    import socket

    real = socket.getaddrinfo

    def resolve(host, *a, **kw):  # the first address down, the second the receiver's
        if host != "hooks.two.test":
            return real(host, *a, **kw)
        return real("127.0.0.2", *a, **kw) + real("127.0.0.1", *a, **kw)
    port, headers = _pinned_delivery(keys, db_url, webhook_receiver, monkeypatch, "hooks.two.test", resolve)
    assert headers["host"] == f"hooks.two.test:{port}"


def test_a_queued_event_the_endpoint_no_longer_subscribes_to_is_closed_unsent(oai, db_url, keys, webhook_receiver):
    made = oai.webhooks.create(event_types=["batch.completed", "batch.failed"], name="d", url=webhook_receiver.url)
    with session_scope(db_url) as s:
        emit(s, keys.tenant_id, "batch.completed", "batch_dropped")
        emit(s, keys.tenant_id, "batch.failed", "batch_kept")
        s.commit()
        oai.webhooks.update(made.id, event_types=["batch.failed"])
        assert deliver_due(s, retry_s=30.0, max_attempts=5, timeout_s=5.0) == 1
        dropped = s.scalars(select(WebhookDelivery).where(WebhookDelivery.type == "batch.completed")).one()
        assert (dropped.attempts, dropped.delivered_at) == (0, None) and dropped.failed_at is not None
        assert "no longer subscribes to batch.completed" in dropped.last_error
    assert [json.loads(b)["data"]["id"] for b, _ in webhook_receiver.received] == ["batch_kept"]


def test_a_tenant_disabled_after_a_pass_read_its_deliveries_gets_none_of_them(oai, db_url, keys, webhook_receiver):
    """The pass reads the due deliveries, then sends them one endpoint after another for up to a timeout: a tenant
    disabled in between had them sent all the same."""
    from app.services.webhooks import Policy, _deliver_lane, _due_by_endpoint

    oai.webhooks.create(event_types=["batch.cancelled"], name="held", url=webhook_receiver.url)
    with session_scope(db_url) as s:
        emit(s, keys.tenant_id, "batch.cancelled", "batch_raced")
        s.commit()
        (lane,) = _due_by_endpoint(s, 50)
        s.execute(update(Tenant).where(Tenant.id == keys.tenant_id).values(disabled=True))
        s.commit()
        policy = Policy(retry_s=30.0, max_attempts=5, timeout_s=5.0)
        assert _deliver_lane(s.get_bind(), policy, time.monotonic() + 5.0, lane) == 0
        row = s.scalars(select(WebhookDelivery)).one()
        assert (row.attempts, row.delivered_at, row.failed_at) == (0, None, None)  # held, as the pass would have
        s.execute(update(Tenant).where(Tenant.id == keys.tenant_id).values(disabled=False))
        s.commit()
        assert deliver_due(s, retry_s=30.0, max_attempts=5, timeout_s=5.0) == 1
    assert [json.loads(b)["data"]["id"] for b, _ in webhook_receiver.received] == ["batch_raced"]


def test_a_redirect_is_not_followed_and_counts_as_a_failure(keys, db_url, webhook_receiver):
    """A 3xx is no 2xx: the Location is not followed (the endpoint's URL is what the tenant gave and was checked),
    and the delivery is retried as after any other failure, as the README says."""
    with scripted_endpoint(answered("307 Temporary Redirect", f"location: {webhook_receiver.url}\r\n")) as url, \
            session_scope(db_url) as s:
        add_endpoint(s, keys.tenant_id, url)
        emit(s, keys.tenant_id, "batch.completed", "batch_moved")
        s.commit()
        assert deliver_due(s, retry_s=30.0, max_attempts=3, timeout_s=5.0) == 0
        row = s.scalars(select(WebhookDelivery)).one()
        assert (row.attempts, row.last_status, row.delivered_at, row.failed_at) == (1, 307, None, None)
        assert as_utc(row.next_attempt_at) > utcnow()  # retried later
    assert webhook_receiver.received == []
