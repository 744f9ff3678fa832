"""No API key or webhook secret reaches a log line, a Redis message or an error body: real requests over HTTP (good,
bad and revoked keys in ``Authorization`` and ``x-api-key``, a key made and revoked by the admin API, a webhook
endpoint's secret made and rotated) with every logger at DEBUG (the app's, uvicorn's access log, Celery's,
SQLAlchemy's engine with its statements' parameters)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest
import redis

from tests.conftest import Keys

pytestmark = pytest.mark.e2e

H = Keys.header
LOGGERS = ("", "app", "uvicorn", "uvicorn.access", "uvicorn.error", "celery", "kombu", "sqlalchemy",
           "sqlalchemy.engine", "workers")


class Everything(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if record.exc_info:
            self.lines.append(logging.Formatter().formatException(record.exc_info))


@pytest.fixture
def captured() -> Iterator[Everything]:
    handler, levels = Everything(), {}
    for name in LOGGERS:
        logger = logging.getLogger(name)
        levels[name] = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for name in LOGGERS:
            logging.getLogger(name).setLevel(levels[name])
            logging.getLogger(name).removeHandler(handler)


def redis_contents(url: str) -> list[str]:
    """Every key of the Redis and its value, as text (the Celery messages in the queues' lists among them)."""
    r, read = redis.Redis.from_url(url), {"string": "get", "list": "lrange", "hash": "hgetall", "set": "smembers",
                                          "zset": "zrange", "stream": "xrange"}
    args = {"lrange": (0, -1), "zrange": (0, -1)}
    out = []
    for key in r.scan_iter():
        kind = r.type(key).decode()
        out.append(repr(key) + repr(getattr(r, read[kind])(key, *args.get(read[kind], ()))))
    return out


def test_no_key_or_secret_reaches_a_log_a_redis_message_or_an_error_body(live_server, keys, settings, captured):
    base, bodies, secrets = live_server, [], [keys.paid, keys.free, keys.other, keys.admin]
    with httpx.Client(base_url=base, timeout=60) as c:
        def call(method: str, path: str, key: str | None = None, header: str = "authorization", **kw):
            headers = kw.pop("headers", {}) if key is None else {
                header: f"Bearer {key}" if header == "authorization" else key}
            r = c.request(method, path, headers=headers, **kw)
            bodies.append(r.text)
            return r

        call("GET", "/v1/jobs", keys.paid)
        call("GET", "/v1/jobs", keys.paid, header="x-api-key")
        call("POST", "/v1/jobs", keys.paid, json={"prompt": "hi"})
        call("POST", "/v1/jobs", keys.free, json={"prompt": "hi", "tier": "paid"})  # refused: above its tier
        wrong = keys.paid[:-6] + "wrong0"
        secrets.append(wrong)
        call("GET", "/v1/jobs", wrong)
        call("GET", "/v1/jobs", wrong, header="x-api-key")
        call("GET", "/v1/jobs", headers={"authorization": f"Basic {keys.paid}"})  # not a scheme it reads
        call("GET", "/admin/api/overview", keys.paid)  # not an admin key
        tenant = call("POST", "/v1/admin/tenants", keys.admin, json={"name": "initech"}).json()
        bodies.pop()  # a new key is shown once, in the answer that made it
        made = call("POST", f"/v1/admin/tenants/{tenant['tenant_id']}/keys", keys.admin, json={}).json()
        bodies.pop()
        secrets += [tenant["api_key"], made["api_key"]]
        call("GET", "/v1/jobs", made["api_key"])
        call("GET", f"/v1/admin/tenants/{tenant['tenant_id']}/keys", keys.admin)
        assert call("POST", f"/v1/admin/keys/{made['key_id']}/revoke", keys.admin).status_code == 200
        assert call("GET", "/v1/jobs", made["api_key"]).status_code == 401
        hook = call("POST", "/v1/webhook_endpoints", keys.paid, json={
            "url": "https://example.com/hook", "name": "n", "event_types": ["batch.completed"]}).json()
        bodies.pop()  # an endpoint's secret is shown when it is made, and when it is rotated
        rotated = call("POST", f"/v1/webhook_endpoints/{hook['id']}/rotate_secret", keys.paid).json()
        bodies.pop()
        secrets += [hook["signing_secret"], rotated["signing_secret"]]
        call("GET", f"/v1/webhook_endpoints/{hook['id']}", keys.paid)
        call("GET", "/v1/webhook_endpoints", keys.paid)
        call("GET", "/admin")
        call("GET", "/metrics", keys.admin)
    logged = "\n".join(captured.lines)
    assert "GET /v1/jobs" in logged and "SELECT" in logged  # the access log and SQLAlchemy's were captured
    stored = redis_contents(settings.redis_url)
    assert stored  # the jobs' Celery messages are in Redis
    for secret in secrets:
        for where, texts in (("logs", [logged]), ("redis", stored), ("answers", bodies)):
            for text in texts:
                assert secret not in text and secret[len("cs-"):][:24] not in text, (where, text[:2000])
