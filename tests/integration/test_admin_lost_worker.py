"""An operator's resume of a relegated job whose worker died (real worker processes, SIGKILLed as in
test_crash_recovery.py): no message reaches a dead worker, so the job is given back, as the sweeper gives back a job
whose lease expired, at once, and a live worker runs it."""

from __future__ import annotations

import os
import signal

import pytest
from sqlalchemy import select

from app.db.models import Job, JobEvent
from app.db.session import session_scope
from tests.conftest import Keys, wait_for

pytestmark = pytest.mark.integration

H = Keys.header


def test_a_resume_of_a_dead_workers_relegated_job_gives_it_to_a_live_worker(client, keys, settings, start_worker):
    # a paid job holding the whole (tiny) KV pool, and a free job with a 1 ms TTFT beside it: relegated
    w1 = start_worker("w1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build", COSERVE_KV_BLOCKS="32",
                      COSERVE_STEP_DELAY_S="0.08", COSERVE_KV_RESERVE="max_tokens")

    def submit(key: str, **body) -> str:
        r = client.post("/v1/jobs", headers=H(key), json=body)
        assert r.status_code == 201, r.text
        return r.json()["id"]

    def status(job_id: str) -> str:
        return client.get(f"/admin/api/jobs/{job_id}", headers=H(keys.admin)).json()["job"]["status"]

    hog = submit(keys.paid, prompt="Write a long story.", max_tokens=470, ignore_eos=True)
    wait_for(lambda: status(hog) == "running", 60, "the paid job to run")
    late = submit(keys.free, prompt="Quick question?", max_tokens=8, ttft_ms=1)
    wait_for(lambda: status(late) == "relegated", 60, "the free job's relegation")
    os.killpg(w1.pid, signal.SIGKILL)  # the worker and anything it started, no chance to clean up
    w1.wait(10)
    client.post(f"/admin/api/jobs/{hog}/cancel", headers=H(keys.admin))  # not what this test looks at

    def w1_lost() -> bool:
        workers = client.get("/admin/api/overview", headers=H(keys.admin)).json()["workers"]
        return [w["alive"] for w in workers if w["id"] == "w1"] == [False]
    wait_for(w1_lost, 30, "the dashboard to read w1 as lost")

    r = client.post(f"/admin/api/jobs/{late}/resume", headers=H(keys.admin))
    assert r.status_code == 200, r.text
    body = r.json()
    # given back at once, not left relegated on a dead worker until its lease runs out and a sweeper finds it
    assert (body.get("status"), body["worker_id"], body["delivered"], body.get("worker_lost")) == (
        "dispatched", "w1", False, True), body
    assert "worker w1 is lost" in body["detail"] and "the first that starts runs it" in body["detail"], body
    assert status(late) == "dispatched"

    start_worker("w2")
    wait_for(lambda: status(late) == "succeeded", 120, "w2 to run the resumed job")
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, late)
        assert (job.worker_id, job.attempt) == ("w2", 2)
        details = [d or "" for d in s.scalars(select(JobEvent.detail).where(JobEvent.job_id == late)
                                                .order_by(JobEvent.id))]
    assert any(d.startswith("resumed by an admin: its worker w1 is lost") for d in details), details
    assert not any(d.startswith("lease of w1 expired") for d in details), details  # the resume, not the sweeper
