"""vLLM's operational routes on the real app (HTTP), Redis, Celery worker and DB: ``/ping`` (SageMaker's probe),
``/load`` (the jobs in flight) and ``POST /reset_prefix_cache`` (a control message each live worker's engine thread
answers)."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest

from app.db.models import WorkerState
from app.db.session import session_scope
from tests.conftest import Keys, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

H = Keys.header


def test_ping_load_and_a_prefix_cache_reset_that_every_worker_answers(live_server, keys, start_worker, settings):
    assert httpx.get(f"{live_server}/ping").status_code == 503  # no worker yet: not ready, as /health
    assert httpx.post(f"{live_server}/ping").status_code == 503
    r = httpx.post(f"{live_server}/v1/jobs", json={"prompt": "Say hi", "max_tokens": 2}, headers=H(keys.paid))
    assert r.status_code == 201, r.text
    assert httpx.get(f"{live_server}/load").json() == {"server_load": 1}  # accepted, not finished
    start_worker("w1")
    wait_for(lambda: httpx.post(f"{live_server}/ping").status_code == 200, 60, "a ready service")
    wait_for(lambda: httpx.get(f"{live_server}/load").json()["server_load"] == 0, 60, "the job finished")

    assert httpx.post(f"{live_server}/reset_prefix_cache", headers=H(keys.paid)).status_code == 403
    r = httpx.post(f"{live_server}/reset_prefix_cache", headers=H(keys.admin), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "reset": True, "workers": {"w1": {"reset": True}}}, r.text

    with session_scope(settings.sqlalchemy_url) as s:  # a worker whose heartbeat is fresh but which does not listen
        s.add(WorkerState(id="ghost", queue="q", device="cpu", model=settings.model_name, draining=False,
                          heartbeat_at=datetime.now(UTC), state={"served": [settings.model_name]}))
    r = httpx.post(f"{live_server}/reset_prefix_cache", headers=H(keys.admin), params={"reset_running_requests": True},
                   timeout=60)
    assert r.status_code == 409 and r.json()["success"] is False and r.json()["workers"] == {
        "ghost": {"reset": False, "error": "not listening on its control channel"}, "w1": {"reset": True}}, r.text
