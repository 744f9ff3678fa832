"""The Responses stream's events from hand-made answer items: each event shows its items as they were when it
was sent (a call opens with no arguments; its deltas add them), numbers run from 0, and a resumed stream
starts after the number it was given."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from app.api import responses as module
from app.services.answer_events import Finished, Piece
from app.settings import DEFAULT_TIERS
from app.tool_calls import Answer, read_answer
from tests.unit.api.test_tool_calls import CUT_BY, CUT_CALLS, NAMED, answer_items

CALL = {"id": "call_x_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
JOB = SimpleNamespace(id="job_x", status="running", created_at=datetime(2026, 1, 1, tzinfo=UTC), model="m",
                      tier="paid", sampling={"tool_choice": "required"}, finished_at=None)


def events(monkeypatch, starting_after: int | None = None, items: list | None = None) -> list[dict]:
    begun = {"index": 0, **CALL, "function": {"name": "get_weather", "arguments": '{"city"'}}
    items = items or [Piece(0, "", "", [begun], None, 0, 3),
             Piece(0, "", "", [{"index": 0, "function": {"arguments": ': "Rome"}'}}], None, 7, 5),
             Finished(0, Answer(None, [CALL], "tool_calls"), 9, 5)]

    async def answer_events(_settings, _jobs, chat=True):
        for item in items:
            yield item

    async def run():
        settings = SimpleNamespace(tiers=DEFAULT_TIERS)
        typed = module._events(settings, JOB, {}, asked_logprobs=False)
        return [chunk async for chunk in module._numbered(typed, starting_after)]

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


def test_a_reasoning_models_thinking_is_a_reasoning_item_before_its_message(monkeypatch):
    thinking = [Piece(0, "", "Rome is", None, None, 0, 2), Piece(0, "", " sunny", None, None, 7, 3),
                Piece(0, "It is sunny.", "", None, None, 22, 6),
                Finished(0, Answer("It is sunny.", None, "stop", reasoning="Rome is sunny"), 9, 6)]
    sent = events(monkeypatch, items=thinking)
    kinds = [e["type"] for e in sent]
    # its text is a content part, added and done around its deltas, as vLLM streams it
    assert kinds[2:8] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.delta",
                          "response.reasoning_text.done", "response.content_part.done"]
    assert sent[2]["item"]["type"] == "reasoning" and sent[2]["item"]["content"] == []
    assert sent[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert sent[7]["part"] == {"type": "reasoning_text", "text": "Rome is sunny"}
    assert "".join(e["delta"] for e in sent if e["type"] == "response.reasoning_text.delta") == "Rome is sunny"
    assert kinds[8] == "response.output_item.done" and kinds[9] == "response.output_item.added"  # then the message
    assert sent[9]["output_index"] == 1 and sent[9]["item"]["type"] == "message"
    final = sent[-1]["response"]["output"]
    assert [i["type"] for i in final] == ["reasoning", "message"]
    assert final[0]["content"] == [{"type": "reasoning_text", "text": "Rome is sunny"}] == sent[8]["item"]["content"]
    assert final[1]["content"][0]["text"] == "It is sunny."
    cut_off = [Piece(0, "", "Still", None, None, 0, 1),  # it never stopped thinking: an empty message after it
               Finished(0, Answer(None, None, "length", reasoning="Still"), 9, 1)]
    sent = events(monkeypatch, items=cut_off)
    added = [e["item"]["type"] for e in sent if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"] and [i["type"] for i in sent[-1]["response"]["output"]] == added


@pytest.mark.parametrize("stop_reason", CUT_BY, ids=["stop_string", "stop_token_id"])
@pytest.mark.parametrize(("choice", "text"), CUT_CALLS, ids=["required", "auto", "named"])
def test_a_call_a_stop_cut_short_is_an_incomplete_item_streamed_or_not(monkeypatch, choice, text, stop_reason):
    # a stop string or stop token id cut the call inside its JSON: its item was "completed", as though it finished;
    # OpenAI marks an item that did not finish incomplete. The response ended as asked (at a stop): completed
    sampling = {"tool_choice": choice, "tool_parser": "hermes"}
    answer = read_answer("job_x", sampling, text, "stop")
    plain = module.response_body(JOB, {}, DEFAULT_TIERS, status="succeeded", answer=answer, prompt_tokens=9,
                                 completion_tokens=5)
    sent = events(monkeypatch, items=answer_items(sampling, text, "stop", stop_reason))
    done = [e["item"] for e in sent if e["type"] == "response.output_item.done"]
    for output in (plain["output"], sent[-1]["response"]["output"], done):
        assert [(i["type"], i["status"]) for i in output] == [("message", "completed")] * (choice == "auto") + [
            ("function_call", "incomplete")]
        assert output[-1]["arguments"] == '{"city": "Pa'
    assert plain["status"] == sent[-1]["response"]["status"] == "completed" and sent[-1]["type"] == "response.completed"
    whole = text + ('"}' if choice == NAMED else '"}}]' if choice == "required" else '"}}</tool_call>')
    plain = module.response_body(JOB, {}, DEFAULT_TIERS, status="succeeded",
                                 answer=read_answer("job_x", sampling, whole, "stop"), prompt_tokens=9)
    assert plain["output"][-1]["status"] == "completed"  # a whole call, the stop after it
