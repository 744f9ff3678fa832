"""A batch whose API process died while validating it is validated by a worker's sweeper."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from app.batch.fanout import expires_at_for
from app.db.models import Batch, Job, new_id
from app.db.session import session_scope
from app.services.transitions import utcnow
from tests.conftest import Keys
from workers.batch_tasks import restart_stalled_validation

pytestmark = pytest.mark.integration


def test_stalled_validation_is_restarted_once(client, keys, settings):
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}}) for i in range(3)]
    lines.append("not json")
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", "\n".join(lines).encode())}).json()
    created = utcnow() - timedelta(minutes=10)
    batch_id = new_id("batch")
    with session_scope(settings.sqlalchemy_url) as s:  # what the API had committed before it died
        s.add(Batch(id=batch_id, tenant_id=keys.tenant_id, endpoint="/v1/completions", input_file_id=f["id"],
                    completion_window="1h", status="validating", tier="paid", created_at=created,
                    expires_at=expires_at_for(created, "1h")))
    assert restart_stalled_validation(settings, stale_after_s=3600) == []  # not stale yet
    assert restart_stalled_validation(settings, stale_after_s=60) == [batch_id]
    assert restart_stalled_validation(settings, stale_after_s=60) == []  # in progress now: not again
    with session_scope(settings.sqlalchemy_url) as s:
        batch = s.get(Batch, batch_id)
        assert (batch.status, batch.total, batch.failed) == ("in_progress", 4, 1)
        assert s.scalar(select(func.count()).select_from(Job).where(Job.batch_id == batch_id)) == 3
