"""The worker's sweeper finalizes a batch with nobody polling it (no API read in between)."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from app.db.models import Batch, Job
from app.db.session import session_scope
from tests.conftest import Keys, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def test_worker_sweeper_finalizes_batch(client, keys, settings, start_worker):
    start_worker("w1")
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}})
             for i in range(3)]
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", "\n".join(lines).encode())}).json()
    b = client.post("/v1/batches", headers=Keys.header(keys.paid),
                    json={"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "1h"}).json()
    url = settings.sqlalchemy_url

    def jobs_done():
        with session_scope(url) as s:
            st = list(s.scalars(select(Job.status).where(Job.batch_id == b["id"])))
            return len(st) == 3 and set(st) == {"succeeded"}

    wait_for(jobs_done, 60, "the batch's jobs")

    def finalized():
        with session_scope(url) as s:
            row = s.get(Batch, b["id"])
            return row.status == "completed" and row.output_file_id and row

    row = wait_for(finalized, 30, "the worker to finalize the batch", interval=0.2)
    assert row.completed == 3 and row.failed == 0 and row.error_file_id is None
