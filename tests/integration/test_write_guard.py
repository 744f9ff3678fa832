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
