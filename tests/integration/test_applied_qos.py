"""POST /v1/jobs answers with the QoS the job was given, defaults included: a batch job
without a deadline shows the default window's deadline (COSERVE_DEFAULT_BATCH_WINDOW_S, 24 h)
and an interactive job without targets the server's TTFT/TBT, so a client sees what it got."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tests.conftest import Keys

pytestmark = pytest.mark.integration


def _at(value: str) -> datetime:
    t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=UTC)


@pytest.mark.parametrize("idempotency_key", [None, "retry-1"])  # the group-commit path and the session path
def test_a_batch_job_without_a_deadline_is_answered_with_the_default_one(client, keys, settings, idempotency_key):
    headers = Keys.header(keys.paid) | ({"Idempotency-Key": idempotency_key} if idempotency_key else {})
    before = datetime.now(UTC)
    r = client.post("/v1/jobs", headers=headers, json={"kind": "batch", "prompt": "Summarize: a b c"})
    assert r.status_code == 201, r.text
    job = r.json()
    window = timedelta(seconds=settings.default_batch_window_s)
    assert before + window - timedelta(seconds=5) < _at(job["deadline_at"]) < datetime.now(UTC) + window
    got = client.get(f"/v1/jobs/{job['id']}", headers=Keys.header(keys.paid)).json()
    assert _at(got["deadline_at"]) == _at(job["deadline_at"])


def test_an_interactive_job_without_targets_is_answered_with_the_defaults(client, keys, settings):
    job = client.post("/v1/jobs", headers=Keys.header(keys.paid), json={"prompt": "Hi"}).json()
    assert (job["ttft_ms"], job["tbt_ms"], job["deadline_at"]) == (settings.default_ttft_ms,
                                                                    settings.default_tbt_ms, None)
