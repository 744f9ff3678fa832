"""SQLite writers of several processes queue on the write guard's flock instead of
SQLite's sleeping busy handler."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from sqlalchemy import text

from app.db.session import get_sessionmaker, write_guard

pytestmark = pytest.mark.integration

HOLDER = textwrap.dedent("""
    import sys, time
    from sqlalchemy import text
    from app.db.session import get_sessionmaker, write_guard
    session = get_sessionmaker(sys.argv[1])()
    with write_guard(session):
        session.execute(text("INSERT INTO t VALUES ('holder')"))
        print("held", flush=True)
        time.sleep(1.0)
        session.commit()
""")


def test_write_guard_serializes_processes(tmp_path):
    url = f"sqlite:///{tmp_path / 'guard.db'}"
    session = get_sessionmaker(url)()
    session.execute(text("CREATE TABLE t (who TEXT)"))
    session.commit()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, url], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with write_guard(session):  # blocks on the flock until the holder commits
            waited = time.monotonic() - t0
            session.execute(text("INSERT INTO t VALUES ('second')"))
            session.commit()
        assert waited > 0.5, "the guard let a second process write while the first held it"
        assert holder.wait(10) == 0
        assert [r[0] for r in session.execute(text("SELECT who FROM t"))] == ["holder", "second"]
    finally:
        holder.kill()
        session.close()


def test_a_read_inside_write_after_read_holds_the_write_lock_against_a_writer_outside_the_guard(tmp_path):
    """A check read inside ``write_after_read`` (the tenant disable's and the key revocation's ``admin_key_left``):
    its transaction began deferred, so a writer that does not take the guard (a worker's heartbeat, the CLI) could
    commit between the read and the write, and the write then failed at once, 'database is locked' (SQLite will
    not turn a read of an older snapshot into a write). The transaction takes SQLite's write lock at its first
    statement now: the other writer waits (here: its busy timeout ends) and the checked write goes through."""
    import sqlite3

    from app.db.session import write_after_read

    path = tmp_path / "guard.db"
    url = f"sqlite:///{path}"
    session = get_sessionmaker(url)()
    session.execute(text("CREATE TABLE t (who TEXT)"))
    session.commit()
    outside = sqlite3.connect(path, timeout=0.2, isolation_level=None)
    refused = []
    with write_after_read(session):
        assert session.execute(text("SELECT count(*) FROM t")).scalar() == 0  # the check
        try:
            outside.execute("INSERT INTO t VALUES ('outside')")
        except sqlite3.OperationalError as exc:
            refused.append(str(exc))
        session.execute(text("INSERT INTO t VALUES ('checked')"))
        session.commit()
    outside.close()
    assert refused == ["database is locked"]
    assert [who for (who,) in session.execute(text("SELECT who FROM t"))] == ["checked"]
    session.close()
