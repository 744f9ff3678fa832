"""API keys: generated once, stored as sha256 hashes, looked up per request.

A key is never logged or stored; only its hash and a short prefix (to tell keys apart in
listings) are. Lookups are cached for a few seconds so the hot submit path does one
query less; revoking a key takes effect within ``CACHE_TTL_S``.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import ApiKey, Tenant

log = logging.getLogger(__name__)

KEY_PREFIX = "cs-"
CACHE_TTL_S = 5.0


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key's tenant, tier and rights."""

    key_id: str
    tenant_id: str
    tier: str  # the highest tier this key may request
    is_admin: bool


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def create_tenant(session: Session, name: str, default_tier: str = "paid") -> Tenant:
    tenant = Tenant(name=name, default_tier=default_tier)
    session.add(tenant)
    session.flush()
    return tenant


def create_key(session: Session, tenant: Tenant, *, tier: str | None = None, is_admin: bool = False) -> tuple[ApiKey, str]:
    """Adds a key for ``tenant``; returns the row and the plaintext (shown once)."""
    plaintext = generate_key()
    row = ApiKey(tenant_id=tenant.id, key_hash=hash_key(plaintext), prefix=plaintext[:10],
                 tier=tier, is_admin=is_admin)
    session.add(row)
    session.flush()
    return row, plaintext


_cache: dict[str, tuple[float, Principal | None]] = {}
_cache_lock = threading.Lock()


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


_MISS = object()


def cached_principal(key: str) -> Principal | None | object:
    """The cached answer for ``key`` (a Principal or None), or ``_MISS`` when not cached."""
    with _cache_lock:
        hit = _cache.get(hash_key(key))
    if hit is not None and time.monotonic() - hit[0] < CACHE_TTL_S:
        return hit[1]
    return _MISS


def authenticate(session: Session, key: str) -> Principal | None:
    hit = cached_principal(key)
    if hit is not _MISS:
        return hit  # type: ignore[return-value]
    digest = hash_key(key)
    now = time.monotonic()
    row = session.execute(
        select(ApiKey.id, ApiKey.tenant_id, ApiKey.tier, ApiKey.is_admin, ApiKey.revoked, Tenant.default_tier)
        .join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.key_hash == digest)).first()
    principal = None
    if row is not None and not row.revoked:
        principal = Principal(row.id, row.tenant_id, row.tier or row.default_tier, row.is_admin)
    with _cache_lock:
        if len(_cache) > 10_000:
            _cache.clear()
        _cache[digest] = (now, principal)
    return principal
