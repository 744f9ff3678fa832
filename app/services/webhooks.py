"""Webhooks: events a tenant's endpoints subscribed to, signed and delivered until answered.

An event (``batch.completed`` ...) becomes one delivery row per subscribed endpoint, written in the
transaction that made it happen, so none is lost to a crash. Every worker's webhook thread sends
the due rows (``deliver_due``): the body is signed as Standard Webhooks (and OpenAI) sign it —
``webhook-signature: v1,<base64 HMAC-SHA256 of "{webhook-id}.{webhook-timestamp}.{body}">`` with the
endpoint's ``whsec_`` key, and with its previous key too for a day after a rotation that kept it —
which the official client checks with ``client.webhooks.unwrap``. A delivery that gets no 2xx is
retried, the wait doubling from ``webhook_retry_s`` up to an hour, until ``webhook_max_attempts``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

import httpx
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.db.models import WebhookDelivery, WebhookEndpoint, new_id, utcnow
from app.db.session import write_after_read, write_guard
from app.services.transitions import as_utc

log = logging.getLogger(__name__)

# the events coserve raises (a response's: background responses only, as OpenAI's)
EVENT_TYPES = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled", "response.completed",
               "response.failed", "response.cancelled", "response.incomplete")
KEEP_OLD_SECRET = timedelta(hours=24)  # rotate_secret's keep_old_secret_active_for_24_hours
CLAIM_S = 120.0  # a delivery being sent is not due again for this long (a worker that died mid-send)
MAX_RETRY_S = 3600.0


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
    private = next((a for a in addresses if not a.is_global), None)
    return str(private) if private is not None else addresses


@dataclass(frozen=True)
class Target:
    """Where one delivery's POST goes: the URL as given, or, pinned, the URL with the address vetted in place of
    its host, the host kept for the ``Host`` header and TLS (SNI and the certificate's name)."""

    url: str
    host_header: str | None = None
    sni_hostname: str | None = None

    @staticmethod
    def pinned(url: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> Target:
        parts = urlsplit(url)
        at = f"[{address}]" if address.version == 6 else str(address)
        userinfo, _, host = parts.netloc.rpartition("@")
        netloc = (f"{userinfo}@" if userinfo else "") + (at if parts.port is None else f"{at}:{parts.port}")
        return Target(parts._replace(netloc=netloc).geturl(), host, parts.hostname)


def target(url: str, private_targets: bool) -> Target | str:
    """The delivery's target, or why it is not sent. With private targets off the host is resolved once and the
    POST goes to the address that was checked: a name that resolves elsewhere a moment later (DNS rebinding)
    cannot lead it to an internal address."""
    if private_targets:
        return Target(url)
    resolved = _resolve(url)
    if isinstance(resolved, str):
        return f"not sent: {url} resolves to {resolved}, a private address"
    return Target.pinned(url, resolved[0])


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

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def send(endpoint: WebhookEndpoint, webhook_id: str, body: str, timeout_s: float,
         private_targets: bool = True) -> Sent:
    """One signed POST of ``body`` to the endpoint (not made where ``private_targets`` is off and its host now
    resolves to a private address; see ``target``)."""
    to = target(endpoint.url, private_targets)
    if isinstance(to, str):
        return Sent(None, to)
    ts = int(time.time())
    keys = [endpoint.secret]
    if endpoint.old_secret and endpoint.old_secret_until and as_utc(endpoint.old_secret_until) > utcnow():
        keys.append(endpoint.old_secret)
    headers = {"content-type": "application/json", "user-agent": "coserve-webhooks", "webhook-id": webhook_id,
               "webhook-timestamp": str(ts), "webhook-signature": " ".join(signature(k, webhook_id, ts, body)
                                                                           for k in keys)}
    if to.host_header is not None:
        headers["host"] = to.host_header
    try:
        with httpx.Client(timeout=timeout_s) as client:
            r = client.post(to.url, content=body.encode(), headers=headers,
                            extensions={"sni_hostname": to.sni_hostname} if to.sni_hostname else None)
    except (httpx.HTTPError, httpx.InvalidURL, UnicodeError) as exc:  # a URL it cannot send to fails the attempt
        return Sent(None, f"{type(exc).__name__}: {exc}"[:500])
    return Sent(r.status_code, None if r.is_success else r.text[:500])


def deliver_due(session: Session, *, retry_s: float, max_attempts: int, timeout_s: float, limit: int = 50,
                private_targets: bool = True) -> int:
    """Sends the deliveries that are due (each claimed first, so two workers never send one at once); returns how
    many endpoints answered 2xx."""
    now = utcnow()
    due = session.execute(select(WebhookDelivery.id, WebhookDelivery.next_attempt_at).where(
        WebhookDelivery.delivered_at.is_(None), WebhookDelivery.failed_at.is_(None),
        WebhookDelivery.next_attempt_at <= now).order_by(WebhookDelivery.next_attempt_at).limit(limit)).all()
    session.commit()
    delivered = 0
    for delivery_id, when in due:
        with write_guard(session):
            claimed = session.execute(update(WebhookDelivery).where(
                WebhookDelivery.id == delivery_id, WebhookDelivery.next_attempt_at == when,
                WebhookDelivery.delivered_at.is_(None)).values(next_attempt_at=utcnow() + timedelta(seconds=CLAIM_S))
                .returning(WebhookDelivery.endpoint_id, WebhookDelivery.attempts, WebhookDelivery.body,
                           WebhookDelivery.type)).first()
            session.commit()
        if claimed is None:
            continue  # another worker took it, or the endpoint was deleted (its deliveries with it)
        endpoint_id, tried, body, kind = claimed
        endpoint = session.get(WebhookEndpoint, endpoint_id)
        if endpoint is None:
            continue
        attempts = tried + 1
        session.expunge(endpoint)
        session.commit()  # no transaction held while the endpoint answers
        sent = send(endpoint, delivery_id, body, timeout_s, private_targets)
        values: dict = {"attempts": attempts, "last_status": sent.status, "last_error": sent.error}
        if sent.ok:
            values["delivered_at"] = utcnow()
            delivered += 1
        elif attempts >= max_attempts:
            values["failed_at"] = utcnow()
            log.warning("gave up webhook %s (%s) to %s after %d attempts: %s", delivery_id, kind, endpoint.url,
                        attempts, sent.error or sent.status)
        else:
            wait = min(MAX_RETRY_S, retry_s * 2 ** (attempts - 1))
            values["next_attempt_at"] = utcnow() + timedelta(seconds=wait)
        with write_after_read(session):
            session.execute(update(WebhookDelivery).where(WebhookDelivery.id == delivery_id).values(**values))
            session.commit()
    return delivered
