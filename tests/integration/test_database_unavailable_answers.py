"""What every API answers while its database cannot serve: a server refusing or hanging, a SQLite file locked past its
busy timeout, the connection pool exhausted. Each is a 503 in the route's API's error shape with ``retry-after`` (the
OpenAI and Anthropic SDKs retry it), logged once; before, each was a 500 calling itself a defect, with a traceback per
request. A statement's own failure (a table missing) stays the 500 it is."""

from __future__ import annotations

import json
import logging
import socket
import sqlite3
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from app.api.errors import DATABASE_RETRY_AFTER_S
from app.db import session as db_session
from tests.conftest import free_port, make_keys, wait_for

pytestmark = pytest.mark.integration
ANTHROPIC_SDK = {"anthropic-version": "2023-06-01"}
# a route of each shape an error comes in: coserve's own, OpenAI's, Anthropic's, a path both SDKs call
ROUTES = (("/v1/jobs", {}, "native"), ("/v1/batches", {}, "openai"),
          ("/v1/messages/batches", ANTHROPIC_SDK, "anthropic"), ("/v1/files", ANTHROPIC_SDK, "anthropic"))


def _client(settings) -> TestClient:
    from app.auth import clear_cache
    from app.main import create_app

    clear_cache()  # each key is looked up in the database, not found in an earlier test's cache
    return TestClient(create_app(settings), raise_server_exceptions=False)


def _postgres_url(port: int) -> str:
    return f"postgresql+psycopg2://coserve@127.0.0.1:{port}/coserve"


def assert_retry_later(r, shape: str) -> None:
    """A 503 the SDKs retry after ``retry-after``, saying the database is unavailable, in ``shape``'s error shape."""
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == str(DATABASE_RETRY_AFTER_S), r.headers
    body = r.json()
    if shape == "native":
        message = body["detail"]
    elif shape == "openai":
        assert (body["error"]["type"], body["error"]["code"]) == ("server_error", "database_unavailable"), body
        message = body["error"]["message"]
    else:
        assert body["type"] == "error" and body["error"]["type"] == "overloaded_error", body
        assert r.headers["request-id"] == body["request_id"]
        message = body["error"]["message"]
    assert "the database is unavailable" in message and f"retry in {DATABASE_RETRY_AFTER_S} seconds" in message


def test_every_api_answers_503_with_retry_after_while_the_database_refuses_and_logs_it_once(settings, keys, caplog):
    settings.database_url = _postgres_url(free_port())  # nothing listens there: the key cannot even be looked up
    with _client(settings) as client, caplog.at_level(logging.WARNING):
        for path, headers, shape in ROUTES:
            assert_retry_later(client.get(path, headers={"Authorization": f"Bearer {keys.paid}", **headers}), shape)
    said = [r for r in caplog.records if "the database is unavailable" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and said[0].exc_info is None, caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_request_while_the_database_server_hangs_is_a_503_after_the_connect_timeout(settings, keys):
    # the socket closes first (its waiting connections reset): a request still waiting on it ends, and the pool joins
    with ThreadPoolExecutor(1) as pool, socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes the handshakes; nothing ever reads or answers
        settings.database_url = _postgres_url(silent.getsockname()[1])

        def request():
            with _client(settings) as client:
                return client.get("/v1/batches", headers={"Authorization": f"Bearer {keys.paid}"})

        answer = pool.submit(request).result(timeout=120)
    assert_retry_later(answer, "openai")


def _locked_sqlite(tmp_path, monkeypatch):
    """A migrated SQLite file whose connections wait 0.3 s for a lock (``SQLITE_BUSY_TIMEOUT_MS``), and its keys."""
    from app.db.migrate import upgrade

    path = tmp_path / "locked.db"
    monkeypatch.setattr(db_session, "SQLITE_BUSY_TIMEOUT_MS", 300)  # each connection's busy timeout, set at connect
    upgrade(f"sqlite:///{path}")
    return path, make_keys(f"sqlite:///{path}")


def test_a_job_submitted_while_sqlite_is_locked_is_a_503_and_its_retry_is_written_once(settings, tmp_path,
                                                                                        monkeypatch):
    path, keys = _locked_sqlite(tmp_path, monkeypatch)
    settings.database_url = f"sqlite:///{path}"
    job = {"prompt": "hello", "max_tokens": 2}
    with _client(settings) as client:
        holder = sqlite3.connect(path, isolation_level=None)  # another process's writer holding the file
        holder.execute("BEGIN EXCLUSIVE")
        try:
            assert_retry_later(client.post("/v1/jobs", json=job, headers={"Authorization": f"Bearer {keys.paid}"}),
                               "native")
        finally:
            holder.rollback()
            holder.close()
        retried = client.post("/v1/jobs", json=job, headers={"Authorization": f"Bearer {keys.paid}"})
        assert retried.status_code == 201, retried.text
        listed = client.get("/v1/jobs", headers={"Authorization": f"Bearer {keys.paid}"}).json()["data"]
    assert [j["id"] for j in listed] == [retried.json()["id"]]  # the refused submission left no row behind


def test_a_request_that_finds_the_pool_exhausted_is_a_503_and_the_next_one_is_served(settings, keys):
    settings.database_pool_size, settings.database_max_overflow, settings.database_pool_timeout_s = 2, 0, 0.5
    with _client(settings) as client:
        engine = db_session.get_engine(settings.sqlalchemy_url)  # the pool the app's sessions take from
        held = [engine.connect() for _ in range(2)]  # a burst of requests holding every connection
        try:
            assert_retry_later(client.get("/v1/batches", headers={"Authorization": f"Bearer {keys.paid}"}), "openai")
        finally:
            for connection in held:
                connection.close()
        served = client.get("/v1/batches", headers={"Authorization": f"Bearer {keys.paid}"})
    assert served.status_code == 200, served.text


def test_a_statements_own_failure_stays_a_500(settings, keys):
    """A table missing (SQLite's OperationalError, as a locked file's is) is a defect no retry mends: not a 503."""
    with db_session.get_engine(settings.sqlalchemy_url).begin() as conn:
        conn.execute(text("ALTER TABLE webhook_endpoints RENAME TO webhook_endpoints_gone"))
    with _client(settings) as client:
        r = client.get("/v1/webhook_endpoints", headers={"Authorization": f"Bearer {keys.paid}"})
    assert r.status_code == 500 and "retry-after" not in r.headers, r.text
    assert "report it with this id" in r.json()["error"]["message"]


def test_a_job_written_before_the_database_locks_is_accepted_once_and_left_for_the_sweeper(settings, tmp_path,
                                                                                            monkeypatch):
    """The job's row commits, then another writer takes the file before the job is marked dispatched: the job is
    accepted (201, queued: the sweeper sends a queued job), not a 503 that made its client submit it again."""
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    from app.db.models import Job

    path, keys = _locked_sqlite(tmp_path, monkeypatch)
    settings.database_url = f"sqlite:///{path}"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

    def lock_once_the_job_is_in(session, _flush_context) -> None:
        if any(isinstance(o, Job) for o in session.new):
            event.listen(session, "after_commit", lambda _s: holder.execute("BEGIN EXCLUSIVE"), once=True)

    event.listen(Session, "after_flush", lock_once_the_job_is_in)
    try:
        with _client(settings) as client:
            r = client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 2},
                            headers={"Authorization": f"Bearer {keys.paid}", "Idempotency-Key": "once"})
            holder.rollback()
            listed = client.get("/v1/jobs", headers={"Authorization": f"Bearer {keys.paid}"}).json()["data"]
    finally:
        event.remove(Session, "after_flush", lock_once_the_job_is_in)
        holder.close()
    assert r.status_code == 201, r.text
    assert [(j["id"], j["status"]) for j in listed] == [(r.json()["id"], "queued")]


def test_submissions_written_together_while_sqlite_is_locked_are_refused_together(settings, tmp_path, monkeypatch):
    """The API's group-commit writer tried a failed batch again one job at a time, to find the bad row: while the
    database is locked there is none, and each try waited out the busy timeout again (15 s each: a batch of 64 held
    every later submission for 16 minutes). A batch the database refuses is refused in one try."""
    from sqlalchemy import event

    path, keys = _locked_sqlite(tmp_path, monkeypatch)
    settings.database_url = url = f"sqlite:///{path}"
    tries = []
    event.listen(db_session.get_engine(url), "handle_error", lambda context: tries.append(context))
    waiting = 4
    with _client(settings) as client, ThreadPoolExecutor(1 + waiting) as pool:
        writer = client.app.state.job_writer
        submit = lambda: client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 2},  # noqa: E731
                                     headers={"Authorization": f"Bearer {keys.paid}"})
        holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        guard_session = db_session.get_sessionmaker(url)()
        with db_session.write_guard(guard_session):  # the writer's first batch waits here for the others to queue
            put_before = writer._inbox.unfinished_tasks  # the submissions ever put in (the writer calls no task_done)
            first = pool.submit(submit)
            wait_for(lambda: writer._inbox.unfinished_tasks > put_before and writer._inbox.qsize() == 0, 30,
                     "the writer to take the first submission")
            others = [pool.submit(submit) for _ in range(waiting)]
            wait_for(lambda: writer._inbox.qsize() == waiting, 30, "the other submissions to queue")
            holder.execute("BEGIN EXCLUSIVE")
        answers = [f.result(timeout=60) for f in (first, *others)]
        holder.rollback()
        holder.close()
        guard_session.close()
    assert [r.status_code for r in answers] == [503] * (1 + waiting), [r.text for r in answers]
    assert len(tries) == 2  # the first batch's insert, then the other four's in one


def test_a_stream_whose_database_read_finds_the_pool_exhausted_says_so_and_the_job_goes_on(settings, keys, caplog):
    """A job's stream asks SQL for the job's end while Redis is silent: where no pooled connection comes free, the
    stream's error says the database is unavailable, logged in one line (a traceback and 'the stream failed' before);
    the job stays."""
    settings.database_pool_size, settings.database_max_overflow, settings.database_pool_timeout_s = 2, 0, 0.5
    auth = {"Authorization": f"Bearer {keys.paid}"}
    with _client(settings) as client, caplog.at_level(logging.WARNING):
        job = client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 2}, headers=auth).json()
        engine = db_session.get_engine(settings.sqlalchemy_url)
        with client.stream("GET", f"/v1/jobs/{job['id']}/stream", headers=auth) as stream:
            held = [engine.connect() for _ in range(2)]  # the job's row is read; now a burst holds every connection
            try:
                body = "".join(stream.iter_text())
            finally:
                for connection in held:
                    connection.close()
        kept = client.get(f"/v1/jobs/{job['id']}", headers=auth)
    error = json.loads(body.split("event: error\ndata: ", 1)[1].split("\n", 1)[0])
    assert "the database is unavailable" in error["error"] and f"GET /v1/jobs/{job['id']}" in error["error"], error
    assert kept.status_code == 200 and kept.json()["status"] in ("queued", "dispatched"), kept.text
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("path, body", [("/v1/jobs", {"prompt": "hello", "max_tokens": 2}),
                                        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                                                  "messages": [{"role": "user", "content": "hi"}]})])
def test_a_submission_the_locked_database_refuses_gives_its_rate_limit_charge_back(settings, tmp_path, monkeypatch,
                                                                                   path, body):
    """A tenant allowed one request a minute submits while SQLite is locked: the 503 took the minute's request, so
    the SDK's retry after ``retry-after`` was refused 429 for the rest of the minute. The charge is given back."""
    from app.services.rate_limits import Limits, RateLimiter

    path_db, keys = _locked_sqlite(tmp_path, monkeypatch)
    settings.database_url = f"sqlite:///{path_db}"
    with _client(settings) as client:
        limited = client.patch(f"/v1/admin/tenants/{keys.tenant_id}", json={"requests_per_minute": 1},
                               headers={"Authorization": f"Bearer {keys.admin}"})
        assert limited.status_code == 200, limited.text
        holder = sqlite3.connect(path_db, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            refused = client.post(path, json=body, headers={"Authorization": f"Bearer {keys.paid}"})
        finally:
            holder.rollback()
            holder.close()
    assert refused.status_code == 503, refused.text
    bucket = RateLimiter(settings.redis_url).take(keys.tenant_id, Limits(requests_per_minute=1), 0, requests=0)
    assert bucket.requests_left > 0.5, bucket  # the minute's one request is there for the retry
