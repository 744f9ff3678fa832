"""PostgreSQL's own bounds on a request's wait (``lock_timeout``, ``statement_timeout``): a request that meets a row
another transaction holds (an admin's, a stuck worker's) is answered 503 with retry-after once the lock timeout runs
out, and its pooled connection comes back; before, it waited for as long as the lock was held, and the pool drained.
A real cluster (``tests/postgres.py``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import create_engine, text

from tests.conftest import make_keys
from tests.integration.test_database_unavailable_answers import _client, assert_retry_later
from tests.postgres import needs_a_server

pytestmark = [pytest.mark.integration, *needs_a_server()]
HELD_FOR_S = 120  # the longest the test's holder keeps its lock: far past the request's lock timeout


@pytest.fixture
def pg_settings(settings, pg_url):
    from app.db.migrate import upgrade

    upgrade(pg_url)
    settings.database_url = pg_url
    return settings


def test_a_request_that_meets_a_held_row_lock_is_a_503_after_the_lock_timeout(pg_settings):
    pg_settings.database_lock_timeout_s = 0.5
    keys = make_keys(pg_settings.sqlalchemy_url)
    auth = {"Authorization": f"Bearer {keys.paid}"}
    holder = create_engine(pg_settings.sqlalchemy_url).connect()  # an admin's long transaction
    with _client(pg_settings) as client, ThreadPoolExecutor(1) as pool:
        job = client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 2}, headers=auth).json()
        holder.execute(text("SELECT id FROM jobs WHERE id = :id FOR UPDATE"), {"id": job["id"]})
        try:
            cancel = pool.submit(client.post, f"/v1/jobs/{job['id']}/cancel", headers=auth)
            answer = cancel.result(timeout=HELD_FOR_S)
        finally:
            holder.rollback()
            holder.close()
        served = client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth)
    assert_retry_later(answer, "native")
    assert "held by another transaction past the lock timeout" in answer.json()["detail"], answer.text
    assert served.status_code == 200, served.text


def test_a_statement_that_runs_past_the_statement_timeout_is_the_database_busy(pg_url):
    from sqlalchemy.exc import OperationalError

    from app.db.session import PoolSize, database_unavailable, get_engine, size_pool, unavailable_reason

    size_pool(pg_url, PoolSize(statement_timeout_s=0.2))
    with pytest.raises(OperationalError) as raised, get_engine(pg_url).connect() as conn:
        conn.execute(text("SELECT pg_sleep(30)"))
    assert database_unavailable(raised.value), raised.value
    assert unavailable_reason(raised.value) == "a statement ran past the statement timeout"
    size_pool(pg_url, PoolSize(statement_timeout_s=0))
    with get_engine(pg_url).connect() as conn:
        assert conn.execute(text("SHOW statement_timeout")).scalar() == "0"
        assert conn.execute(text("SHOW lock_timeout")).scalar() == "10s"  # the default, LOCK_TIMEOUT_S


def test_load_and_metrics_say_a_table_held_past_the_lock_timeout_is_no_database_down(pg_settings, caplog):
    """A migration's ALTER TABLE holds the jobs table: /load's 503 and /metrics' log line say the database is busy
    (the lock timeout ran out), not that it cannot be reached (they said so for any OperationalError)."""
    import logging

    pg_settings.database_lock_timeout_s = 0.5
    pg_settings.admin_key = admin_key = "cs-test-admin-key-for-metrics"
    holder = create_engine(pg_settings.sqlalchemy_url).connect()
    with _client(pg_settings) as client, caplog.at_level(logging.WARNING):
        holder.execute(text("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE"))
        try:
            load = client.get("/load")
            scrape = client.get("/metrics", headers={"Authorization": f"Bearer {admin_key}"})
        finally:
            holder.rollback()
            holder.close()
    assert load.status_code == 503, load.text
    assert "held by another transaction past the lock timeout" in load.json()["detail"], load.text
    assert "coserve:database_up 0.0" in scrape.text, scrape.text
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("/load", "/metrics"))]
    assert said and not [m for m in said if "cannot be reached" in m], said
    assert all("lock timeout" in m for m in said), said


def test_the_keys_commands_connections_carry_the_operators_lock_timeout(pg_url, tmp_path):
    """`coserve keys ...` opened the database with the defaults, whatever COSERVE_DATABASE_LOCK_TIMEOUT_S (and the
    pool's settings) said: only `coserve serve`/`up` and the workers sized their pool from the settings."""
    from typer.testing import CliRunner

    from app.cli import cli
    from app.db.session import get_engine

    env = {"COSERVE_DATABASE_URL": pg_url, "COSERVE_DATA_DIR": str(tmp_path), "COSERVE_DATABASE_LOCK_TIMEOUT_S": "0.3",
           "COSERVE_DATABASE_STATEMENT_TIMEOUT_S": "0", "COLUMNS": "300"}
    res = CliRunner().invoke(cli, ["keys", "create", "--tenant", "acme"], env=env)
    assert res.exit_code == 0, res.output
    with get_engine(pg_url).connect() as conn:  # the engine the command's sessions came from (one per URL)
        timeouts = conn.execute(text("SELECT current_setting('lock_timeout'), current_setting('statement_timeout')"))
        assert tuple(timeouts.one()) == ("300ms", "0"), "the command's connections ignored the settings"
