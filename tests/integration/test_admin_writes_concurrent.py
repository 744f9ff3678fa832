"""Admin writes that read first (a key for a tenant, a revocation) while other connections write the same
SQLite file: each answers as documented, never a 500 ("database is locked" when a read transaction is
upgraded to a write after another writer committed)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.auth import create_tenant
from app.db.session import session_scope
from tests.conftest import Keys

pytestmark = pytest.mark.integration

H = Keys.header


def test_key_creation_and_revocation_beside_other_writers(client, keys, settings):
    stop = threading.Event()

    def other_writer(name: str) -> None:  # another connection's writes, as a worker's or another request's
        n = 0
        while not stop.is_set():
            with session_scope(settings.sqlalchemy_url) as s:
                create_tenant(s, f"{name}-{n}")
            n += 1

    def key_then_revoke(_: int) -> tuple[int, int]:
        made = client.post(f"/v1/admin/tenants/{keys.tenant_id}/keys", headers=H(keys.admin))
        if made.status_code != 201:
            return made.status_code, 0
        revoked = client.post(f"/v1/admin/keys/{made.json()['key_id']}/revoke", headers=H(keys.admin))
        return made.status_code, revoked.status_code

    writers = [threading.Thread(target=other_writer, args=(f"bystander{i}",)) for i in range(2)]
    for w in writers:
        w.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(key_then_revoke, range(80)))
    finally:
        stop.set()
        for w in writers:
            w.join()
    assert answers == [(201, 200)] * 80
