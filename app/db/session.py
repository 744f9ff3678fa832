"""SQLAlchemy engine and sessions: SQLite (WAL, busy timeout) by default, PostgreSQL supported.

One engine per URL per process (cached); callers pass the URL from ``Settings`` so tests
and several services in one process can point at different databases.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 15_000


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
    # Take the write lock at BEGIN: a deferred transaction that reads then writes can fail
    # with "database is locked" without waiting for the busy timeout.
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str, **kwargs) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False,
                                                  "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
                               pool_size=16, max_overflow=32, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        # pysqlite's own transaction handling is switched off so BEGIN IMMEDIATE is ours
        event.listen(engine, "connect", lambda c, _r: setattr(c, "isolation_level", None))
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20, **kwargs)


@lru_cache(maxsize=16)
def get_engine(url: str) -> Engine:
    return make_engine(url)


@lru_cache(maxsize=16)
def get_sessionmaker(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session that commits on success and rolls back on error (workers, CLI)."""
    session = get_sessionmaker(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
