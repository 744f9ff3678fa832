"""e2e fixtures: the real app served over HTTP by uvicorn (in a thread of the test process)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.conftest import free_port


@pytest.fixture
def live_server(settings) -> Iterator[str]:
    """``create_app(settings)`` behind uvicorn on a free loopback port; yields its base URL."""
    import uvicorn

    from app.auth import clear_cache
    from app.main import create_app

    clear_cache()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning",
                                          lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise AssertionError("uvicorn did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(15)
