"""The test workers' stop (``tests.conftest.WorkerPool.stop``) kills a worker only once its log says it stopped
since its SIGTERM: an earlier run's line under the same worker id (its log is appended to) does not count."""

from __future__ import annotations

from tests.conftest import _said_stopped

STOPPED = b"2026-12-01 04:47:20,712 INFO __main__ [MainThread] worker w1 stopped (0 jobs given back)\n"


def test_a_stop_counts_only_after_the_sigterm(tmp_path):
    log = tmp_path / "w1.log"
    log.write_bytes(b"worker: Warm shutdown (MainProcess)\n" + STOPPED + b"2026-12-01 starting again\n")
    since = log.stat().st_size
    assert not _said_stopped(log, since)  # the earlier run's stop
    with open(log, "ab") as f:
        f.write(b"worker: Warm shutdown (MainProcess)\n")
    assert not _said_stopped(log, since)  # stopping, not stopped
    with open(log, "ab") as f:
        f.write(STOPPED)
    assert _said_stopped(log, since)
