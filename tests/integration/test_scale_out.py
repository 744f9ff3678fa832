"""Two worker processes share the model's queue through Redis and the same SQL DB."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from app.db.models import Job
from app.db.session import session_scope
from tests.conftest import Keys, wait_for

pytestmark = pytest.mark.integration


def test_two_workers_both_take_work(client, keys, settings, start_worker):
    # each worker holds at most 2 jobs in its engine, so a burst must spread over both
    start_worker("wa", COSERVE_MAX_INFLIGHT="2")
    start_worker("wb", COSERVE_MAX_INFLIGHT="2")
    ids = [client.post("/v1/jobs", headers=Keys.header(keys.paid),
                       json={"prompt": f"Item {i}", "max_tokens": 40, "ignore_eos": True}).json()["id"]
           for i in range(8)]

    def done():
        with session_scope(settings.sqlalchemy_url) as s:
            rows = s.execute(select(Job.status, Job.worker_id).where(Job.id.in_(ids))).all()
        return rows if all(r.status == "succeeded" for r in rows) else None
    rows = wait_for(done, 120, "all jobs to succeed", interval=0.5)
    by_worker = {r.worker_id for r in rows}
    assert by_worker == {"wa", "wb"}
