"""The API process logs as the workers do: at COSERVE_LOG_LEVEL, each line with its time, level, logger and
thread, and the API's with its request's id (a process of its own: the test runner configures logging in this one)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# the app as `uvicorn --factory app.main:app_factory` makes it, then one of its loggers' INFO line
LOG_AN_INFO_LINE = ("import logging; from app.main import app_factory; app_factory(); "
                    "logging.getLogger('app.api.jobs').info('an API info line')")


def _api_stderr(settings, level: str) -> str:
    env = {**os.environ, "COSERVE_DATA_DIR": str(settings.data_dir), "COSERVE_MODEL": settings.model,
           "REDIS_URL": settings.redis_url, "COSERVE_BACKEND": "torch", "COSERVE_LOG_LEVEL": level}
    proc = subprocess.run([sys.executable, "-c", LOG_AN_INFO_LINE], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.mark.parametrize("level, logged", [("INFO", True), ("WARNING", False)])
def test_the_api_logs_at_coserve_log_level(settings, level, logged):
    """Before, only the worker configured logging: the API's INFO lines were dropped whatever the level said."""
    stderr = _api_stderr(settings, level)
    # a line written outside a request names none (app.request_id)
    assert ("INFO app.api.jobs [MainThread] [request -] an API info line" in stderr) is logged, stderr[-2000:]
