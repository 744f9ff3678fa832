"""The API's probes and metrics while its database cannot be reached: a PostgreSQL URL on a closed port (refused at
once) and one on a server that accepts connections and never answers (a hung database)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.observability.engine_metrics import engine_metrics_key
from tests.conftest import free_port

pytestmark = pytest.mark.integration
ADMIN_KEY = "cs-the-deployments-admin-key"  # COSERVE_ADMIN_KEY: reads /metrics while no key can be looked up


def _postgres_url(port: int) -> str:
    return f"postgresql+psycopg2://coserve@127.0.0.1:{port}/coserve"


def _app(settings):
    from app.auth import clear_cache
    from app.main import create_app

    clear_cache()
    return create_app(settings)


@pytest.fixture
def refused_db_client(settings) -> Iterator[TestClient]:
    settings.database_url = _postgres_url(free_port())  # nothing listens there
    settings.admin_key = ADMIN_KEY
    with TestClient(_app(settings)) as c:
        yield c


def test_load_is_a_503_saying_the_database_is_unreachable(refused_db_client):
    r = refused_db_client.get("/load")
    assert r.status_code == 503 and "database is unavailable (unreachable" in r.json()["detail"], r.text


def test_metrics_serve_the_redis_series_and_say_the_database_is_down(refused_db_client, settings):
    engine = [{"name": "vllm:num_requests_running", "type": "gauge", "doc": "running",
               "samples": [["vllm:num_requests_running", {"model_name": "tiny"}, 2.0]]},
              # a name the API derives from SQL on its backend: not read now, so the engine's is no double
              {"name": "vllm:kv_cache_usage_perc", "type": "gauge", "doc": "kv",
               "samples": [["vllm:kv_cache_usage_perc", {"model_name": "tiny"}, 0.5]]}]
    client = redis.Redis.from_url(settings.redis_url)
    for worker_id, model in (("w1", settings.model_name), ("other-w", "other")):  # other: another deployment's
        client.set(engine_metrics_key(worker_id), json.dumps({"model_name": model, "families": engine}), ex=60)
    other = refused_db_client.get("/metrics", headers={"Authorization": "Bearer cs-some-other-key"})
    assert other.status_code == 503 and "COSERVE_ADMIN_KEY" in other.json()["detail"], other.text
    r = refused_db_client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200, r.text
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert families["coserve:database_up"].samples[0].value == 0
    running = families["vllm:num_requests_running"].samples
    assert [(s.labels, s.value) for s in running] == [({"model_name": "tiny", "worker_id": "w1"}, 2.0)]
    assert [s.value for s in families["vllm:kv_cache_usage_perc"].samples] == [0.5]
    assert "coserve:rate_limited_requests" in families
    assert "coserve:num_requests_waiting" not in families  # nothing made up where SQL could not be read


def test_readyz_answers_503_within_seconds_while_the_database_hangs(settings):
    """A database server that takes the connection and never answers (stopped, a dead network path): /readyz fails
    on the connect timeout; before, it waited on the kernel's TCP timeout (minutes)."""
    # the socket closes first (its waiting connections reset): a probe still waiting on it ends, and the pool joins
    with ThreadPoolExecutor(1) as pool, socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes the handshakes; nothing ever reads or answers
        settings.database_url = _postgres_url(silent.getsockname()[1])

        def probe() -> tuple[int, dict, float]:
            with TestClient(_app(settings)) as c:  # start-up reads the schema: bounded the same way
                t0 = time.monotonic()
                r = c.get("/readyz")
                return r.status_code, r.json(), time.monotonic() - t0

        status, body, took = pool.submit(probe).result(timeout=120)
    assert status == 503 and body["checks"]["database"].startswith("error"), body
    assert took < 30


def test_load_on_a_broken_schema_is_a_500_not_the_database_down(settings):
    """A table missing (SQLite's OperationalError, as a refused server's is) is a defect no retry mends: /load answered
    it 503 'the database cannot be reached', and a router in front took the deployment for down."""
    from sqlalchemy import text

    from app.db.session import get_engine

    with get_engine(settings.sqlalchemy_url).begin() as conn:
        conn.execute(text("ALTER TABLE jobs RENAME TO jobs_gone"))
    with TestClient(_app(settings), raise_server_exceptions=False) as client:
        r = client.get("/load")
    assert r.status_code == 500 and "retry-after" not in r.headers, r.text
