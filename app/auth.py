"""API keys: generated once, stored as sha256 hashes, looked up per request.

A key is never logged or stored; only its hash and a short prefix (to tell keys apart in
listings) are. Each API process caches lookups for a few seconds (``KeyCache``) so the hot
submit path does one query less. Revocation is immediate on every process: revoking a key
(API or CLI) writes a new token to ``REVOCATIONS`` in Redis, every request reads that token
(one GET), and a cached answer counts only under the token it was looked up under. Without
Redis (unset or unreachable) nothing cached is trusted but the revoking process's own
cleared cache and, with Redis unset (one process), ``CACHE_TTL_S``.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import ApiKey, Tenant
from app.services.rate_limits import Limits

log = logging.getLogger(__name__)

KEY_PREFIX = "cs-"
CACHE_TTL_S = 5.0
REVOCATIONS = "coserve:auth:revocations"  # changes (a random token) on every revocation
REDIS_RETRY_S = 1.0  # after a failed read of the token, skip Redis (and the cache) this long


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key's tenant, tier and rights."""

    key_id: str
    tenant_id: str
    tier: str  # the highest tier this key may request
    is_admin: bool
    limits: Limits = field(default_factory=Limits)  # the tenant's rate limits (API requests; none for pipelines)
    tenant_disabled: bool = False  # an operator disabled the tenant: the API refuses the key (403)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def create_tenant(session: Session, name: str, default_tier: str = "paid") -> Tenant:
    tenant = Tenant(name=name, default_tier=default_tier)
    session.add(tenant)
    session.flush()
    return tenant


def create_key(session: Session, tenant: Tenant, *, tier: str | None = None,
               is_admin: bool = False) -> tuple[ApiKey, str]:
    """Adds a key for ``tenant``; returns the row and the plaintext (shown once)."""
    plaintext = generate_key()
    row = ApiKey(tenant_id=tenant.id, key_hash=hash_key(plaintext), prefix=plaintext[:10],
                 tier=tier, is_admin=is_admin)
    session.add(row)
    session.flush()
    return row, plaintext


def admin_key_left(session: Session, *, revoking: str | None = None, disabling: str | None = None) -> bool:
    """Whether an active admin key of an enabled tenant is left once key ``revoking`` is revoked or tenant
    ``disabling`` disabled: the rule that keeps the operator from locking themselves out (the admin API and
    ``coserve keys revoke`` refuse a write that leaves none). Call it inside the write: it locks every active admin
    key's row and its tenant's until the transaction ends, so on PostgreSQL a second such write (two admins revoking
    each other's keys, disabling each other's tenants, or one of each) waits for the first's commit and then reads it
    (SQLite: its write lock serializes them; no FOR UPDATE there). All of them in one order: two such writes never
    each hold a row the other waits for. FOR NO KEY UPDATE: a key or job inserted for one of these tenants (its
    foreign key's KEY SHARE) does not wait."""
    rows = session.execute(select(ApiKey.id, ApiKey.tenant_id, Tenant.disabled).join(
        Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.is_admin.is_(True), ApiKey.revoked.is_(False))
        .order_by(ApiKey.id).with_for_update(key_share=True))
    return any(key_id != revoking and tenant_id != disabling and not disabled
               for key_id, tenant_id, disabled in rows)


_MISS = object()
_UNKNOWN = object()  # the revocation token could not be read: trust nothing cached


class KeyCache:
    """One API process's cache of key lookups, each trusted while it is younger than ``ttl_s`` and the
    revocation token in Redis is still the one read before it was looked up.

    ``stamp()`` reads the token (call it before the lookup, so a revocation committed during the lookup
    changes it); ``get(key, stamp)`` answers a Principal, None (an unknown or revoked key) or ``_MISS``."""

    def __init__(self, redis_url: str | None = None, ttl_s: float = CACHE_TTL_S) -> None:
        self.redis_url, self.ttl_s = redis_url, ttl_s
        self._entries: dict[str, tuple[float, object, Principal | None]] = {}
        self._lock = threading.Lock()
        self._redis = (redis.Redis.from_url(redis_url, socket_connect_timeout=0.5, socket_timeout=0.5)
                       if redis_url else None)
        self._down_until = 0.0

    def stamp(self) -> object:
        if self._redis is None:
            return None  # one process: its own revocations clear the cache, the TTL covers the rest
        if time.monotonic() < self._down_until:
            return _UNKNOWN
        try:
            return self._redis.get(REVOCATIONS)
        except redis.RedisError as exc:
            log.warning("cannot read the key revocation token from Redis (%s); looking every key up for %.0fs",
                        exc, REDIS_RETRY_S)
            self._down_until = time.monotonic() + REDIS_RETRY_S
            return _UNKNOWN

    def get(self, key: str, stamp: object) -> Principal | None | object:
        if stamp is _UNKNOWN:
            return _MISS
        with self._lock:
            hit = self._entries.get(hash_key(key))
        if hit is None or hit[1] != stamp or time.monotonic() - hit[0] >= self.ttl_s:
            return _MISS
        return hit[2]

    def put(self, key: str, stamp: object, principal: Principal | None, since: float) -> None:
        """Caches a lookup that started at ``since`` (monotonic) under ``stamp``."""
        if stamp is _UNKNOWN:
            return
        with self._lock:
            if len(self._entries) > 10_000:
                self._entries.clear()
            self._entries[hash_key(key)] = (since, stamp, principal)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_default_cache = KeyCache()  # for callers outside an app (tests, scripts): no Redis, the TTL only


def clear_cache() -> None:
    _default_cache.clear()


def announce_revocation(redis_url: str | None) -> bool:
    """Tells every API process that a key was revoked (call after the revocation is committed);
    False when Redis is unset or unreachable (then processes notice within ``CACHE_TTL_S``)."""
    if not redis_url:
        return False
    try:
        client = redis.Redis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=2.0)
        try:
            client.set(REVOCATIONS, secrets.token_hex(16))  # random, never a token seen before a restart
        finally:
            client.close()
        return True
    except redis.RedisError as exc:
        log.warning("could not announce a key revocation through Redis: %s", exc)
        return False


def lookup(session: Session, key: str) -> Principal | None:
    """The key's principal from SQL (None: unknown or revoked), uncached."""
    row = session.execute(
        select(ApiKey.id, ApiKey.tenant_id, ApiKey.tier, ApiKey.is_admin, ApiKey.revoked, Tenant.default_tier,
               Tenant.requests_per_minute, Tenant.tokens_per_minute, Tenant.disabled)
        .join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.key_hash == hash_key(key))).first()
    if row is None or row.revoked:
        return None
    return Principal(row.id, row.tenant_id, row.tier or row.default_tier, row.is_admin,
                     Limits(row.requests_per_minute, row.tokens_per_minute), bool(row.disabled))


def authenticate(session: Session, key: str, cache: KeyCache | None = None) -> Principal | None:
    cache = cache or _default_cache
    stamp = cache.stamp()
    hit = cache.get(key, stamp)
    if hit is not _MISS:
        return hit  # type: ignore[return-value]
    since = time.monotonic()
    principal = lookup(session, key)
    cache.put(key, stamp, principal, since)
    return principal
