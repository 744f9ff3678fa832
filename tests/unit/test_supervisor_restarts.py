"""`coserve up`'s supervisor starts a worker that exited again (same arguments, environment and log), a bounded number
of times, and leaves the other children's exits to its caller (Redis or the API gone stops everything)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from app.embedded import ChildExit, RestartDelay, RestartLimit, Supervisor, _kill_leftovers
from tests.conftest import wait_for

# a worker that gives its engine up: says who it is and why, and exits with status 1, as a real process
GIVES_UP = ("import os, sys; print('worker', os.environ['COSERVE_WORKER_ID'], 'pid', os.getpid()); "
            "sys.exit('worker w1 stops: the engine still holds an aborted request')")


AT_ONCE = RestartDelay(first_s=0)  # no wait before a restart: the tests of what a restart is


def _exited(sup: Supervisor, name: str) -> list[ChildExit]:
    return wait_for(lambda: [e for e in sup.tend() if e.name == name], 60, f"{name} to exit", interval=0.05)


def test_a_worker_that_exits_is_started_again_alike_until_its_limit(tmp_path: Path):
    """`coserve up` stopped the API and Redis, and every stream they served, when its worker exited on purpose (an
    engine given up on, an OOM kill): the worker comes back, as under systemd, and gives up after its limit."""
    sup = Supervisor()
    log = tmp_path / "logs" / "worker.log"
    first = sup.spawn("worker", [sys.executable, "-c", GIVES_UP], {"COSERVE_WORKER_ID": "w1", "PYTHONUNBUFFERED": "1"},
                      log, restart=RestartLimit(restarts=2, window_s=600, delay=AT_ONCE))
    pids = [first.pid]
    for _ in range(2):
        assert _exited(sup, "worker") == [ChildExit("worker", 1, "worker w1 stops: the engine still holds an aborted "
                                                                 "request", restart_in_s=0.0)]
        (_name, proc), = sup.procs
        assert proc.pid not in pids and proc.poll() in (None, 1)
        pids.append(proc.pid)
    assert _exited(sup, "worker") == [ChildExit("worker", 1, "worker w1 stops: the engine still holds an aborted "
                                                             "request", restart_in_s=None)]
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
        assert _exited(sup, "api") == [ChildExit("api", 1, "address already in use", restart_in_s=None)]
        assert serving.poll() is None and [name for name, _p in sup.procs] == ["api", "worker"]
    finally:
        sup.stop()


def test_a_killed_worker_comes_back_in_its_place_and_is_stopped_with_the_rest(tmp_path: Path):
    """A worker SIGKILLed (the kernel's OOM killer) is started again, and ``stop`` stops the new one, in start order's
    reverse (the API's place before it is kept)."""
    sup = Supervisor()
    sleeps = [sys.executable, "-c", "import time; time.sleep(60)"]
    sup.spawn("api", sleeps, {}, tmp_path / "api.log")
    killed = sup.spawn("worker", sleeps, {}, tmp_path / "worker.log", restart=RestartLimit(restarts=1, delay=AT_ONCE))
    killed.send_signal(signal.SIGKILL)
    assert _exited(sup, "worker") == [ChildExit("worker", -signal.SIGKILL, None, restart_in_s=0.0)]
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


EXITS_AT_ONCE = [sys.executable, "-c", "pass"]  # a worker that cannot start (a bad model path, a device held)


def test_by_default_a_worker_that_exits_is_not_started_again_at_once(tmp_path: Path):
    """A worker that crashed at once (a bad model path, a GPU a leftover process holds) was started again in the same
    pass, and spent its five restarts in seconds: it now waits ``RestartDelay.first_s`` (1 s) first."""
    sup = Supervisor()
    first = sup.spawn("worker", EXITS_AT_ONCE, {}, tmp_path / "worker.log", restart=RestartLimit())
    ended, = _exited(sup, "worker")
    assert dict(sup.procs)["worker"] is first  # not yet started again
    assert ended.restart_in_s == RestartDelay.first_s == 1.0 and ended.restarted


def test_each_restart_waits_twice_the_last_up_to_a_cap_and_a_long_run_starts_over(tmp_path: Path):
    """As systemd's RestartSec / RestartSteps / RestartMaxDelaySec and Kubernetes' CrashLoopBackOff: 1, 2, then the
    cap (3 here), and a run of ``steady_s`` or more (no crash loop) waits the first delay again. The supervisor's
    clock is given: a restart starts on the first ``tend`` at or past its time, not before."""
    clock = [100.0]
    sup = Supervisor(clock=lambda: clock[0])
    limit = RestartLimit(restarts=10, delay=RestartDelay(first_s=1, max_s=3, steady_s=60))
    sup.spawn("worker", EXITS_AT_ONCE, {}, tmp_path / "worker.log", restart=limit)
    waits = []
    for ran_s in (0, 0, 0, 0, 60):
        clock[0] += ran_s  # how long the run lasted, by the supervisor's clock
        ended, = _exited(sup, "worker")
        waits.append(ended.restart_in_s)
        dead = dict(sup.procs)["worker"]
        clock[0] += ended.restart_in_s - 0.01
        assert sup.tend() == [] and dict(sup.procs)["worker"] is dead  # not due yet, nor its exit told again
        clock[0] += 0.01
        assert sup.tend() == [] and dict(sup.procs)["worker"] is not dead  # due: a new one
    assert waits == [1, 2, 3, 3, 1]
    sup.stop()


def test_while_a_restart_waits_the_other_children_are_watched_and_stop_stops_all(tmp_path: Path):
    """The wait is no sleep in the supervisor's loop: the API's exit is seen during it (`coserve up` stops
    everything), and ``stop`` does not start the waiting worker."""
    clock = [0.0]
    sup = Supervisor(clock=lambda: clock[0])
    api = sup.spawn("api", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "api.log")
    sup.spawn("worker", EXITS_AT_ONCE, {}, tmp_path / "worker.log", restart=RestartLimit())
    assert _exited(sup, "worker")[0].restart_in_s == 1.0
    api.kill()
    assert _exited(sup, "api") == [ChildExit("api", -signal.SIGKILL, None, restart_in_s=None)]
    sup.stop()
    clock[0] += 3600
    sup.tend()
    assert [(name, p.poll() is not None) for name, p in sup.procs] == [("api", True), ("worker", True)]


# a worker whose engine core outlives it: it forks a child (that exits at once, or lives on) and exits without waiting
# for it; the child stays in the worker's process group, a zombie once it exits, until whoever inherits it reaps it
LEAVES_A_CHILD = "import os, time\npid = os.fork()\nif pid == 0:\n    {child}\n    os._exit(0)\nprint(pid, flush=True)"
PR_SET_CHILD_SUBREAPER = 36


def _state(pid: int) -> str:
    """The process's state letter in /proc (Z: a zombie)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


@contextmanager
def _pid_1_that_does_not_reap():
    """This process stands for a container's PID 1 that does not reap: the orphans of its children come to it (a
    child subreaper), and it leaves them zombies. Yields the pids of the orphans to reap at the end."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    orphans: list[int] = []
    try:
        yield orphans
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _dead_leader_of(child: str, orphans: list[int]) -> int:
    """Runs a group leader that forks ``child`` (Python code) and exits; returns the group, the child's pid noted."""
    leader = subprocess.Popen([sys.executable, "-c", LEAVES_A_CHILD.format(child=child)], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    orphans.append(int(leader.stdout.readline()))
    assert leader.wait(60) == 0
    return leader.pid


def test_a_zombie_left_in_a_dead_workers_group_does_not_hold_up_its_restart(caplog):
    """Where PID 1 does not reap (a container whose init is an application), the child a worker left behind stays a
    zombie in the worker's process group, and a zombie takes signals: SIGKILL to the group went on 'succeeding', so
    the restart waited the full 10 s for nothing and warned that processes outlived SIGKILL. A zombie is gone."""
    with _pid_1_that_does_not_reap() as orphans:
        group = _dead_leader_of("pass", orphans)
        wait_for(lambda: _state(orphans[0]) == "Z", 60, "the worker's child to be a zombie")
        with caplog.at_level(logging.WARNING, logger="app.embedded"):
            _kill_leftovers(group)
        assert [r.getMessage() for r in caplog.records] == []
        assert _state(orphans[0]) == "Z"  # it was there all along, a zombie


def test_a_live_process_left_in_a_dead_workers_group_is_killed_before_the_restart(caplog):
    """The engine core a worker left running holds the device the new worker needs: it is killed, not taken for
    gone."""
    with _pid_1_that_does_not_reap() as orphans:
        group = _dead_leader_of("time.sleep(120)", orphans)
        assert _state(orphans[0]) != "Z"
        with caplog.at_level(logging.WARNING, logger="app.embedded"):
            _kill_leftovers(group)
        assert _state(orphans[0]) == "Z" and [r.getMessage() for r in caplog.records] == []


# ends 5 s after its SIGTERM, as uvicorn's worker processes go on loading the app through one, then exit 0
SLOW_TO_END = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (time.sleep(5), sys.exit(0))); "
               "print('started', flush=True); time.sleep(120)")


def test_children_still_starting_are_not_given_the_grace_of_serving_ones(tmp_path: Path):
    """A Ctrl-C while `coserve up` waited for its API stood some 16 s on "stopping ...": the API (uvicorn with
    worker processes) ended only at the SIGKILL after the whole grace. Before the stack served, nothing is lost
    by not waiting; once it served, the API and the worker get their grace to finish what they hold."""
    from app.cli.service_cmds import stop_children

    for serving, ended in ((False, -signal.SIGKILL), (True, 0)):
        sup = Supervisor()
        log = tmp_path / f"api-{serving}.log"
        api = sup.spawn("api", [sys.executable, "-c", SLOW_TO_END], {"PYTHONUNBUFFERED": "1"}, log)
        wait_for(lambda: "started" in log.read_text(), 60, "the child to start")  # its SIGTERM handler set
        stop_children(sup, serving)
        assert api.returncode == ended, (serving, api.returncode)


def test_an_adopted_child_says_why_it_stopped_from_its_own_log(tmp_path: Path):
    """`coserve up` said only "redis exited; stopping" where its embedded Redis stopped: it adopts Redis (started by
    ``start_redis``, which writes its own log), and the exit now carries the last line Redis logged since; a line
    from before it was adopted (its start-up) is not the reason."""
    log = tmp_path / "redis.log"
    log.write_text("1:M # Server initialized\n")
    # a stand-in that logs, as redis-server does, once the supervisor holds it, and stops
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.stdin.read(); open({str(log)!r}, 'a').write("
                             "'1:M # Error writing to the AOF file: No space left on device\\n'); sys.exit(1)"],
                            stdin=subprocess.PIPE)
    sup = Supervisor()
    sup.adopt("redis", proc, log)
    sup.adopt("quiet", subprocess.Popen([sys.executable, "-c", "pass"]), tmp_path / "no.log")  # no log at all
    proc.stdin.close()
    assert _exited(sup, "redis") == [ChildExit("redis", 1, "1:M # Error writing to the AOF file: No space left on "
                                                           "device", restart_in_s=None)]
    assert _exited(sup, "quiet") == [ChildExit("quiet", 0, None, restart_in_s=None)]
