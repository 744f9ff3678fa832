"""OpenAI's Webhook Endpoints API (``/v1/webhook_endpoints``): a tenant's endpoints, their signing secrets, and a
test delivery. What is sent and how: ``app/services/webhooks.py``."""

from __future__ import annotations

import re
from typing import Annotated, Any
from urllib.parse import urlsplit

import httpx
from fastapi import APIRouter, Query
from pydantic import BaseModel, Field
from sqlalchemy import select

from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep
from app.api.errors import openai_responses
from app.db.models import WebhookEndpoint, new_id, utcnow
from app.db.session import write_after_read
from app.openai_schemas import OpenAIError, OpenAIRoute, list_page
from app.services import webhooks
from app.services.transitions import as_utc

router = APIRouter(prefix="/v1/webhook_endpoints", tags=["webhooks"], route_class=OpenAIRoute,
                   responses=openai_responses(401))

# a host name (IDNA-encoded) or an IP address (an IPv6 one without its brackets, perhaps with a zone)
_HOST = re.compile(r"[A-Za-z0-9._:%-]+")
EventTypes = Annotated[list[str], Field(min_length=1, description=f"any of {', '.join(webhooks.EVENT_TYPES)}")]


class EndpointCreate(BaseModel):
    event_types: EventTypes
    name: str = Field(min_length=1, max_length=200)
    url: str = Field(min_length=1, max_length=2000, description="where deliveries are POSTed (http or https)")


class EndpointUpdate(BaseModel):
    event_types: EventTypes | None = None
    name: str | None = Field(None, min_length=1, max_length=200)
    url: str | None = Field(None, min_length=1, max_length=2000)


class RotateSecret(BaseModel):
    keep_old_secret_active_for_24_hours: bool = False


class TestDelivery(BaseModel):
    event_type: str


def _checked(body: EndpointCreate | EndpointUpdate, private_targets: bool) -> None:
    unknown = [t for t in body.event_types or () if t not in webhooks.EVENT_TYPES]
    if unknown:
        raise OpenAIError(400, f"coserve sends no {', '.join(unknown)} events; subscribe to any of "
                               f"{', '.join(webhooks.EVENT_TYPES)}", param="event_types")
    if body.url is not None:
        try:  # what the sender will have to parse, connect to and name (IDNA)
            parts = urlsplit(body.url)
            httpx.URL(body.url)
            host = (parts.hostname or "").encode("idna").decode()
            port = parts.port  # out of 0-65535: a ValueError
        except (ValueError, httpx.InvalidURL) as exc:
            raise OpenAIError(400, f"url {body.url!r} is not a valid URL: {exc}", param="url") from None
        if parts.scheme not in ("http", "https") or not host:
            raise OpenAIError(400, f"url must be an http(s) URL with a host, not {body.url!r}", param="url")
        if not _HOST.fullmatch(host) or port == 0:
            raise OpenAIError(400, f"url {body.url!r} names no host and port a delivery can connect to", param="url")
        if not private_targets and (address := webhooks.private_address(body.url)) is not None:
            raise OpenAIError(400, f"url's host {parts.hostname!r} is {address}, not a public address: this server "
                                   "sends webhooks to public addresses only", param="url")


def _object(e: WebhookEndpoint, secret: bool = False) -> dict[str, Any]:
    out = {"id": e.id, "object": "webhook_endpoint", "created_at": int(as_utc(e.created_at).timestamp()),
           "updated_at": int(as_utc(e.updated_at).timestamp()), "event_types": list(e.event_types), "name": e.name,
           "url": e.url, "signing_secret_hint": webhooks.secret_hint(e.secret)}
    if secret:  # only when it is made (create, rotate_secret)
        out["signing_secret"] = e.secret
    return out


def _own(session, principal, endpoint_id: str, lock: bool = False) -> WebhookEndpoint:
    """The tenant's endpoint (404 where none); ``lock``: read afresh inside a write and held for it (PostgreSQL's
    row lock; SQLite's writers hold the whole database), so a change and a deletion come one after the other."""
    row = session.get(WebhookEndpoint, endpoint_id, with_for_update=lock)
    if row is None or row.tenant_id != principal.tenant_id:
        raise OpenAIError(404, f"No such webhook endpoint: {endpoint_id}", param="webhook_endpoint_id",
                          code="webhook_endpoint_not_found")
    return row


@router.post("", responses=openai_responses(400))
def create(body: EndpointCreate, session: SessionDep, principal: CurrentPrincipal,
           settings: SettingsDep) -> dict[str, Any]:
    _checked(body, settings.webhook_private_targets)
    now = utcnow()
    row = WebhookEndpoint(id=new_id("we"), tenant_id=principal.tenant_id, name=body.name, url=body.url,
                          event_types=list(dict.fromkeys(body.event_types)), secret=webhooks.new_secret(),
                          created_at=now, updated_at=now)
    with write_after_read(session):
        session.add(row)
        session.commit()
    return _object(row, secret=True)


@router.get("", responses=openai_responses(400))
def list_endpoints(session: SessionDep, principal: CurrentPrincipal, after: str | None = None,
                   limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
    rows = list(session.scalars(select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == principal.tenant_id)
                                .order_by(WebhookEndpoint.created_at.desc(), WebhookEndpoint.id.desc())))
    return list_page(rows, after, limit, _object)


@router.get("/{webhook_endpoint_id}", responses=openai_responses(404))
def retrieve(webhook_endpoint_id: str, session: SessionDep, principal: CurrentPrincipal) -> dict[str, Any]:
    return _object(_own(session, principal, webhook_endpoint_id))


@router.post("/{webhook_endpoint_id}", responses=openai_responses(400, 404))
def update_endpoint(webhook_endpoint_id: str, body: EndpointUpdate, session: SessionDep,
                    principal: CurrentPrincipal, settings: SettingsDep) -> dict[str, Any]:
    _checked(body, settings.webhook_private_targets)
    with write_after_read(session):
        row = _own(session, principal, webhook_endpoint_id, lock=True)
        changes = {k: v for k, v in {"name": body.name, "url": body.url,
                                     "event_types": list(dict.fromkeys(body.event_types or ())) or None}.items()
                   if v is not None and v != getattr(row, k)}
        for k, v in changes.items():
            setattr(row, k, v)
        if changes:
            row.updated_at = utcnow()
        session.commit()
    return _object(row)


@router.delete("/{webhook_endpoint_id}", responses=openai_responses(404))
def delete(webhook_endpoint_id: str, session: SessionDep, principal: CurrentPrincipal) -> dict[str, Any]:
    with write_after_read(session):
        session.delete(_own(session, principal, webhook_endpoint_id, lock=True))  # its pending deliveries go with it
        session.commit()
    return {"id": webhook_endpoint_id, "object": "webhook_endpoint.deleted", "deleted": True}


@router.post("/{webhook_endpoint_id}/rotate_secret", responses=openai_responses(400, 404))
def rotate_secret(webhook_endpoint_id: str, session: SessionDep, principal: CurrentPrincipal,
                  body: RotateSecret | None = None) -> dict[str, Any]:
    keep = body is not None and body.keep_old_secret_active_for_24_hours
    with write_after_read(session):
        row, now = _own(session, principal, webhook_endpoint_id, lock=True), utcnow()
        row.old_secret, row.old_secret_until = (row.secret, now + webhooks.KEEP_OLD_SECRET) if keep else (None, None)
        row.secret, row.updated_at = webhooks.new_secret(), now
        session.commit()
    return _object(row, secret=True)


@router.post("/{webhook_endpoint_id}/test", responses=openai_responses(400, 404))
def send_test(webhook_endpoint_id: str, body: TestDelivery, session: SessionDep, principal: CurrentPrincipal,
         settings: SettingsDep) -> dict[str, Any]:
    """Sends a sample ``event_type`` event (about a made-up batch) to the endpoint now, and says what it answered
    (``success``: it was sent and answered, whatever the status); the attempt ends within ``webhook_timeout_s``."""
    row = _own(session, principal, webhook_endpoint_id)
    if body.event_type not in webhooks.EVENT_TYPES:
        raise OpenAIError(400, f"coserve sends no {body.event_type} events; test one of "
                               f"{', '.join(webhooks.EVENT_TYPES)}", param="event_type")
    session.expunge(row)
    session.commit()  # no read transaction held across the request to the endpoint
    sent = webhooks.send(row, new_id("wh"), webhooks.event_body(new_id("evt"), body.event_type, new_id("batch")),
                         settings.webhook_timeout_s, settings.webhook_private_targets)
    if sent.status is None:
        raise OpenAIError(400, f"the endpoint at {row.url} did not answer: {sent.error}", param="url")
    return {"object": "webhook_endpoint.test", "webhook_endpoint_id": row.id, "event_type": body.event_type,
            "status_code": sent.status, "success": True}


event_types_router = APIRouter(prefix="/v1/webhook_event_types", tags=["webhooks"], route_class=OpenAIRoute,
                               responses=openai_responses(401))


@event_types_router.get("")
def list_event_types(principal: CurrentPrincipal) -> dict[str, Any]:
    """The events coserve sends (``client.webhooks.event_types.list()``)."""
    return {"object": "list", "data": list(webhooks.EVENT_TYPES)}
