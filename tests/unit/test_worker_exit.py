"""A worker's process spares itself the interpreter's last full collection as it exits: it freezes what it holds
(the collection walks none of it), unless it imported vLLM, whose triton bindings would report each frozen object
of theirs as leaked; there a worker that stopped ends without the teardown, its atexit handlers and logs run first."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import types

from workers.gpu_worker import exit_quickly


def test_the_exit_freezes_the_heap_of_a_process_without_vllm(monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    gc.unfreeze()
    try:
        exit_quickly(stopped=True)
        assert gc.get_freeze_count() > 1_000
    finally:
        gc.unfreeze()


def test_the_exit_leaves_the_heap_of_a_process_with_vllm_that_failed_to_the_collector(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    gc.unfreeze()
    exit_quickly(stopped=False)
    assert gc.get_freeze_count() == 0


# A process with vLLM imported: an object the teardown would finalize, an atexit handler, a log line, then the exit
WITH_VLLM = textwrap.dedent("""
    import atexit, logging, sys, types
    sys.modules["vllm"] = types.ModuleType("vllm")
    from workers.gpu_worker import exit_quickly

    class Torn:
        def __del__(self):
            print("torn down", flush=True)

    kept = Torn()  # a module global: only the interpreter's teardown finalizes it
    atexit.register(lambda: print("atexit ran", flush=True))
    logging.basicConfig(stream=sys.stderr, format="%(message)s", level=logging.INFO)
    logging.getLogger("worker").info("worker w1 stopped")
    exit_quickly(stopped={stopped})
""")


def test_a_stopped_worker_with_vllm_ends_without_the_teardown_after_its_atexit_handlers_and_logs():
    ran = subprocess.run([sys.executable, "-c", WITH_VLLM.format(stopped=True)], capture_output=True, text=True,
                         timeout=120)
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, "atexit ran\n", "worker w1 stopped\n")


def test_a_worker_with_vllm_that_failed_keeps_the_teardown():
    ran = subprocess.run([sys.executable, "-c", WITH_VLLM.format(stopped=False)], capture_output=True, text=True,
                         timeout=120)
    assert (ran.returncode, ran.stdout) == (0, "atexit ran\ntorn down\n")
