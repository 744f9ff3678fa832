"""The process's log lines, the same in the API and the workers: ``COSERVE_LOG_LEVEL`` (INFO by default), with the
time, level, logger and thread of each."""

from __future__ import annotations

import logging
import os

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s"
# the API's: each line names the request it was written in (app.request_id)
API_LOG_FORMAT = LOG_FORMAT.replace("%(message)s", "[request %(request_id)s] %(message)s")


def log_level() -> str:
    """``COSERVE_LOG_LEVEL``, INFO where it is unset."""
    return os.environ.get("COSERVE_LOG_LEVEL", "INFO")


def configure_logging(log_format: str = LOG_FORMAT, *filters: logging.Filter) -> None:
    """Logs to stderr at ``COSERVE_LOG_LEVEL``, each line passed through ``filters`` (which give what the format
    names beyond a record's own fields); a no-op where the process configured logging already (a test runner, an
    embedding application)."""
    root = logging.getLogger()
    if root.handlers:
        return
    logging.basicConfig(level=log_level(), format=log_format)
    for handler in root.handlers:
        for f in filters:
            handler.addFilter(f)
