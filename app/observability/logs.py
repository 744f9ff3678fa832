"""The process's log lines, the same in the API and the workers: ``COSERVE_LOG_LEVEL`` (INFO by default), with the
time, level, logger and thread of each."""

from __future__ import annotations

import logging
import os

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s"


def configure_logging() -> None:
    """Logs to stderr at ``COSERVE_LOG_LEVEL``; a no-op where the process configured logging already (a test runner,
    an embedding application)."""
    logging.basicConfig(level=os.environ.get("COSERVE_LOG_LEVEL", "INFO"), format=LOG_FORMAT)
