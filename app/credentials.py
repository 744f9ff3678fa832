"""First-run credentials of the embedded setup: a default tenant + key and an admin key.

Only hashes go into SQL; the plaintext keys are written once to ``credentials.json``
(mode 0600) in the data dir so ``coserve submit`` can find them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from sqlalchemy import select

from app.auth import create_key, create_tenant, hash_key
from app.db.models import ApiKey, Tenant
from app.db.session import session_scope

log = logging.getLogger(__name__)

FILENAME = "credentials.json"
DEFAULT_TENANT = "default"
ADMIN_TENANT = "admin"


def credentials_path(data_dir: Path) -> Path:
    return Path(data_dir) / FILENAME


class CredentialsError(ValueError):
    """The credentials file cannot be read."""


def load_credentials(data_dir: Path) -> dict[str, str] | None:
    """The saved credentials (None: none saved); raises ``CredentialsError`` for a file that is not a JSON object."""
    path = credentials_path(data_dir)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise CredentialsError(f"{path} cannot be read ({exc}); remove it and run `coserve up` again for new keys, "
                               "or pass --key and --url") from None
    if not isinstance(data, dict):
        raise CredentialsError(f"{path} holds no credentials; remove it and run `coserve up` again for new keys")
    return data


def _write_private(path: Path, data: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.chmod(path, 0o600)


ENV_LABEL = "env:"  # the prefix shown for COSERVE_ADMIN_KEY's row, which marks it as the variable's


def env_key_label(key_hash: str) -> str:
    """What listings show of an operator-chosen key: a few hex digits of its hash, none of its characters (the
    first ten of a short key are all of it)."""
    return ENV_LABEL + key_hash[:4]


def ensure_admin_key(url: str, admin_key: str, default_tier: str = "paid") -> int:
    """Registers ``COSERVE_ADMIN_KEY`` (its hash) as an admin key if it is not yet known, and revokes the admin keys
    an earlier value of the variable registered (a changed variable replaces the key); returns how many it revoked
    (to announce: ``app.auth.announce_revocation``)."""
    digest = hash_key(admin_key)
    with session_scope(url, immediate=True) as s:
        stale = s.scalars(select(ApiKey).where(ApiKey.prefix.startswith(ENV_LABEL), ApiKey.key_hash != digest,
                                               ApiKey.revoked.is_(False))).all()
        for row in stale:
            row.revoked = True
            log.info("revoked admin key %s (%s): COSERVE_ADMIN_KEY has changed", row.id, row.prefix)
        known = s.scalar(select(ApiKey).where(ApiKey.key_hash == digest))
        if known is not None:
            if known.revoked:
                log.error("COSERVE_ADMIN_KEY is revoked key %s; choose a new one", known.id)
            return len(stale)
        tenant = s.scalar(select(Tenant).where(Tenant.name == ADMIN_TENANT)) or create_tenant(
            s, ADMIN_TENANT, default_tier)
        s.add(ApiKey(tenant_id=tenant.id, key_hash=digest, prefix=env_key_label(digest), is_admin=True))
    return len(stale)


def ensure_credentials(url: str, data_dir: Path, *, default_tier: str = "paid", admin_key: str | None = None,
                       api_url: str = "http://127.0.0.1:8000") -> tuple[dict[str, str], bool]:
    """Returns (credentials, created_now); creates tenants and keys on the first run."""
    existing = load_credentials(data_dir)
    if admin_key:
        ensure_admin_key(url, admin_key, default_tier)
    with session_scope(url, immediate=True) as s:
        if existing is not None and s.scalar(select(ApiKey.id).where(  # a revoked saved key is replaced
                ApiKey.key_hash == hash_key(existing.get("api_key", "")), ApiKey.revoked.is_(False))) is not None:
            if existing.get("url") != api_url:
                existing["url"] = api_url
                _write_private(credentials_path(data_dir), existing)
            return existing, False
        tenant = s.scalar(select(Tenant).where(Tenant.name == DEFAULT_TENANT)) or create_tenant(
            s, DEFAULT_TENANT, default_tier)
        _, user_key = create_key(s, tenant)
        creds = {"url": api_url, "api_key": user_key, "tenant_id": tenant.id}
        kept_admin = (existing or {}).get("admin_key")
        if not admin_key and kept_admin and s.scalar(select(ApiKey.id).where(
                ApiKey.key_hash == hash_key(kept_admin), ApiKey.is_admin.is_(True), ApiKey.revoked.is_(False))):
            creds["admin_key"] = kept_admin  # only the user key was revoked: the admin key saved with it stays
        elif not admin_key:
            admin_tenant = s.scalar(select(Tenant).where(Tenant.name == ADMIN_TENANT)) or create_tenant(
                s, ADMIN_TENANT, default_tier)
            _, admin_plain = create_key(s, admin_tenant, is_admin=True)
            creds["admin_key"] = admin_plain
    _write_private(credentials_path(data_dir), creds)
    return creds, True
