"""A GPU worker's own log lines keep ``COSERVE_LOG_LEVEL``'s level (INFO by default) once its Celery consumer is set
up: Celery sets the root logger's level to the consumer's, which was WARNING, so the worker's INFO lines (its engine's
set-up, the cost model's calibration) were dropped. Each case runs in a fresh interpreter: Celery sets logging up once
per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# builds the consumer as ``run_worker`` does (no broker is reached before ``start``) and prints what passes
PROBE = """
import logging
from app.observability.logs import configure_logging
from workers.celery_app import consumer, get_celery

configure_logging()
consumer(get_celery("redis://127.0.0.1:9/0"), ["coserve.m"], "w@host")
print(logging.getLogger("workers.gpu_worker").isEnabledFor(logging.INFO),
      logging.getLogger("celery.app.trace").isEnabledFor(logging.INFO),
      logging.getLogger("workers.gpu_worker").isEnabledFor(logging.DEBUG))
"""


@pytest.mark.parametrize(("level", "seen"), [(None, "True False False"), ("DEBUG", "True True True"),
                                            ("WARNING", "False False False")])
def test_the_workers_lines_keep_coserve_log_level_under_celery(level, seen):
    env = {k: v for k, v in os.environ.items() if k != "COSERVE_LOG_LEVEL"}
    if level is not None:
        env["COSERVE_LOG_LEVEL"] = level
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    # (the worker's INFO lines, Celery's per-task INFO lines, the worker's DEBUG lines) pass
    assert out.stdout.split("\n")[-2] == seen, out.stderr
