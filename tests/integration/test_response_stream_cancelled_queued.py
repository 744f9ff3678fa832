"""A background response cancelled before it ran, streamed through the official client against the real app, SQLite
and Redis (no worker: it stays queued until cancelled): its stream ends in ``response.failed`` with the response as
GET shows it, no output and no usage, not an empty message that no ``response.output_item.added`` announced."""

from __future__ import annotations

import pytest

from tests.integration.test_conversation_item_include import oai  # noqa: F401 - oai: a fixture

pytestmark = pytest.mark.integration


def test_a_response_cancelled_before_it_ran_streams_no_output_and_no_usage(oai):
    resp = oai.responses.create(model="tiny", input="Hi", background=True)
    assert oai.responses.cancel(resp.id).status == "cancelled"
    events = list(oai.responses.retrieve(resp.id, stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    last, got = events[-1].response, oai.responses.retrieve(resp.id)
    assert last.status == got.status == "cancelled" and last.error is None
    assert last.output == got.output == [] and last.usage is None and got.usage is None
