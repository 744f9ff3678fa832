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


def test_only_the_first_app_of_a_process_collects_before_it_freezes(settings, monkeypatch):
    from fastapi.testclient import TestClient

    import app.main
    from app.main import create_app

    collections = []
    monkeypatch.setattr(app.main.gc, "collect", lambda *a: collections.append(a) or 0)
    monkeypatch.setattr(app.main, "_collected_at_start", False)
    for _ in range(2):
        with TestClient(create_app(settings)) as c:
            assert c.get("/healthz").status_code == 200
            assert gc.get_freeze_count() > 10_000  # both froze
    assert collections == [()]  # a full collection (~1 s with torch loaded) at the first start only
