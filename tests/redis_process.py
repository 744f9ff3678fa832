"""A redis-server of a test's own, to stop mid-test and start again on the same port (the
session-wide server in ``tests/conftest.py`` is shared, so it must stay up)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass
class RestartableRedis:
    directory: Path
    persist: bool = False  # keep the data across a restart (an append-only file), else restart empty
    port: int = 0  # chosen by the first start, reused by the next ones
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> str:
        from app.embedded import start_redis

        self.proc, url = start_redis(self.directory, self.port or None, persist=self.persist)
        self.port = int(url.rsplit(":", 1)[1].split("/")[0])
        return url

    def stop(self) -> None:
        """SIGTERM, as an operator's restart would (a persisting server flushes its file first)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


def _running(server: RestartableRedis) -> Iterator[RestartableRedis]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_redis(tmp_path) -> Iterator[RestartableRedis]:
    """A started server that comes back empty after a restart (Redis without persistence)."""
    yield from _running(RestartableRedis(tmp_path / "own-redis"))


@pytest.fixture
def persistent_redis(tmp_path) -> Iterator[RestartableRedis]:
    """A started server that keeps its data across a restart (append-only file)."""
    yield from _running(RestartableRedis(tmp_path / "own-redis", persist=True))
