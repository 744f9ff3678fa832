"""Admin: create tenants and API keys (keys are shown once)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, HTTPException, status
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from app.api.deps import AdminPrincipal, SessionDep, SettingsDep
from app.auth import create_key, create_tenant
from app.db.models import Tenant
from app.schemas import KeyCreated, TenantCreate

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/admin/tenants", tags=["admin"])


@router.post("", response_model=KeyCreated, status_code=status.HTTP_201_CREATED)
def create_tenant_route(body: TenantCreate, session: SessionDep, settings: SettingsDep,
                        _admin: AdminPrincipal) -> KeyCreated:
    if body.default_tier not in settings.tiers:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"unknown tier {body.default_tier!r}; choose one of {list(settings.tiers)}")
    try:
        tenant = create_tenant(session, body.name, body.default_tier)
        key, plaintext = create_key(session, tenant, is_admin=body.admin)
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise HTTPException(status.HTTP_409_CONFLICT, f"tenant {body.name!r} exists") from exc
    log.info("created tenant %s with key %s", tenant.id, key.prefix)
    return KeyCreated(tenant_id=tenant.id, key_id=key.id, api_key=plaintext, tier=tenant.default_tier,
                      is_admin=key.is_admin)


@router.post("/{tenant_id}/keys", response_model=KeyCreated, status_code=status.HTTP_201_CREATED)
def create_key_route(tenant_id: str, session: SessionDep, settings: SettingsDep, _admin: AdminPrincipal,
                     tier: str | None = None, admin: bool = False) -> KeyCreated:
    tenant = session.scalar(select(Tenant).where(Tenant.id == tenant_id))
    if tenant is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no tenant {tenant_id!r}")
    if tier is not None and tier not in settings.tiers:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"unknown tier {tier!r}; choose one of {list(settings.tiers)}")
    key, plaintext = create_key(session, tenant, tier=tier, is_admin=admin)
    session.commit()
    return KeyCreated(tenant_id=tenant.id, key_id=key.id, api_key=plaintext, tier=tier or tenant.default_tier,
                      is_admin=key.is_admin)
