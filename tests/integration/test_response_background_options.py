"""A Responses request's ``background_options`` and ``context_management`` through the official client against the
real app, SQLite and Redis (no worker: a background response is answered queued, and its job is read as submitted).
``completion_window`` ``"2h"``/``"8h"`` (OpenAI's discounted background execution) is a batch job due that window
after its arrival, as a native ``/v1/jobs`` batch job with ``deadline_window_s``; ``"soonest"`` keeps the route's
interactive targets; a window that cannot be honoured, and a compaction coserve does not do, are 400s naming the
field."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from tests.integration.test_conversation_item_include import oai  # noqa: F401 - oai: a fixture

pytestmark = pytest.mark.integration


def _job(client, key: str, resp_id: str) -> dict:
    """The response's job as ``GET /v1/jobs/{id}`` shows it."""
    return client.get(f"/v1/jobs/job_{resp_id.removeprefix('resp_')}",
                      headers={"Authorization": f"Bearer {key}"}).json()


@pytest.mark.parametrize(("window", "hours"), [("2h", 2), ("8h", 8)])
def test_a_completion_window_makes_the_response_a_batch_job_due_when_it_ends(oai, client, keys, window, hours):
    options = {"completion_window": window, "continuation_id": "chain-7"}
    resp = oai.responses.create(model="tiny", input="Hi", background=True, background_options=options)
    assert resp.status == "queued" and resp.background is True
    job = _job(client, keys.paid, resp.id)
    # the QoS a native batch job with deadline_window_s gets: no TTFT/TBT targets, due the window after arrival
    assert job["kind"] == "batch" and job["ttft_ms"] is None and job["tbt_ms"] is None, job
    due = datetime.fromisoformat(job["deadline_at"]) - datetime.fromisoformat(job["created_at"])
    assert due == timedelta(hours=hours), job
    assert resp.background_options == options  # echoed as sent, on create and on retrieval
    assert oai.responses.retrieve(resp.id).background_options == options


@pytest.mark.parametrize("options", [{"completion_window": "soonest"}, {"continuation_id": "chain-7"}, None])
def test_the_soonest_window_keeps_the_routes_interactive_targets(oai, client, keys, options):
    extra = {} if options is None else {"background_options": options}
    resp = oai.responses.create(model="tiny", input="Hi", background=True, **extra)
    assert getattr(resp, "background_options", None) == options
    job = _job(client, keys.paid, resp.id)
    assert job["kind"] == "interactive" and job["ttft_ms"] and job["deadline_at"] is None, job


@pytest.mark.parametrize(("body", "param", "says"), [
    # OpenAI's discounted windows need background: true and no stream
    ({"background_options": {"completion_window": "2h"}}, "background_options.completion_window",
     "background: true"),
    ({"background": False, "background_options": {"completion_window": "8h"}},
     "background_options.completion_window", "background: true"),
    ({"background": True, "stream": True, "background_options": {"completion_window": "2h"}},
     "background_options.completion_window", "stream"),
    # and standard processing: a flex or priority service_tier is another processing
    ({"background": True, "service_tier": "priority", "background_options": {"completion_window": "2h"}},
     "background_options.completion_window", "service_tier"),
    # its window is the job's deadline: coserve's QoS fields would ask for another
    ({"background": True, "deadline": 60, "background_options": {"completion_window": "2h"}}, "deadline",
     "completion_window"),
    ({"background": True, "ttft_ms": 200, "background_options": {"completion_window": "2h"}}, "ttft_ms",
     "completion_window"),
    ({"background": True, "background_options": {"completion_window": "24h"}},
     "background_options.completion_window", "'soonest', '2h' or '8h'"),
    # OpenAI compacts the conversation server-side; coserve does not
    ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]}, "context_management",
     "truncation"),
])
def test_a_request_coserve_cannot_honour_is_refused_naming_the_field(client, keys, body, param, says):
    resp = client.post("/v1/responses", headers={"Authorization": f"Bearer {keys.paid}"},
                       json={"model": "tiny", "input": "x", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize("management", [[], None])
def test_no_context_management_is_taken(oai, management):
    resp = oai.responses.create(model="tiny", input="Hi", background=True, context_management=management)
    assert resp.status == "queued"

