"""A batch fan-out run's liveness mark (``fanout._alive``, ``fanout.fan_out_alive``): held while the run lasts, in
this process or another, and let go by the kernel when the run's process is killed (SIGKILL runs no clean-up)."""

from __future__ import annotations

import signal
import subprocess
import sys

from app.batch import fanout
from tests.conftest import ROOT

HOLD = ("import sys, time\nfrom app.batch import fanout\n"
        "with fanout._alive(sys.argv[1], sys.argv[2]):\n    print('holding', flush=True)\n    time.sleep(600)\n")


def test_a_run_in_this_process_is_alive_while_it_holds_its_mark(tmp_path):
    assert not fanout.fan_out_alive(tmp_path, "batch_a")
    with fanout._alive(tmp_path, "batch_a"), fanout._alive(tmp_path, "batch_a"):  # two runs beside each other
        assert fanout.fan_out_alive(tmp_path, "batch_a")
        assert not fanout.fan_out_alive(tmp_path, "batch_b")
    assert not fanout.fan_out_alive(tmp_path, "batch_a")


def test_a_run_killed_in_another_process_holds_its_mark_no_more(tmp_path):
    run = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), "batch_a"], cwd=ROOT, stdout=subprocess.PIPE,
                           text=True)
    try:
        assert run.stdout.readline() == "holding\n"
        assert fanout.fan_out_alive(tmp_path, "batch_a")
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
        run.stdout.close()
    assert not fanout.fan_out_alive(tmp_path, "batch_a")


def test_a_run_is_the_last_alive_only_once_no_other_run_holds_the_mark(tmp_path):
    """Of two runs beside each other, the first to end is not the last alive (the other still reads the batch's
    folder); the other, ending after it, is, and holds the mark (alive) to its end."""
    with fanout._alive(tmp_path, "batch_a") as second_last:
        with fanout._alive(tmp_path, "batch_a") as first_last:
            assert not first_last()
            assert fanout.fan_out_alive(tmp_path, "batch_a")  # the second run's mark
        assert second_last()
        assert fanout.fan_out_alive(tmp_path, "batch_a")
    assert not fanout.fan_out_alive(tmp_path, "batch_a")
