"""Revoking an API key stops it at once on every API process: two apps (two ``create_app``, each with
its own key cache, as two uvicorn processes have) share the real Redis and the SQLite DB; a key
revoked through one, or with ``coserve keys revoke``, gets 401 from the other on its next request."""

from __future__ import annotations

import time

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from typer.testing import CliRunner

from app.auth import _MISS, REVOCATIONS, KeyCache, hash_key, lookup
from app.cli import cli
from app.db.models import ApiKey
from app.db.session import session_scope
from app.embedded import record_redis_url
from app.main import create_app
from tests.conftest import Keys, free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def two_apps(settings):
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        yield a, b


def _key_id(db_url: str, key: str) -> str:
    with session_scope(db_url) as s:
        return s.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_key(key)))


def _ok(client: TestClient, key: str) -> int:
    return client.get("/v1/jobs", headers=Keys.header(key)).status_code


def test_a_key_revoked_through_one_api_process_is_refused_by_the_other_at_once(two_apps, keys, db_url):
    a, b = two_apps
    assert _ok(a, keys.paid) == 200 and _ok(b, keys.paid) == 200  # both caches now hold the key
    r = a.post(f"/v1/admin/keys/{_key_id(db_url, keys.paid)}/revoke", headers=Keys.header(keys.admin))
    assert r.status_code == 200 and r.json()["revoked"] is True
    assert _ok(b, keys.paid) == 401  # the very next request, well inside the cache's 5 s
    assert _ok(a, keys.paid) == 401
    assert _ok(b, keys.free) == 200  # the other keys keep working (looked up again)


def test_the_cache_is_in_effect_so_the_announcement_is_what_stops_the_key(two_apps, keys, db_url, redis_url):
    a, b = two_apps
    assert _ok(b, keys.free) == 200
    # revoked in SQL behind the API's back (no announcement): b still answers from its cache
    with session_scope(db_url) as s:
        s.execute(update(ApiKey).where(ApiKey.key_hash == hash_key(keys.free)).values(revoked=True))
    assert _ok(b, keys.free) == 200
    # an idempotent revoke through a announces it: b refuses from the next request
    assert a.post(f"/v1/admin/keys/{_key_id(db_url, keys.free)}/revoke",
                  headers=Keys.header(keys.admin)).status_code == 200
    assert _ok(b, keys.free) == 401


def test_coserve_keys_revoke_reaches_the_api_through_the_redis_coserve_up_recorded(
        two_apps, keys, settings, db_url, redis_url, monkeypatch):
    _, b = two_apps
    assert _ok(b, keys.other) == 200
    record_redis_url(settings.data_dir, redis_url)  # what `coserve up` does with its embedded Redis
    for name in ("REDIS_URL", "COSERVE_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    env = {"COSERVE_DATA_DIR": str(settings.data_dir), "COSERVE_DATABASE_URL": db_url}
    res = CliRunner().invoke(cli, ["keys", "revoke", _key_id(db_url, keys.other)], env=env)
    assert res.exit_code == 0 and "revoked" in res.output and "not reachable" not in res.output, res.output
    assert _ok(b, keys.other) == 401


def test_without_redis_nothing_cached_is_trusted(keys, db_url, redis_url):
    dead = KeyCache(f"redis://127.0.0.1:{free_port()}/0")
    with session_scope(db_url) as s:
        principal = lookup(s, keys.paid)
    dead.put(keys.paid, dead.stamp(), principal, time.monotonic())
    assert dead.get(keys.paid, dead.stamp()) is _MISS  # the token could not be read: look it up again

    live = KeyCache(redis_url)
    stamp = live.stamp()
    live.put(keys.paid, stamp, principal, time.monotonic())
    assert live.get(keys.paid, live.stamp()) == principal
    redis.Redis.from_url(redis_url).set(REVOCATIONS, "another revocation")
    assert live.get(keys.paid, live.stamp()) is _MISS


def test_a_changed_admin_key_variable_revokes_the_earlier_one_and_stores_none_of_it(client, db_url, redis_url):
    """COSERVE_ADMIN_KEY's row kept its first 10 characters (all of a short key) in clear, and a changed variable
    left the earlier key an admin's; now the row shows a label of its hash, and a start with another value
    revokes the earlier one (a generated admin key stays)."""
    from app.credentials import ensure_admin_key

    assert ensure_admin_key(db_url, "hunter2") == 0 and ensure_admin_key(db_url, "hunter2") == 0
    with session_scope(db_url) as s:
        assert [k.prefix for k in s.scalars(select(ApiKey).where(ApiKey.key_hash == hash_key("hunter2")))] == [
            "env:" + hash_key("hunter2")[:4]]
    assert client.get("/v1/admin/tenants", headers=Keys.header("hunter2")).status_code == 200
    generated = client.post("/v1/admin/tenants", json={"name": "ops2", "admin": True},
                            headers=Keys.header("hunter2")).json()["api_key"]
    assert ensure_admin_key(db_url, "s3cretAdminKey-2026") == 1
    from app.auth import announce_revocation

    announce_revocation(redis_url)  # as the API does at start when a key was revoked
    assert client.get("/v1/admin/tenants", headers=Keys.header("hunter2")).status_code == 401
    for key in ("s3cretAdminKey-2026", generated):
        assert client.get("/v1/admin/tenants", headers=Keys.header(key)).status_code == 200


def test_a_disabled_tenant_is_refused_and_its_open_work_cancelled(client, keys, settings):
    """PATCH disabled: true refuses every key of the tenant (403, saying why), cancels its open jobs and batches;
    other tenants go on, and disabled: false lets the keys in again."""
    import json

    from app.db.models import Job

    job = client.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4, "kind": "batch"},
                      headers=Keys.header(keys.paid)).json()
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}}) for i in range(2)]
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", "\n".join(lines).encode())}).json()
    batch = client.post("/v1/batches", headers=Keys.header(keys.paid), json={
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "1h"}).json()
    r = client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"disabled": True}, headers=Keys.header(keys.admin))
    assert r.status_code == 200 and r.json()["disabled"] is True, r.text
    for key in (keys.paid, keys.free):
        refused = client.get("/v1/jobs", headers=Keys.header(key))
        assert refused.status_code == 403 and "disabled" in refused.json()["detail"]
    assert client.get("/v1/jobs", headers=Keys.header(keys.other)).status_code == 200
    with session_scope(settings.sqlalchemy_url) as s:
        statuses = {j.id: j.status for j in s.scalars(select(Job).where(Job.tenant_id == keys.tenant_id))}
    assert statuses[job["id"]] == "cancelled" and set(statuses.values()) == {"cancelled"} and len(statuses) == 3
    admin_tenant = client.get("/v1/admin/tenants", headers=Keys.header(keys.admin)).json()
    own = next(t["id"] for t in admin_tenant if t["name"] == "ops")
    assert client.patch(f"/v1/admin/tenants/{own}", json={"disabled": True},
                        headers=Keys.header(keys.admin)).status_code == 409  # the admin would lock itself out
    client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"disabled": False}, headers=Keys.header(keys.admin))
    assert client.get(f"/v1/batches/{batch['id']}", headers=Keys.header(keys.paid)).json()["status"] in (
        "cancelling", "cancelled")


def test_an_admin_key_cannot_revoke_itself_and_so_the_last_admin_key_stays(client, keys, db_url):
    """An admin key revoked itself (200) and, the last admin key, locked the operator out until COSERVE_ADMIN_KEY was
    reset; now that is a 409 naming the way out (another admin key first), and that other key may revoke it."""
    own = _key_id(db_url, keys.admin)
    r = client.post(f"/v1/admin/keys/{own}/revoke", headers=Keys.header(keys.admin))
    assert r.status_code == 409 and "create another admin key" in r.json()["detail"], r.text
    assert _ok(client, keys.admin) == 200
    ops = next(t["id"] for t in client.get("/v1/admin/tenants", headers=Keys.header(keys.admin)).json()
               if t["name"] == "ops")
    second = client.post(f"/v1/admin/tenants/{ops}/keys", json={"admin": True}, headers=Keys.header(keys.admin))
    r = client.post(f"/v1/admin/keys/{own}/revoke", headers=Keys.header(second.json()["api_key"]))
    assert r.status_code == 200 and r.json()["revoked"] is True, r.text
    assert _ok(client, keys.admin) == 401


def test_the_last_active_admin_key_is_never_revoked(keys, db_url, settings):
    """The rule holds in the revocation itself: with no other active admin key (of an enabled tenant) the
    revocation is refused, whoever asks."""
    from fastapi import HTTPException

    from app.api.tenants import refuse_admin_lockout
    from app.auth import Principal

    own = _key_id(db_url, keys.admin)
    caller = Principal(key_id="key_elsewhere", tenant_id="t", tier="paid", is_admin=True)
    with session_scope(db_url) as s:
        with pytest.raises(HTTPException) as refused:
            refuse_admin_lockout(s, s.get(ApiKey, own), caller)
    assert refused.value.status_code == 409 and "last active admin key" in refused.value.detail


def test_coserve_keys_revoke_refuses_the_last_active_admin_key_as_the_api_does(keys, db_url, settings, monkeypatch):
    """`coserve keys revoke` (straight to SQL) revoked the last admin key, which the admin API refuses (409): the
    operator was locked out of every admin route. Now it refuses too, naming the way out (another admin key first),
    and revokes the key once there is another."""
    for name in ("REDIS_URL", "COSERVE_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    env = {"COSERVE_DATA_DIR": str(settings.data_dir), "COSERVE_DATABASE_URL": db_url}
    own = _key_id(db_url, keys.admin)
    res = CliRunner().invoke(cli, ["keys", "revoke", own], env=env)
    assert res.exit_code == 1 and "last active admin key" in res.output, res.output
    assert "coserve keys create" in res.output
    with session_scope(db_url) as s:
        assert s.get(ApiKey, own).revoked is False
    assert CliRunner().invoke(cli, ["keys", "create", "--tenant", "ops", "--admin"], env=env).exit_code == 0
    res = CliRunner().invoke(cli, ["keys", "revoke", own], env=env)
    assert res.exit_code == 0 and "revoked" in res.output, res.output
