"""The worker turns a job row into the engine's request with the job's own QoS (real DB and Redis,
the API's submission path; the engine is not started)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.auth import authenticate
from app.db.models import Job
from app.db.session import session_scope
from app.schemas import JobCreate
from app.services.jobs import submit_job
from gpu_runtime.qos import QoSClass, TbtAnchor
from workers.decode_history import history_key
from workers.gpu_worker import GpuWorker

pytestmark = pytest.mark.integration


def test_requests_carry_each_jobs_tbt_anchor_targets_and_history_key(settings, keys):
    worker = GpuWorker(settings)
    worker.engine = SimpleNamespace(executor=SimpleNamespace(now=lambda: 100.0))
    url = settings.sqlalchemy_url
    specs = {"paced": JobCreate(prompt="hi", ttft_ms=800, tbt_ms=40, tbt_anchor="first-token", app_id="chat"),
             "default": JobCreate(prompt="hi"),
             "batch": JobCreate(prompt="hi", kind="batch", deadline_window_s=600)}
    with session_scope(url) as s:
        principal = authenticate(s, keys.paid)
        ids = {name: submit_job(s, principal, spec, settings, dispatch=False).job.id for name, spec in specs.items()}
    with session_scope(url) as s:
        req = {name: worker._request(s.get(Job, job_id)) for name, job_id in ids.items()}
    paced, default, batch = req["paced"].qos, req["default"].qos, req["batch"].qos
    assert (paced.ttft_s, paced.tbt_s, paced.tbt_anchor) == (0.8, 0.04, TbtAnchor.FIRST_TOKEN)
    assert default.tbt_anchor is TbtAnchor(settings.tbt_anchor) and default.tbt_s == settings.default_tbt_ms / 1e3
    assert batch.qos_class is QoSClass.BATCH and 590 < batch.ttlt_s <= 600
    assert req["paced"].app_id == history_key("chat", keys.tenant_id, "interactive")
    assert req["batch"].app_id == history_key(None, keys.tenant_id, "batch")
