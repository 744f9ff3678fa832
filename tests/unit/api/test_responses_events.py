"""The Responses stream's events from hand-made answer items: each event shows its items as they were when it
was sent (a call opens with no arguments; its deltas add them), numbers run from 0, and a resumed stream
starts after the number it was given."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from types import SimpleNamespace

from app.api import responses as module
from app.services.answer_events import Finished, Piece
from app.settings import DEFAULT_TIERS
from app.tool_calls import Answer

CALL = {"id": "call_x_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
JOB = SimpleNamespace(id="job_x", status="running", created_at=datetime(2026, 1, 1, tzinfo=UTC), model="m",
                      tier="paid", sampling={"tool_choice": "required"})


def events(monkeypatch, starting_after: int | None = None) -> list[dict]:
    items = [Piece(0, "", [{"index": 0, **CALL, "function": {"name": "get_weather", "arguments": '{"city"'}}],
                   None, 0, 3),
             Piece(0, "", [{"index": 0, "function": {"arguments": ': "Rome"}'}}], None, 7, 5),
             Finished(0, Answer(None, [CALL], "tool_calls"), 9, 5)]

    async def answer_events(_settings, _jobs, chat=True):
        for item in items:
            yield item

    async def run():
        settings = SimpleNamespace(tiers=DEFAULT_TIERS)
        return [chunk async for chunk in module._numbered(module._events(settings, JOB, {}), starting_after)]

    monkeypatch.setattr(module, "answer_events", answer_events)
    out = []
    for chunk in asyncio.run(run()):
        kind, data = chunk.decode().split("\n")[:2]
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


def test_a_call_opens_empty_and_its_deltas_add_its_arguments(monkeypatch):
    sent = events(monkeypatch)
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    added = next(e for e in sent if e["type"] == "response.output_item.added")
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    deltas = [e["delta"] for e in sent if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == CALL["function"]["arguments"]
    done = next(e for e in sent if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == CALL["function"]["arguments"]
    final = sent[-1]
    assert final["type"] == "response.completed" and final["response"]["output"][0]["call_id"] == CALL["id"]


def test_a_resumed_stream_starts_after_the_number_it_was_given(monkeypatch):
    whole = events(monkeypatch)
    resumed = events(monkeypatch, starting_after=3)
    assert resumed == whole[4:]
