"""Webhooks: events a tenant's endpoints subscribed to, signed and delivered until answered.

An event (``batch.completed`` ...) becomes one delivery row per subscribed endpoint, written in the
transaction that made it happen, so none is lost to a crash. Every worker's webhook thread sends
the due rows (``deliver_due``): the body is signed as Standard Webhooks (and OpenAI) sign it —
``webhook-signature: v1,<base64 HMAC-SHA256 of "{webhook-id}.{webhook-timestamp}.{body}">`` with the
endpoint's ``whsec_`` key, and with its previous key too for a day after a rotation that kept it —
which the official client checks with ``client.webhooks.unwrap``. A delivery that gets no 2xx is
retried, the wait doubling from ``webhook_retry_s`` up to an hour (or as long as a 429 or 503 answer's
``Retry-After`` asks, within the hour), until ``webhook_max_attempts``. An attempt ends at ``webhook_timeout_s``
whatever the endpoint does, and the due deliveries are sent a few endpoints at a time, one delivery per endpoint at
once: a tenant's slow endpoint holds up neither the others' events nor, for long, its own.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from urllib.parse import urlsplit

import httpx
from sqlalchemy import Select, delete, func, or_, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from app.db.models import Tenant, WebhookDelivery, WebhookEndpoint, new_id, utcnow
from app.db.session import write_after_read, write_guard
from app.services.transitions import as_utc
from app.settings import WEBHOOK_CLAIM_S

log = logging.getLogger(__name__)

# the events coserve raises (a response's: background responses only, as OpenAI's)
EVENT_TYPES = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled", "response.completed",
               "response.failed", "response.cancelled", "response.incomplete")
KEEP_OLD_SECRET = timedelta(hours=24)  # rotate_secret's keep_old_secret_active_for_24_hours
CLAIM_S = WEBHOOK_CLAIM_S  # a delivery being sent is not due again for this long (a worker that died mid-send)
MAX_RETRY_S = 3600.0
SENDERS = 8  # endpoints a worker sends to at once
PER_ENDPOINT = 5  # an endpoint's due deliveries taken in one pass: one endpoint's backlog cannot fill it
ERROR_TEXT = 500  # characters of a failed answer's body kept (and read)


def private_address(url: str) -> str | None:
    """The loopback, private, link-local or otherwise non-public address ``url``'s host resolves to (None: all
    public); a host that does not resolve counts as one (nothing can be said of where it leads)."""
    resolved = _resolve(url)
    return resolved if isinstance(resolved, str) else None


def _resolve(url: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address] | str:
    """Every address ``url``'s host resolves to, or the first that is not public (or the host, unresolved)."""
    host = urlsplit(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return host or url
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    private = next((a for a in addresses if not public(a)), None)
    return str(private) if private is not None else addresses


NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052's well-known prefix: a gateway forwards it to IPv4


def public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether the address and any IPv4 address it carries (mapped, compatible, 6to4, Teredo, NAT64) are public:
    Python counts ``64:ff9b::7f00:1`` global, though a NAT64 gateway takes it to 127.0.0.1."""
    if not address.is_global:
        return False
    if address.version == 4:
        return True
    carried = [address.ipv4_mapped, address.sixtofour, address.teredo[1] if address.teredo else None]
    if address in NAT64 or int(address) >> 32 == 0:  # NAT64, and the deprecated IPv4-compatible ::a.b.c.d
        carried.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return all(v4 is None or v4.is_global for v4 in carried)


@dataclass(frozen=True)
class Target:
    """Where one delivery's POST goes: the URL as given, or, pinned, the URL with the address vetted in place of
    its host, the host kept for the ``Host`` header and TLS (SNI and the certificate's name), as httpx names it
    unpinned: a name with non-ASCII letters in its IDNA (``xn--``) form, the one a header can carry."""

    url: str
    host_header: str | None = None
    sni_hostname: str | None = None

    @staticmethod
    def pinned(url: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> Target:
        parts = urlsplit(url)
        at = f"[{address}]" if address.version == 6 else str(address)
        userinfo, _, _ = parts.netloc.rpartition("@")
        netloc = (f"{userinfo}@" if userinfo else "") + (at if parts.port is None else f"{at}:{parts.port}")
        named = httpx.URL(url)
        return Target(parts._replace(netloc=netloc).geturl(), named.netloc.decode("ascii"),
                      named.raw_host.decode("ascii"))


def targets(url: str, private_targets: bool) -> list[Target] | str:
    """The delivery's targets, to try in turn, or why it is not sent. With private targets off the host is resolved
    once and the POST goes to an address that was checked (each of them is), the next where one does not take the
    connection: a name that resolves elsewhere a moment later (DNS rebinding) cannot lead it to an internal
    address. Unpinned, the URL is the one target (httpx tries each of its host's addresses itself)."""
    if private_targets:
        return [Target(url)]
    resolved = _resolve(url)
    if isinstance(resolved, str):
        return f"not sent: {url} resolves to {resolved}, a private address"
    return [Target.pinned(url, address) for address in dict.fromkeys(resolved)]  # each once (one per socket type)


def logged_url(url: str) -> str:
    """An endpoint's URL as log lines show it: without the credentials or query a tenant may have put in it (a token
    its receiver checks); the tenant sees it whole in its own endpoint object."""
    try:
        return str(httpx.URL(url).copy_with(username=None, password=None, query=None, fragment=None))
    except (httpx.InvalidURL, TypeError, ValueError):
        return "(a URL that does not parse)"


class LoggedUrls(logging.Filter):
    """httpx's INFO line about each request it sent names the URL: an endpoint's as ``logged_url`` shows it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, httpx.URL) for a in record.args):
            record.args = tuple(logged_url(str(a)) if isinstance(a, httpx.URL) else a for a in record.args)
        return True


logging.getLogger("httpx").addFilter(LoggedUrls())


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_hint(secret: str) -> str:
    return f"whsec_...{secret[-4:]}"


def signature(secret: str, webhook_id: str, timestamp: int, body: str) -> str:
    """Standard Webhooks' ``v1,`` signature of one delivery."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{webhook_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def event_body(event_id: str, event_type: str, object_id: str) -> str:
    return json.dumps({"id": event_id, "object": "event", "type": event_type, "created_at": int(time.time()),
                       "data": {"id": object_id}}, separators=(",", ":"))


def emit(session: Session, tenant_id: str, event_type: str, object_id: str) -> int:
    """Queues ``event_type`` about ``object_id`` for each of the tenant's endpoints that subscribed to it, in the
    caller's transaction (the caller commits); returns how many."""
    endpoints = [e for e in session.scalars(select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id))
                 if event_type in e.event_types]
    if not endpoints:
        return 0
    event_id = new_id("evt")
    body = event_body(event_id, event_type, object_id)
    now = utcnow()
    session.add_all(WebhookDelivery(endpoint_id=e.id, event_id=event_id, type=event_type, body=body, created_at=now,
                                    next_attempt_at=now, attempts=0) for e in endpoints)
    return len(endpoints)


@dataclass(frozen=True)
class Sent:
    status: int | None  # the endpoint's HTTP status (None: no answer)
    error: str | None = None
    retry_after: float | None = None  # seconds a 429 or 503 answer asked to wait before the next attempt

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def send(endpoint: WebhookEndpoint, webhook_id: str, body: str, timeout_s: float,
         private_targets: bool = True) -> Sent:
    """One signed POST of ``body`` to the endpoint (not made where ``private_targets`` is off and its host now
    resolves to a private address; see ``target``), over in ``timeout_s`` whatever the endpoint does: httpx's
    timeout bounds each read, so an endpoint that trickles its answer a byte at a time would hold the sender for
    ever; a deadline cancels the attempt instead."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_attempt(endpoint, webhook_id, body, timeout_s, private_targets))
    finally:
        loop.close()  # without waiting for a name lookup the deadline abandoned


async def _attempt(endpoint: WebhookEndpoint, webhook_id: str, body: str, timeout_s: float,
                   private_targets: bool) -> Sent:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with _client(timeout_s, pinned=not private_targets) as client:
        try:
            async with asyncio.timeout_at(deadline):  # the lookup, connecting, the request and the answer's head
                tos = await loop.run_in_executor(None, targets, endpoint.url, private_targets)
                if isinstance(tos, str):
                    return Sent(None, tos)
                answer = await _first_answer(client, tos, endpoint, webhook_id, body, deadline)
        except TimeoutError:
            return Sent(None, f"TimeoutError: no answer within {timeout_s:g} s")
        except (httpx.HTTPError, httpx.InvalidURL, UnicodeError) as exc:  # a URL it cannot send to fails the attempt
            return Sent(None, f"{type(exc).__name__}: {exc}"[:500])
        try:
            return await _answered(answer, deadline)
        finally:
            await answer.aclose()


def _client(timeout_s: float, pinned: bool) -> httpx.AsyncClient:
    """The attempt's client. Unpinned, it goes through the proxy the environment names (``HTTPS_PROXY``,
    ``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY``), as the operator's other outbound HTTP does. Pinned, never through a
    proxy: the proxy would resolve the name again itself (or connect where its own network leads), past the check;
    a transport of its own keeps httpx from reading the environment's proxies, not its ``SSL_CERT_FILE``."""
    return httpx.AsyncClient(timeout=timeout_s, transport=httpx.AsyncHTTPTransport() if pinned else None)


async def _first_answer(client: httpx.AsyncClient, tos: list[Target], endpoint: WebhookEndpoint, webhook_id: str,
                        body: str, deadline: float) -> httpx.Response:
    """The answer (its head) from the first of ``tos`` that takes the connection. Each may connect for its share of
    the time left, so one that drops the connection attempt silently leaves the others time; one that refuses or
    does not connect in its share is passed for the next, and the last one's error is the attempt's. Nothing is
    sent twice: once connected, the answer, or its error, is the attempt's."""
    loop = asyncio.get_running_loop()
    for i, to in enumerate(tos[:-1]):
        connect_s = max(0.0, deadline - loop.time()) / (len(tos) - i)
        try:
            return await client.send(_post(client, to, endpoint, webhook_id, body, connect_s), stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            continue  # refused, unreachable, or silent for its share: the next address
    return await client.send(_post(client, tos[-1], endpoint, webhook_id, body), stream=True)


def _post(client: httpx.AsyncClient, to: Target, endpoint: WebhookEndpoint, webhook_id: str, body: str,
          connect_s: float | None = None) -> httpx.Request:
    """The signed POST to ``to``; ``connect_s``: how long it may take to connect (the client's timeout otherwise)."""
    timeout = client.timeout if connect_s is None else httpx.Timeout(client.timeout.read, connect=connect_s)
    return client.build_request("POST", to.url, content=body.encode(),
                                headers=_signed_headers(endpoint, webhook_id, body, to), timeout=timeout,
                                extensions={"sni_hostname": to.sni_hostname} if to.sni_hostname else None)


def _signed_headers(endpoint: WebhookEndpoint, webhook_id: str, body: str, to: Target) -> dict[str, str]:
    ts = int(time.time())
    keys = [endpoint.secret]
    if endpoint.old_secret and endpoint.old_secret_until and as_utc(endpoint.old_secret_until) > utcnow():
        keys.append(endpoint.old_secret)
    headers = {"content-type": "application/json", "user-agent": "coserve-webhooks", "webhook-id": webhook_id,
               "webhook-timestamp": str(ts), "webhook-signature": " ".join(signature(k, webhook_id, ts, body)
                                                                           for k in keys)}
    if to.host_header is not None:
        headers["host"] = to.host_header
    return headers


async def _answered(answer: httpx.Response, deadline: float) -> Sent:
    """What the endpoint answered: a 2xx's body is not read; of another, what of its start arrives by the deadline."""
    if answer.is_success:
        return Sent(answer.status_code)
    text = b""
    try:
        async with asyncio.timeout_at(deadline):
            async for chunk in answer.aiter_bytes():
                text += chunk
                if len(text) >= ERROR_TEXT:
                    break
    except (TimeoutError, httpx.HTTPError):
        pass  # the status is the answer; the text only explains it
    wait = retry_after(answer.headers.get("retry-after")) if answer.status_code in (429, 503) else None
    return Sent(answer.status_code, text[:ERROR_TEXT].decode(answer.encoding or "utf-8", "replace"), wait)


def retry_after(value: str | None) -> float | None:
    """The seconds a ``Retry-After`` header asks for (delay-seconds or an HTTP date); None: none, or unreadable."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    when = when if when.tzinfo is not None else when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


@dataclass(frozen=True)
class Policy:
    """How deliveries are sent and retried (the ``webhook_*`` settings)."""

    retry_s: float
    max_attempts: int
    timeout_s: float
    private_targets: bool = True

    def wait(self, attempts: int, asked: float | None) -> float:
        """Seconds before the next attempt: the doubling backoff, or longer where the endpoint asked, up to the
        maximum."""
        # the exponent held inside a float's: 2 ** 1024 overflows it (webhook_max_attempts has no ceiling), and the
        # doubling is at the hour long before
        doubled = self.retry_s * 2.0 ** min(attempts - 1, 1023)
        return min(MAX_RETRY_S, max(doubled, asked or 0.0))


def deliver_due(session: Session, *, retry_s: float, max_attempts: int, timeout_s: float, limit: int = 50,
                private_targets: bool = True) -> int:
    """Sends the deliveries that are due (each claimed first, so two workers never send one at once); returns how
    many endpoints answered 2xx. The endpoints are sent to ``SENDERS`` at a time, each one's deliveries one after
    the other until one fails; no send starts after the first ``timeout_s``, so a pass lasts at most about two
    timeouts whatever the endpoints do."""
    lanes = _due_by_endpoint(session, limit)
    session.commit()
    if not lanes:
        return 0
    policy = Policy(retry_s, max_attempts, timeout_s, private_targets)
    lane = partial(_deliver_lane, session.get_bind(), policy, time.monotonic() + timeout_s)
    with ThreadPoolExecutor(min(SENDERS, len(lanes)), thread_name_prefix="webhook-send") as pool:
        return sum(pool.map(lane, lanes))


def _due_by_endpoint(session: Session, limit: int) -> list[list[tuple[str, datetime]]]:
    """The due deliveries (id, next_attempt_at), at most ``PER_ENDPOINT`` of an endpoint, grouped by endpoint, the
    longest due first."""
    lanes: dict[str, list[tuple[str, datetime]]] = {}
    for delivery_id, endpoint_id, when in session.execute(due_query(limit)):
        lanes.setdefault(endpoint_id, []).append((delivery_id, when))
    return list(lanes.values())


def due_query(limit: int) -> Select:
    """The due deliveries' (id, endpoint_id, next_attempt_at), the longest due first, at most ``PER_ENDPOINT`` of
    one endpoint; read from the index of pending deliveries (``ix_webhook_deliveries_pending``)."""
    rank = func.row_number().over(partition_by=WebhookDelivery.endpoint_id,
                                  order_by=(WebhookDelivery.next_attempt_at, WebhookDelivery.id))
    due = select(WebhookDelivery.id, WebhookDelivery.endpoint_id, WebhookDelivery.next_attempt_at,
                 rank.label("rank")).where(WebhookDelivery.delivered_at.is_(None), WebhookDelivery.failed_at.is_(None),
                                           WebhookDelivery.next_attempt_at <= utcnow(),
                                           WebhookDelivery.endpoint_id.not_in(held_endpoints())).subquery()
    return (select(due.c.id, due.c.endpoint_id, due.c.next_attempt_at).where(due.c.rank <= PER_ENDPOINT)
            .order_by(due.c.next_attempt_at, due.c.id).limit(limit))


def held_endpoints() -> Select:
    """The endpoints whose deliveries are held: a disabled tenant's, not sent nor dropped: they go out if an operator
    enables it again (the cancels its disabling made among them), as a paused endpoint keeps its messages."""
    return select(WebhookEndpoint.id).join(Tenant, Tenant.id == WebhookEndpoint.tenant_id).where(Tenant.disabled)


def _deliver_lane(bind: Engine | Connection, policy: Policy, starts_until: float,
                  lane: list[tuple[str, datetime]]) -> int:
    """Sends one endpoint's due deliveries in turn (its own session: one per thread); stops at the first that
    fails (the endpoint is down or slow: the rest wait for their next pass) or at ``starts_until``."""
    delivered = 0
    with Session(bind, expire_on_commit=False) as session:
        for delivery_id, when in lane:
            if time.monotonic() > starts_until:
                break
            sent = _deliver_one(session, delivery_id, when, policy)
            if sent is None:
                continue
            if not sent.ok:
                break
            delivered += 1
    return delivered


def _deliver_one(session: Session, delivery_id: str, when: datetime, policy: Policy) -> Sent | None:
    """Claims, sends and records one delivery; None where another worker took it, its endpoint is gone or held (its
    tenant disabled since the pass read it), or no longer subscribes to its event type (then it is closed unsent)."""
    with write_guard(session):
        claimed = session.execute(update(WebhookDelivery).where(
            WebhookDelivery.id == delivery_id, WebhookDelivery.next_attempt_at == when,
            WebhookDelivery.delivered_at.is_(None), WebhookDelivery.endpoint_id.not_in(held_endpoints()))
            .values(next_attempt_at=utcnow() + timedelta(seconds=CLAIM_S))
            .returning(WebhookDelivery.endpoint_id, WebhookDelivery.attempts, WebhookDelivery.body,
                       WebhookDelivery.type, WebhookDelivery.next_attempt_at)).first()
        session.commit()
    if claimed is None:
        return None  # another worker took it, the endpoint was deleted (its deliveries with it), or it is held
    endpoint_id, tried, body, kind, claim = claimed
    endpoint = session.get(WebhookEndpoint, endpoint_id)
    if endpoint is None:
        return None
    session.expunge(endpoint)
    session.commit()  # no transaction held while the endpoint answers
    if kind not in endpoint.event_types:
        # the tenant dropped the type after the event: what it no longer wants is not sent, queued or not (Svix
        # stops a removed or disabled endpoint's attempts too); closed, to show why, until the retention deletes it
        _record(session, delivery_id, claim, {"failed_at": utcnow(), "last_error": f"not sent: the endpoint no "
                                                                                  f"longer subscribes to {kind}"})
        return None
    sent = send(endpoint, delivery_id, body, policy.timeout_s, policy.private_targets)
    attempts = tried + 1
    values: dict = {"attempts": attempts, "last_status": sent.status, "last_error": sent.error}
    if sent.ok:
        values["delivered_at"] = utcnow()
    elif attempts >= policy.max_attempts:
        values["failed_at"] = utcnow()
        shown = logged_url(endpoint.url)
        log.warning("gave up webhook %s (%s) to endpoint %s at %s after %d attempts: %s", delivery_id, kind,
                    endpoint.id, shown, attempts, str(sent.error or sent.status).replace(endpoint.url, shown))
    else:
        values["next_attempt_at"] = utcnow() + timedelta(seconds=policy.wait(attempts, sent.retry_after))
    _record(session, delivery_id, claim, values)
    return sent


def _record(session: Session, delivery_id: str, claim: datetime, values: dict) -> None:
    """Writes what came of a claimed delivery, while the claim is still this sender's: one that stalled past it
    (another worker claimed, sent and recorded the delivery meanwhile) writes neither its attempts nor its answer over
    the newer ones."""
    with write_after_read(session):
        kept = session.execute(update(WebhookDelivery).where(
            WebhookDelivery.id == delivery_id, WebhookDelivery.next_attempt_at == claim).values(**values)).rowcount
        session.commit()
    if not kept:
        log.info("webhook %s: its claim lapsed while it was sent; another sender's attempt stands", delivery_id)


def delete_settled(session: Session, kept_for: timedelta, limit: int = 5000) -> int:
    """Deletes up to ``limit`` deliveries made more than ``kept_for`` ago that were delivered or given up (the
    sweeper's, every sweep); returns how many."""
    old = select(WebhookDelivery.id).where(WebhookDelivery.created_at < utcnow() - kept_for, or_(
        WebhookDelivery.delivered_at.is_not(None), WebhookDelivery.failed_at.is_not(None))).limit(limit)
    with write_after_read(session):
        deleted = session.execute(delete(WebhookDelivery).where(WebhookDelivery.id.in_(old))
                                  .execution_options(synchronize_session=False)).rowcount
        session.commit()
    return deleted
