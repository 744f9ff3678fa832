"""The vLLM tests' engine runs, each in a process of its own (vLLM's in-process engine core is process-wide), forked
from one server process that imported vLLM and coserve's engine once: multiprocessing's forkserver with a preload.

``python -m MODULE ARGS`` paid those imports (10-20 s on the 2-core CI box) in every run; a forked run starts with
them done and runs the module as ``-m`` would, its own environment and output files included. Nothing in the server
runs an engine or a torch operation, so no thread pool is forked half-made."""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# what every engine run imports before it builds its engine (vLLM's engine, model runner and CPU worker)
PRELOAD = ["torch", "vllm", "vllm.v1.engine.llm_engine", "vllm.v1.worker.cpu_worker",
           "vllm.model_executor.models.llama", "gpu_runtime.vllm.build", "gpu_runtime.vllm.engine",
           "gpu_runtime.vllm.scheduler",
           "gpu_runtime.vllm.offline", "app.services.model_info"]


@dataclass
class Finished:
    """How a run ended, as ``subprocess.run`` reports it."""

    returncode: int
    stdout: str
    stderr: str


def _run_module(module: str, argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """In the forked process: ``python -m module *argv`` with ``env`` added, its output to the files ``out``/``err``."""
    os.environ.update(env)
    for path, fd in ((out, 1), (err, 2)):
        with open(path, "w") as f:
            os.dup2(f.fileno(), fd)  # the loggers imported in the server write to sys.stdout/stderr: same fds
    sys.argv = [module, *argv]
    code: object = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if code not in (0, None):
        raise SystemExit(code)


def run_module(module: str, *argv: str, env: dict[str, str] | None = None, cwd: Path | None = None,
               timeout: float = 600) -> Finished:
    """Runs ``python -m module *argv`` in a process forked from the preloaded server (started on the first call);
    ``env``: variables added to the environment the server was started with."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # used when the server starts: the first call of a test process
    with tempfile.TemporaryDirectory(prefix="engine-run-") as tmp:
        out, err = f"{tmp}/stdout", f"{tmp}/stderr"
        here = os.getcwd()
        if cwd is not None:
            os.chdir(cwd)  # the forked process starts where this one is (spawn's preparation data)
        try:
            proc = ctx.Process(target=_run_module, args=(module, list(argv), env or {}, out, err))
            proc.start()
        finally:
            os.chdir(here)
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
        text = [Path(f).read_text(errors="replace") if Path(f).exists() else "" for f in (out, err)]
        return Finished(proc.exitcode if proc.exitcode is not None else -9, *text)
