"""A throwaway PostgreSQL cluster (trust auth, loopback only) for the tests: ``test_postgres``'s files start one a
module, and ``COSERVE_TEST_DATABASE=postgres`` runs the app/worker fixtures (``db_url``, ``worker_stack``) on one
cluster a session instead of SQLite files. Needs Debian's postgresql binaries and psycopg2."""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from itertools import count
from pathlib import Path

from sqlalchemy import create_engine, text

# what the app/worker fixtures run on: "sqlite" (the default, what CI runs) or "postgres"
TEST_DATABASE = os.environ.get("COSERVE_TEST_DATABASE", "sqlite")
# the cluster's TimeZone: not UTC (as a server's may be), so a time read back with another offset is caught
SERVER_TIME_ZONE = "Asia/Kolkata"


def bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def server_user() -> str | None:
    """postgres refuses to run as root: as root the cluster runs as the 'postgres' user (None: as us)."""
    return "postgres" if os.geteuid() == 0 else None


def no_server_user() -> bool:
    import pwd

    if server_user() is None:
        return False
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return True
    return False


def _as_owner(args: list[str], user: str | None) -> list[str]:
    if user is None:
        return args
    runuser = shutil.which("runuser")
    if runuser:
        return [runuser, "-u", user, "--", *args]
    return ["su", user, "-s", "/bin/sh", "-c", " ".join(f"'{a}'" for a in args)]


class ClusterFailed(RuntimeError):
    """initdb or pg_ctl start failed; the message is their output."""


@contextmanager
def cluster(port: int) -> Iterator[str]:
    """A fresh cluster on ``port``; yields a server URL without a database and stops the cluster after."""
    binaries = bin_dir()
    assert binaries is not None, "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb)"
    user = server_user()
    base = Path(tempfile.mkdtemp(prefix="coserve-pg-"))  # not under pytest's root-only tmp dir
    data, sock = base / "data", base / "sock"
    sock.mkdir()
    if user is not None:
        import pwd

        owner = pwd.getpwnam(user)
        for p in (base, sock):
            os.chown(p, owner.pw_uid, owner.pw_gid)
    run = dict(check=True, capture_output=True, text=True, timeout=120)
    try:
        subprocess.run(_as_owner([str(binaries / "initdb"), "-D", str(data), "-U", "coserve", "--auth=trust",
                                  "-E", "UTF8", "--no-sync"], user), **run)
        subprocess.run(_as_owner([str(binaries / "pg_ctl"), "-D", str(data), "-l", str(base / "server.log"), "-w",
                                  "-t", "60", "-o", f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off "
                                  f"-c max_connections=300 -c timezone={SERVER_TIME_ZONE}", "start"], user), **run)
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(base, ignore_errors=True)
        raise ClusterFailed(f"could not start PostgreSQL: {exc.stdout}{exc.stderr}") from exc
    try:
        yield f"postgresql+psycopg2://coserve@127.0.0.1:{port}"
    finally:
        subprocess.run(_as_owner([str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                                 user), capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)


_databases = count(1)


def new_database(server: str) -> str:
    """A new empty database on the cluster at ``server``: its URL."""
    name = f"coserve_{os.getpid()}_{next(_databases)}"
    admin = create_engine(f"{server}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    admin.dispose()
    return f"{server}/{name}"


def drop_database(url: str) -> None:
    """Drops a test's database (``new_database``'s) once the test is done, ending what is still connected to it: the
    engines the test and its app made keep their idle connections open until they are garbage collected, and a
    suite's worth of them adds up toward the cluster's ``max_connections``."""
    server, name = url.rsplit("/", 1)
    admin = create_engine(f"{server}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    admin.dispose()


_session = ExitStack()  # the session's cluster, once started
_session_url: list[str] = []


def session_server() -> str:
    """The session's cluster (started on first use, on a free port): its server URL. ``stop_session_server`` (the
    conftest's ``pytest_sessionfinish``) stops it."""
    if not _session_url:
        from tests.conftest import free_port

        _session_url.append(_session.enter_context(cluster(free_port())))
    return _session_url[0]


def stop_session_server() -> None:
    _session_url.clear()
    _session.close()


_migrated_sqlite: Path | None = None  # this test process's SQLite file migrated to head once, copied per stack


def migrated_database_url(tmp: Path) -> str:
    """A database at the migrations' head for one stack: a copy of one SQLite file this test process migrated once
    (a migration run costs about 0.3 s, a copy a millisecond), or with ``COSERVE_TEST_DATABASE=postgres`` a new
    database on the session's cluster, migrated."""
    from app.db.migrate import upgrade

    global _migrated_sqlite
    url = fresh_database_url(tmp)
    if TEST_DATABASE != "sqlite":
        upgrade(url)
        return url
    if _migrated_sqlite is None:
        template_dir = tempfile.mkdtemp(prefix="coserve-migrated-")
        atexit.register(shutil.rmtree, template_dir, ignore_errors=True)
        template = Path(template_dir) / "coserve.db"
        upgrade(f"sqlite:///{template}")
        _migrated_sqlite = template
    shutil.copyfile(_migrated_sqlite, tmp / "coserve.db")
    return url


@contextmanager
def migrated_database(tmp: Path) -> Iterator[str]:
    """``migrated_database_url``'s database for the block: a PostgreSQL one is dropped after it (``drop_database``)."""
    url = migrated_database_url(tmp)
    try:
        yield url
    finally:
        if TEST_DATABASE == "postgres":
            drop_database(url)


def fresh_database_url(tmp: Path) -> str:
    """An empty database for one stack, not migrated: a SQLite file in ``tmp``, or with
    ``COSERVE_TEST_DATABASE=postgres`` a new database on the session's cluster."""
    if TEST_DATABASE == "postgres":
        return new_database(session_server())
    assert TEST_DATABASE == "sqlite", f"COSERVE_TEST_DATABASE is 'sqlite' or 'postgres', not {TEST_DATABASE!r}"
    return f"sqlite:///{tmp / 'coserve.db'}"


def needs_a_server() -> list:
    """The marks of a test that starts its own PostgreSQL cluster: skipped where none can be started here."""
    import pytest

    return [
        pytest.mark.skipif(bin_dir() is None, reason="PostgreSQL is not installed (no "
                           "/usr/lib/postgresql/*/bin/initdb; apt-get install postgresql)"),
        pytest.mark.skipif(no_server_user(), reason="running as root and there is no 'postgres' user to run the "
                           "server as"),
    ]
