"""Admin: tenants (create, list, their rate limits, disable) and their API keys: create (keys are shown once), list,
revoke."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, HTTPException, Query, Request, status
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.api.deps import AdminPrincipal, SessionDep, SettingsDep, key_cache
from app.api.errors import CheckedRoute, responses, unprocessable
from app.auth import Principal, admin_key_left, announce_revocation, create_key, create_tenant
from app.batch.fanout import cancel_and_count
from app.db.session import write_after_read
from app.db.models import ApiKey, Batch, Job, JobStatus, Tenant
from app.schemas import KeyCreate, KeyCreated, KeyPublic, TenantCreate, TenantLimits, TenantPublic, TenantUpdate
from app.services.cancel import stop_job_ids
from app.services.transitions import NOT_TERMINAL
from app.settings import Settings
from app.summarize import service as summarize_service

log = logging.getLogger(__name__)

# one prefix for both admin resources: the app's router list stays as it is
router = APIRouter(prefix="/v1/admin", tags=["admin"], route_class=CheckedRoute, responses=responses(401, 403))


@router.post("/tenants", response_model=KeyCreated, status_code=status.HTTP_201_CREATED,
             responses=responses(409, 413))
def create_tenant_route(body: TenantCreate, session: SessionDep, settings: SettingsDep,
                        _admin: AdminPrincipal) -> KeyCreated:
    default_tier = settings.default_tier if body.default_tier is None else body.default_tier
    if default_tier not in settings.tiers:
        raise unprocessable(f"unknown tier {default_tier!r}; choose one of {list(settings.tiers)}",
                            "body", "default_tier")
    try:
        tenant = create_tenant(session, body.name, default_tier)
        for field in TenantLimits.model_fields:
            setattr(tenant, field, getattr(body, field))
        key, plaintext = create_key(session, tenant, is_admin=body.admin)
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise HTTPException(status.HTTP_409_CONFLICT, f"tenant {body.name!r} exists") from exc
    log.info("created tenant %s with key %s", tenant.id, key.prefix)
    return KeyCreated(tenant_id=tenant.id, key_id=key.id, api_key=plaintext, tier=tenant.default_tier,
                      is_admin=key.is_admin)


@router.get("/tenants", response_model=list[TenantPublic])
def list_tenants_route(session: SessionDep, _admin: AdminPrincipal) -> list[TenantPublic]:
    """Every tenant, by name, with its default tier and rate limits."""
    return [TenantPublic.model_validate(t) for t in session.scalars(select(Tenant).order_by(Tenant.name))]


@router.get("/tenants/{tenant_id}", response_model=TenantPublic, responses=responses(404))
def get_tenant_route(tenant_id: str, session: SessionDep, _admin: AdminPrincipal) -> TenantPublic:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no tenant {tenant_id!r}")
    return TenantPublic.model_validate(tenant)


@router.patch("/tenants/{tenant_id}", response_model=TenantPublic, responses=responses(404, 409))
def update_tenant_route(tenant_id: str, body: TenantUpdate, request: Request, session: SessionDep,
                        settings: SettingsDep, admin: AdminPrincipal, background: BackgroundTasks) -> TenantPublic:
    """Sets the tenant's rate limits and batch queue limit: the fields given (null: no limit), the others as they
    were. Every API process applies rate limits within its key cache's few seconds (this one at once); the queue
    limit applies to batches validated from then on. ``disabled: true`` refuses its keys on every API process
    (403) and cancels its open batches and jobs; ``false`` lets its keys in again."""
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no tenant {tenant_id!r}")
    changes = {field: getattr(body, field) for field in body.model_fields_set}
    if changes:
        with write_after_read(session):
            if body.disabled:
                refuse_tenant_lockout(session, tenant_id, admin)  # inside the write: two admins disabling each other
            session.execute(update(Tenant).where(Tenant.id == tenant_id).values(**changes))
            session.commit()
    key_cache(request).clear()
    if "disabled" in changes:
        announce_revocation(settings.redis_url)  # every process looks its keys up again
    if body.disabled:
        _cancel_open_work(session, settings, tenant_id, background)
    tenant = session.get(Tenant, tenant_id)
    log.info("tenant %s limits: %s requests, %s tokens per minute, %s batch queue tokens", tenant.id,
             tenant.requests_per_minute, tenant.tokens_per_minute, tenant.batch_queue_tokens)
    return TenantPublic.model_validate(tenant)


def _cancel_open_work(session: Session, settings: Settings, tenant_id: str, background: BackgroundTasks) -> None:
    """Cancels a disabled tenant's open batches (with their jobs; a validating one's lines counted after the answer
    where its fan-out died: ``fanout.count_if_abandoned``), its summarization runs (with theirs) and then its other
    open jobs."""
    runs = summarize_service.cancel_tenant_runs(settings, tenant_id)
    batches = session.scalars(select(Batch).where(Batch.tenant_id == tenant_id, Batch.status.in_(
        ("validating", "in_progress", "cancelling")))).all()
    for batch in batches:
        cancel_and_count(session, settings, batch, background.add_task)
    open_jobs = session.scalars(select(Job.id).where(Job.tenant_id == tenant_id, Job.status.in_(NOT_TERMINAL)))
    stopped = stop_job_ids(session, list(open_jobs), JobStatus.CANCELLED, "cancelled: its tenant was disabled",
                           settings.redis_url)
    log.info("tenant %s disabled: %d batches, %d summarization runs and %d other jobs cancelled", tenant_id,
             len(batches), runs, stopped)


@router.post("/tenants/{tenant_id}/keys", response_model=KeyCreated, status_code=status.HTTP_201_CREATED,
             responses=responses(404))
def create_key_route(tenant_id: str, session: SessionDep, settings: SettingsDep, _admin: AdminPrincipal,
                     body: KeyCreate | None = None,
                     tier: Annotated[str | None, Query(deprecated=True, description="the body's tier")] = None,
                     admin: Annotated[bool, Query(deprecated=True, description="the body's admin")] = False,
                     ) -> KeyCreated:
    """A key of the tenant, of the body's ``tier`` (unset: the tenant's default tier), an admin key where ``admin``
    is true. The query parameters of the same names, read before the body was, still work where no body is sent."""
    tenant = session.scalar(select(Tenant).where(Tenant.id == tenant_id))
    if tenant is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no tenant {tenant_id!r}")
    where = "query"
    if body is not None:
        if tier is not None or admin:
            raise unprocessable("give tier and admin in the JSON body, not also as query parameters", "query",
                                "tier" if tier is not None else "admin")
        tier, admin, where = body.tier, body.admin, "body"
    if tier is not None and tier not in settings.tiers:
        raise unprocessable(f"unknown tier {tier!r}; choose one of {list(settings.tiers)}", where, "tier")
    with write_after_read(session):
        key, plaintext = create_key(session, tenant, tier=tier, is_admin=admin)
        session.commit()
    return KeyCreated(tenant_id=tenant.id, key_id=key.id, api_key=plaintext, tier=tier or tenant.default_tier,
                      is_admin=key.is_admin)


@router.get("/tenants/{tenant_id}/keys", response_model=list[KeyPublic], responses=responses(404))
def list_keys_route(tenant_id: str, session: SessionDep, _admin: AdminPrincipal) -> list[KeyPublic]:
    if session.get(Tenant, tenant_id) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no tenant {tenant_id!r}")
    rows = session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at))
    return [KeyPublic.model_validate(k) for k in rows]


def refuse_admin_lockout(session: Session, key: ApiKey, caller: Principal) -> None:
    """409 where revoking ``key`` would lock the operator out: it is the key the request came with, or the last
    active admin key (``COSERVE_ADMIN_KEY`` is one of the stored admin keys too; an admin key of a disabled tenant
    lets no one in)."""
    if key.revoked or not key.is_admin:
        return
    if key.id == caller.key_id:
        raise HTTPException(status.HTTP_409_CONFLICT, "an admin key cannot revoke itself: create another admin key "
                            "first (POST /v1/admin/tenants/{tenant_id}/keys with admin: true) and revoke this one "
                            "with it")
    if not admin_key_left(session, revoking=key.id):
        raise HTTPException(status.HTTP_409_CONFLICT, f"{key.id} is the last active admin key: create another admin "
                            "key first (POST /v1/admin/tenants/{tenant_id}/keys with admin: true)")


def refuse_tenant_lockout(session: Session, tenant_id: str, caller: Principal) -> None:
    """409 where disabling the tenant would lock the operator out: it holds the admin key the request came with, or
    every other active admin key of an enabled tenant (``admin_key_left``: two admins disabling each other's tenants
    at once)."""
    if tenant_id == caller.tenant_id:
        raise HTTPException(status.HTTP_409_CONFLICT, "this admin key's own tenant cannot be disabled with it")
    if not admin_key_left(session, disabling=tenant_id):
        raise HTTPException(status.HTTP_409_CONFLICT, f"tenant {tenant_id} holds the last active admin keys: create "
                            "an admin key of another tenant first (POST /v1/admin/tenants/{tenant_id}/keys with "
                            "admin: true)")


@router.post("/keys/{key_id}/revoke", response_model=KeyPublic, responses=responses(404, 409))
def revoke_key_route(key_id: str, request: Request, session: SessionDep, settings: SettingsDep,
                     admin: AdminPrincipal) -> KeyPublic:
    """Revokes a key for good (idempotent). Every API process refuses it from its next request on
    (the revocation token in Redis changes; see ``app.auth``). The key the request came with, and the last
    active admin key, are refused (409): the operator would be locked out."""
    key = session.get(ApiKey, key_id)
    if key is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no API key {key_id!r}")
    if not key.revoked:
        with write_after_read(session):
            refuse_admin_lockout(session, key, admin)  # inside the write: two admins revoking each other
            key.revoked = True
            session.commit()
        log.info("revoked API key %s", key.id)
    key_cache(request).clear()
    announce_revocation(settings.redis_url)  # also when it was already revoked: a retry repairs a lost one
    return KeyPublic.model_validate(key)
