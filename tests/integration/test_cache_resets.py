"""vLLM's cache resets (``POST /reset_prefix_cache``, ``/reset_mm_cache``, ``/reset_encoder_cache``) as vLLM's
benchmark sweep posts them after each run, over HTTP with a real migrated DB and a real Redis (no worker)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from app.db.models import WorkerState
from app.db.session import session_scope
from tests.conftest import Keys

pytestmark = pytest.mark.integration

H = Keys.header


def test_every_reset_a_vllm_client_posts_is_answered_in_vllms_shape(client, keys, settings):
    """vLLM answers ``{"success": bool}`` to a prefix-cache reset, and an empty 200 to the multi-modal and encoder
    resets of a text-only model; all three need the admin key."""
    for route in ("/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache"):
        assert client.post(route).status_code == 401
        assert client.post(route, headers=H(keys.paid)).status_code == 403
    for route in ("/reset_mm_cache", "/reset_encoder_cache"):
        r = client.post(route, headers=H(keys.admin))
        assert r.status_code == 200 and r.content == b"", r.text
    r = client.post("/reset_prefix_cache", headers=H(keys.admin))  # no live worker: nothing kept
    assert r.status_code == 200 and r.json() == {"success": True, "reset": True, "workers": {}}, r.text
    with session_scope(settings.sqlalchemy_url) as s:  # a worker whose heartbeat is fresh but which does not listen
        s.add(WorkerState(id="ghost", queue="q", device="cpu", model=settings.model_name, draining=False,
                          heartbeat_at=datetime.now(UTC), state={"served": [settings.model_name]}))
    r = client.post("/reset_prefix_cache", headers=H(keys.admin))
    assert r.status_code == 409 and r.json() == {"success": False, "reset": False, "workers": {
        "ghost": {"reset": False, "error": "not listening on its control channel"}}}, r.text
