"""`coserve up`'s supervisor starts a worker that exited again (same arguments, environment and log), a bounded number
of times, and leaves the other children's exits to its caller (Redis or the API gone stops everything)."""

from __future__ import annotations

import sys
from pathlib import Path

from app.embedded import ChildExit, RestartLimit, Supervisor
from tests.conftest import wait_for

# a worker that gives its engine up: says who it is and why, and exits with status 1, as a real process
GIVES_UP = ("import os, sys; print('worker', os.environ['COSERVE_WORKER_ID'], 'pid', os.getpid()); "
            "sys.exit('worker w1 stops: the engine still holds an aborted request')")


def _exited(sup: Supervisor, name: str) -> list[ChildExit]:
    return wait_for(lambda: [e for e in sup.tend() if e.name == name], 60, f"{name} to exit", interval=0.05)


def test_a_worker_that_exits_is_started_again_alike_until_its_limit(tmp_path: Path):
    """`coserve up` stopped the API and Redis, and every stream they served, when its worker exited on purpose (an
    engine given up on, an OOM kill): the worker comes back, as under systemd, and gives up after its limit."""
    sup = Supervisor()
    log = tmp_path / "logs" / "worker.log"
    first = sup.spawn("worker", [sys.executable, "-c", GIVES_UP], {"COSERVE_WORKER_ID": "w1", "PYTHONUNBUFFERED": "1"},
                      log, restart=RestartLimit(restarts=2, window_s=600))
    pids = [first.pid]
    for _ in range(2):
        assert _exited(sup, "worker") == [ChildExit("worker", 1, "worker w1 stops: the engine still holds an aborted "
                                                                 "request", restarted=True)]
        (_name, proc), = sup.procs
        assert proc.pid not in pids and proc.poll() in (None, 1)
        pids.append(proc.pid)
    assert _exited(sup, "worker") == [ChildExit("worker", 1, "worker w1 stops: the engine still holds an aborted "
                                                             "request", restarted=False)]
    # every run had the first one's arguments and environment (its worker id), and wrote on the same log
    runs = [line for line in log.read_text().splitlines() if line.startswith("worker w1 pid")]
    assert runs == [f"worker w1 pid {pid}" for pid in pids]


def test_only_a_child_spawned_with_a_limit_is_started_again(tmp_path: Path):
    """The API (and Redis) are not restarted: the caller stops everything where one exits."""
    sup = Supervisor()
    sup.spawn("api", [sys.executable, "-c", "import sys; sys.exit('address already in use')"], {},
              tmp_path / "api.log")
    serving = sup.spawn("worker", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "worker.log",
                        restart=RestartLimit())
    try:
        assert _exited(sup, "api") == [ChildExit("api", 1, "address already in use", restarted=False)]
        assert serving.poll() is None and [name for name, _p in sup.procs] == ["api", "worker"]
    finally:
        sup.stop()


def test_a_killed_worker_comes_back_in_its_place_and_is_stopped_with_the_rest(tmp_path: Path):
    """A worker SIGKILLed (the kernel's OOM killer) is started again, and ``stop`` stops the new one, in start order's
    reverse (the API's place before it is kept)."""
    import signal

    sup = Supervisor()
    sleeps = [sys.executable, "-c", "import time; time.sleep(60)"]
    sup.spawn("api", sleeps, {}, tmp_path / "api.log")
    killed = sup.spawn("worker", sleeps, {}, tmp_path / "worker.log", restart=RestartLimit(restarts=1))
    killed.send_signal(signal.SIGKILL)
    assert _exited(sup, "worker") == [ChildExit("worker", -signal.SIGKILL, None, restarted=True)]
    names = [name for name, _p in sup.procs]
    new = dict(sup.procs)["worker"]
    assert names == ["api", "worker"] and new.pid != killed.pid and new.poll() is None
    sup.stop()
    assert all(p.poll() is not None for _name, p in sup.procs)


def test_the_restart_limit_counts_restarts_within_its_window():
    """N restarts within any window, as systemd's StartLimitBurst within StartLimitIntervalSec; those older than the
    window no longer count. Pure logic: the times are given."""
    limit = RestartLimit(restarts=2, window_s=60)
    assert limit.take(0.0) and limit.take(10.0)
    assert not limit.take(20.0)  # a third within a minute: a crash loop
    assert limit.take(60.0) and limit.taken == 2  # the one at 0 s left the window; the refused one never counted
    assert not limit.take(65.0)
    assert not RestartLimit(restarts=0).take(0.0)  # 0: never restart
