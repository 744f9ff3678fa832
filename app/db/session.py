"""SQLAlchemy engine and sessions: SQLite (WAL, busy timeout) by default, PostgreSQL supported.

One engine per URL per process (cached); callers pass the URL from ``Settings`` so tests
and several services in one process can point at different databases.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

try:
    import fcntl
except ImportError:  # Windows: threads of one process are still serialized
    fcntl = None  # type: ignore[assignment]
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 15_000
# a server that stops answering fails a request (and a probe: /readyz) in seconds, not after the kernel's TCP timeout
CONNECT_TIMEOUT_S = 5
POOL_TIMEOUT_S = 10  # the longest a request waits for a pooled connection while all are in use
SERVER_POOL = (10, 20)  # a database server's pool per process: kept connections, more while busy (SCALE-OUT.md)
SQLITE_POOL = (16, 32)  # SQLite's: connections are cheap, and write_guard serializes the writers among them
# a database server's bounds on one statement's wait (PostgreSQL's lock_timeout, statement_timeout): a request that
# meets a row another transaction holds (an admin's, a stuck worker's) gives its pooled connection back and is answered
# 503, instead of holding it for as long as the lock is held while the pool drains
LOCK_TIMEOUT_S = 10.0
STATEMENT_TIMEOUT_S = 60.0
# the errors ``database_unavailable`` judges: a driver's (wrapped by SQLAlchemy) and the pool's
DATABASE_ERRORS = (DBAPIError, PoolTimeout)
# SQLite's (extended) result codes of a file another connection holds past the busy timeout: SQLITE_BUSY, SQLITE_LOCKED,
# SQLITE_BUSY_RECOVERY (another connection recovers the WAL), SQLITE_BUSY_TIMEOUT. Not SQLITE_BUSY_SNAPSHOT (517): a
# read turned write after another writer committed, which code that reads then writes avoids (``read_then_write``)
SQLITE_BUSY_CODES = frozenset({5, 6, 261, 773})
# PostgreSQL's SQLSTATEs of a server that cannot serve now: class 08 (connection exception), too many connections,
# shutting down (admin, crash), starting up; not a statement's own errors (a syntax error, a constraint broken)
SERVER_UNAVAILABLE_STATES = frozenset({"53300", "57P01", "57P02", "57P03"})
# PostgreSQL's SQLSTATEs of a statement that waited past its bound (``PoolSize``'s lock and statement timeouts):
# lock_not_available, query_canceled. The database is busy, not broken: a retry may find the lock let go
LOCK_TIMEOUT_STATE, STATEMENT_TIMEOUT_STATE = "55P03", "57014"
SERVER_BUSY_STATES = frozenset({LOCK_TIMEOUT_STATE, STATEMENT_TIMEOUT_STATE})
# libpq's words where a connection could not be made or was lost (no SQLSTATE comes with them); not a refused login
# (a wrong password, an unknown database: the deployment's own defect, which no retry mends)
SERVER_UNREACHABLE_WORDS = ("Connection refused", "timeout expired", "could not connect to server",
                            "server closed the connection unexpectedly", "No such file or directory",
                            "the database system is starting up", "the database system is shutting down",
                            "the database system is in recovery mode", "the database system is not yet accepting",
                            "too many clients already", "remaining connection slots are reserved")


def database_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot serve now, as a retry in seconds may find it can: no pooled connection
    came free within the pool's timeout, a connection that was lost (SQLAlchemy's ``connection_invalidated``), SQLite's
    file held by another connection past its busy timeout, a server that refused, timed out, is starting or stopping,
    or has no connection slot left. A statement's own failure (a missing table, a broken constraint) is a defect: no."""
    if isinstance(exc, PoolTimeout):
        return True
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    driver_error = exc.orig
    if (sqlite_code := getattr(driver_error, "sqlite_errorcode", None)) is not None:
        return sqlite_code in SQLITE_BUSY_CODES
    state = server_state(exc)
    if state:
        return state.startswith("08") or state in SERVER_UNAVAILABLE_STATES or state in SERVER_BUSY_STATES
    return isinstance(exc, OperationalError) and any(w in str(driver_error) for w in SERVER_UNREACHABLE_WORDS)


def server_state(exc: BaseException) -> str | None:
    """The SQLSTATE a database server's driver gave with ``exc`` (psycopg2's ``pgcode``, psycopg's ``sqlstate``)."""
    driver_error = getattr(exc, "orig", None)
    return getattr(driver_error, "pgcode", None) or getattr(driver_error, "sqlstate", None)


def unavailable_reason(exc: BaseException) -> str:
    """What kept the database from serving (``exc`` one ``database_unavailable`` says yes to), in words for a client
    and an operator: a database that is busy is not one that is down."""
    if isinstance(exc, PoolTimeout):
        return "every pooled connection was in use past the pool timeout"
    if getattr(getattr(exc, "orig", None), "sqlite_errorcode", None) is not None:
        return "another connection held the SQLite file past the busy timeout"
    state = server_state(exc)
    if state == LOCK_TIMEOUT_STATE:
        return "a row it needs was held by another transaction past the lock timeout"
    if state == STATEMENT_TIMEOUT_STATE:
        return "a statement ran past the statement timeout"
    return "unreachable or refusing connections"


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    # WAL lets readers run beside the single writer; NORMAL sync is durable across
    # process crashes (only an OS crash can lose the last transactions).
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _sqlite_begin(conn) -> None:
    # Deferred by default (readers never block writers). A deferred transaction that reads
    # and then writes fails with "database is locked" (no busy wait) when another writer
    # committed in between, so read-then-write code asks for BEGIN IMMEDIATE.
    immediate = conn.get_execution_options().get("sqlite_immediate", False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


class HiddenRows(logging.Filter):
    """SQLAlchemy's DEBUG lines name a result row's columns, not its values (webhook secrets, prompts, answers), as
    ``hide_parameters`` keeps a statement's values out of its INFO lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Row %r":
            record.args = ("[row values hidden]",)
        return True


logging.getLogger("sqlalchemy.engine.Engine").addFilter(HiddenRows())


@dataclass(frozen=True)
class PoolSize:
    """A process's connection pool to one database (``Settings.database_pool``): an operator sizes it against the
    server's ``max_connections`` and the processes sharing it (ops/compose/SCALE-OUT.md); and on a database server the
    bounds of its connections' waits, set on each as it connects (0: none)."""

    size: int | None = None  # connections kept open; None: the backend's (SERVER_POOL, SQLITE_POOL)
    overflow: int | None = None  # opened beyond them while busy, closed once returned; None: the backend's
    timeout_s: float = POOL_TIMEOUT_S  # how long a session waits for one while all are in use (then a 503)
    lock_timeout_s: float = LOCK_TIMEOUT_S  # how long a statement waits for a lock another transaction holds
    statement_timeout_s: float = STATEMENT_TIMEOUT_S  # how long one statement may run, its waits included

    def engine_args(self, url: str) -> dict[str, float]:
        size, overflow = SQLITE_POOL if url.startswith("sqlite") else SERVER_POOL
        return {"pool_size": size if self.size is None else self.size,
                "max_overflow": overflow if self.overflow is None else self.overflow, "pool_timeout": self.timeout_s}


_pool_sizes: dict[str, PoolSize] = {}  # a URL's pool where this process's settings size it (``size_pool``)


def size_pool(url: str, pool: PoolSize) -> None:
    """The pool the engine of ``url`` gets in this process (the API's and a worker's start, from their settings); an
    engine made before with another size is let go, with every cached one (a process sizes its pool once, at start)."""
    if _pool_sizes.get(url, PoolSize()) != pool:
        get_sessionmaker.cache_clear()
        get_engine.cache_clear()
    _pool_sizes[url] = pool


def make_engine(url: str, **kwargs) -> Engine:
    # a statement's values (webhook secrets, prompts) stay out of SQLAlchemy's log lines and error messages
    kwargs.setdefault("hide_parameters", True)
    kwargs = _pool_sizes.get(url, PoolSize()).engine_args(url) | kwargs
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False,
                                                  "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        # pysqlite's own transaction handling is switched off so BEGIN IMMEDIATE is ours
        event.listen(engine, "connect", lambda c, _r: setattr(c, "isolation_level", None))
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    engine = create_engine(url, pool_pre_ping=True, connect_args=server_connect_args(url), **kwargs)
    if engine.dialect.name == "postgresql":
        event.listen(engine, "connect", _server_waits(_pool_sizes.get(url, PoolSize())))
    return engine


def _server_waits(pool: PoolSize):  # noqa: ANN202 - SQLAlchemy's connect listener
    """A connect listener that sets the session's ``lock_timeout`` and ``statement_timeout`` (milliseconds; 0: none)
    on each new PostgreSQL connection, as ``PoolSize`` says."""
    waits = {"lock_timeout": pool.lock_timeout_s, "statement_timeout": pool.statement_timeout_s}

    def set_waits(dbapi_conn, _record) -> None:
        cursor = dbapi_conn.cursor()
        for name, seconds in waits.items():
            cursor.execute(f"SET {name} = {round(seconds * 1000)}")
        cursor.close()
        dbapi_conn.commit()  # the driver's implicit transaction; SET's session value outlives it

    return set_waits


def server_connect_args(url: str) -> dict[str, int]:
    """The driver's connect timeout for a database server (libpq's ``connect_timeout``: PostgreSQL's drivers),
    unless the URL sets its own."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql" or "connect_timeout" in parsed.query:
        return {}
    return {"connect_timeout": CONNECT_TIMEOUT_S}


@lru_cache(maxsize=16)
def get_engine(url: str) -> Engine:
    return make_engine(url)


@lru_cache(maxsize=32)
def get_sessionmaker(url: str, immediate: bool = False) -> sessionmaker[Session]:
    """Sessions on ``url``; ``immediate`` takes SQLite's write lock at BEGIN (read-then-write code)."""
    engine = get_engine(url)
    if immediate:
        engine = engine.execution_options(sqlite_immediate=True)
    return sessionmaker(engine, expire_on_commit=False)


_write_locks: dict[str, threading.Lock] = {}
_lock_files: dict[tuple[int, str], int] = {}  # (pid, database path) -> open lock-file descriptor


def _lock_file(database: str | None) -> int | None:
    """A descriptor of ``<database>.writelock`` for flock, opened once per process."""
    if not database or database == ":memory:" or fcntl is None:
        return None
    key = (os.getpid(), database)
    fd = _lock_files.get(key)
    if fd is None:
        fd = _lock_files[key] = os.open(f"{database}.writelock", os.O_RDWR | os.O_CREAT, 0o600)
    return fd


@contextmanager
def write_guard(session: Session) -> Iterator[None]:
    """Serializes SQLite writers: this process's threads on a Python lock, processes on an
    flock of ``<database>.writelock``.

    SQLite's busy handler sleeps in steps of up to 100 ms while another connection holds
    the write lock; writers queueing on a mutex and on flock are woken the moment it is
    released instead, which keeps the tail latency of the submit path low when several
    API processes share one database file. No-op on other databases.
    """
    bind = session.get_bind()
    if bind.dialect.name != "sqlite":
        yield
        return
    lock = _write_locks.setdefault(str(bind.url), threading.Lock())
    with lock:
        fd = _lock_file(bind.url.database)
        if fd is None:
            yield
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


@contextmanager
def session_scope(url: str, immediate: bool = False) -> Iterator[Session]:
    """A session that commits on success and rolls back on error (workers, CLI)."""
    session = get_sessionmaker(url, immediate)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


# after a chunk of a long write (a batch's fan-out, stopping its jobs), SQLite's write lock is let go as long as the
# chunk held it (at most this): a writer in SQLite's busy wait (a worker's, which polls in steps of up to 100 ms) or
# queued on write_guard's lock (a submission; Python's lock is not fair) gets its turn, instead of finding the next
# chunk's transaction there again
WRITE_PAUSE_S = 0.2


def let_others_write(held_s: float) -> None:
    """Between two chunks of a long write: the write lock let go as long as the last chunk held it."""
    time.sleep(min(held_s, WRITE_PAUSE_S))


@contextmanager
def read_then_write(url: str) -> Iterator[Session]:
    """A session for work that reads, then writes what it read: SQLite's write lock from its first statement
    (BEGIN IMMEDIATE, under ``write_guard``), so no other writer commits in between; commits at the end."""
    with session_scope(url, immediate=True) as session, write_guard(session):
        yield session


@contextmanager
def write_after_read(session: Session) -> Iterator[None]:
    """Ends the session's read (SQLite refuses to turn a read into a write once another writer has
    committed), then writes under ``write_guard`` in a transaction that takes SQLite's write lock at its first
    statement (BEGIN IMMEDIATE), so a check read inside the write (``admin_key_left``) meets no writer that does not
    take the guard (a worker's, the CLI's) committing before the write: that failed it, 'database is locked'."""
    session.commit()
    with write_guard(session):
        session.connection(execution_options={"sqlite_immediate": True})  # begins it; no-op beyond SQLite
        yield
