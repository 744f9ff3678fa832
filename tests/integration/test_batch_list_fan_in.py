"""The batches list's fan-in (the real app, Redis and SQLite; no worker: the jobs' ends are written as a worker
would): a page of running batches is counted in one query and read, not written batch by batch; a batch whose jobs
all ended shows completed, with its output file, on the list that first sees it."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import update

from app.db.models import Job
from app.db.session import session_scope, write_guard
from app.services.transitions import utcnow
from tests.conftest import Keys
from tests.sql_statements import statements

pytestmark = pytest.mark.integration


def _batch(client, keys, lines: int) -> str:
    """A batch of ``lines`` one-job lines, validated and fanned out (TestClient runs the fan-out before it returns)."""
    text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}}) for i in range(lines))
    auth = Keys.header(keys.paid)
    f = client.post("/v1/files", headers=auth, data={"purpose": "batch"}, files={"file": ("in.jsonl", text)}).json()
    return client.post("/v1/batches", headers=auth, json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                          "completion_window": "24h"}).json()["id"]


def _succeed(settings, batch_id: str, lines: list[str]) -> None:
    """The batch's jobs of ``lines`` (custom ids) succeed, as a worker commits them."""
    with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
        s.execute(update(Job).where(Job.batch_id == batch_id, Job.custom_id.in_(lines)).values(
            status="succeeded", output_text="Hello", finish_reason="stop", prompt_tokens=1, completion_tokens=2,
            finished_at=utcnow()))
        s.commit()


def test_a_page_of_running_batches_is_counted_in_one_query_and_a_done_one_shows_completed(client, keys, settings):
    auth = Keys.header(keys.paid)
    batch_ids = [_batch(client, keys, 2) for _ in range(3)]
    for batch_id in batch_ids:
        _succeed(settings, batch_id, ["c0"])
    with statements() as listed:
        page = client.get("/v1/batches", headers=auth).json()["data"]
    assert {b["id"]: (b["status"], b["request_counts"]) for b in page} == {
        batch_id: ("in_progress", {"total": 2, "completed": 1, "failed": 0}) for batch_id in batch_ids}
    assert not [q for q in listed if q.lstrip().upper().startswith("UPDATE")], listed  # read, not written
    assert sum("FROM jobs" in q for q in listed) == 2, listed  # the page's counts, then its usage
    _succeed(settings, batch_ids[1], ["c1"])
    page = {b["id"]: b for b in client.get("/v1/batches", headers=auth).json()["data"]}
    assert [page[b]["status"] for b in batch_ids] == ["in_progress", "completed", "in_progress"]
    assert page[batch_ids[1]]["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    out = client.get(f"/v1/files/{page[batch_ids[1]]['output_file_id']}/content", headers=auth).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in out) == ["c0", "c1"]
