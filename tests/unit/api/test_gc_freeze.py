"""The API freezes what its start-up made out of the garbage collector's walks while it serves, and lets go of it
when it stops."""

from __future__ import annotations

import gc


def test_start_up_objects_are_frozen_while_the_app_serves_and_released_when_it_stops(settings):
    from fastapi.testclient import TestClient

    from app.main import create_app

    gc.unfreeze()
    with TestClient(create_app(settings)) as c:
        assert c.get("/healthz").status_code == 200
        assert gc.get_freeze_count() > 10_000  # the modules, routes and schemas start-up made
    assert gc.get_freeze_count() == 0
