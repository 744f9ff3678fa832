"""e2e fixtures: the real app served over HTTP by uvicorn (in a thread of the test process), and one plain stack
(database, Redis, worker, server) that the tests of a module share."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from tests.conftest import Keys, free_port, worker_stack


@contextmanager
def serving(settings) -> Iterator[str]:
    """``create_app(settings)`` behind uvicorn on a free loopback port; yields its base URL, stops it after."""
    import uvicorn

    from app.auth import clear_cache
    from app.main import create_app

    clear_cache()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning",
                                          lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise AssertionError("uvicorn did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture
def live_server(settings) -> Iterator[str]:
    """``serving(settings)`` for one test."""
    with serving(settings) as url:
        yield url


@dataclass
class Stack:
    """A migrated database, its API keys, one plain worker ``w1`` and the app behind uvicorn at ``url``."""

    settings: Any
    keys: Keys
    url: str

    def openai(self, key: str | None = None, timeout: float = 120):  # noqa: ANN201 - openai.OpenAI
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or self.keys.paid, max_retries=0,
                             timeout=timeout)


@contextmanager
def stack_of_its_own(tmp, model_dir, worker_id: str = "w1", **worker_env: str) -> Iterator[tuple]:
    """``worker_stack`` on a Redis server of its own, for a stack the tests of a module share: a test of the module
    on its own stack (``settings``, ``redis_url``: they flush the session's Redis) neither empties its queues nor
    has its jobs taken by the shared worker. Yields (settings, keys)."""
    from app.embedded import start_redis

    redis_proc, redis_url = start_redis(tmp / "redis")
    try:
        with worker_stack(tmp, redis_url, model_dir, worker_id, **worker_env) as stack:
            yield stack
    finally:
        redis_proc.terminate()
        redis_proc.wait(10)


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[Stack, dict]]:
    """One ``Stack`` for all the tests of a module that need only a plain worker: a worker start costs seconds."""
    with (stack_of_its_own(tmp_path_factory.mktemp("shared-stack"), tiny_model_dir) as (settings, keys),
          serving(settings) as url):
        yield Stack(settings, keys, url), settings.model_dump()


def unchanged(shared_stack: tuple[Stack, dict]) -> Stack:
    """The shared ``Stack``, its settings as it started. A test that changes its settings (the app reads them per
    request) does so with ``monkeypatch``, which puts them back after it; a change left behind fails the next
    test of the stack."""
    shared, as_started = shared_stack
    now = shared.settings.model_dump()
    changed = {k: (as_started[k], v) for k, v in now.items() if as_started.get(k) != v}
    assert not changed, f"an earlier test left the shared settings changed (was, now): {changed}"
    return shared


@pytest.fixture
def stack(shared_stack) -> Stack:
    """The module's shared ``Stack`` (``unchanged``)."""
    return unchanged(shared_stack)
