"""A Messages stream's events of a job's answer events (pure logic: the job's events are given, not read from
Redis), read as the ``anthropic`` SDK's stream accumulator reads them."""

from __future__ import annotations

import asyncio
import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event

from app.anthropic_schemas import message_of
from app.api import anthropic_messages
from app.db.models import Job
from app.services.answer_events import Finished, Piece
from app.tool_calls import Answer, read_answer
from tests.unit.api.test_tool_calls import CUT_BY, CUT_CALLS, NAMED, answer_items

ANSWER = Answer("Hi", None, "stop", reasoning="Hmm.")


def _events(monkeypatch, items) -> list[dict]:
    async def answer_events(_settings, _jobs):
        for item in items:
            yield item

    async def read() -> list[bytes]:
        return [chunk async for chunk in anthropic_messages._events(None, job)]

    monkeypatch.setattr(anthropic_messages, "answer_events", answer_events)
    job = Job(id="job_1", model="tiny", prompt_tokens=9)
    return [json.loads(chunk.decode().split("data: ", 1)[1]) for chunk in asyncio.run(read())]


def test_a_thinking_block_is_signed_before_it_stops_as_vllm_streams_it(monkeypatch):
    # vLLM's message_stream_converter: a signature_delta closes each thinking block (before its content_block_stop)
    # and the SDK's accumulator keeps it on the block, which a client sends back with the next turn
    events = _events(monkeypatch, [Piece(0, "", "Hmm.", None, None, 0, 1), Piece(0, "Hi", "", None, None, 0, 2),
                                   Finished(0, ANSWER, 9, 2)])
    blocks = [(e["type"], e.get("index"), (e.get("delta") or {}).get("type")) for e in events
              if e["type"].startswith("content_block")]
    assert blocks == [("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"),
                      ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
                      ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"),
                      ("content_block_stop", 1, None)]
    snapshot = None
    for event in events:
        if event["type"] != "ping":
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs={})
    plain = message_of("job_1", "tiny", ANSWER, None, 9, 2, None, None)["content"][0]
    assert snapshot.content[0].type == "thinking" and snapshot.content[0].thinking == "Hmm."
    assert snapshot.content[0].signature == plain["signature"] != ""  # the plain answer's, the same job's


def test_a_thinking_blocks_start_carries_no_signature_as_vllm_streams_it(monkeypatch):
    # vLLM's message_stream_converter opens a thinking block as {"type": "thinking", "thinking": ""} (dumped with
    # exclude_unset): its signature comes once, in the signature_delta before the block stops
    events = _events(monkeypatch, [Piece(0, "", "Hmm.", None, None, 0, 1), Finished(0, ANSWER, 9, 1)])
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": ""}]


@pytest.mark.parametrize("stop_reason", CUT_BY, ids=["stop_string", "stop_token_id"])
@pytest.mark.parametrize(("choice", "text"), CUT_CALLS, ids=["required", "auto", "named"])
def test_a_call_a_stop_cut_short_never_ends_in_tool_use_streamed_or_not(monkeypatch, choice, text, stop_reason):
    # a stop token id (stop_token_ids) cut the call inside its JSON: its end was tool_use, so a Claude SDK client ran
    # a call whose input did not parse (input {}). As a stop string's cut: the stop sequence, else the turn's end
    sampling = {"tool_choice": choice, "tool_parser": "hermes"}
    ended = ("stop_sequence", stop_reason) if isinstance(stop_reason, str) else ("end_turn", None)
    answer = read_answer("job_t", sampling, text, "stop")
    plain = message_of("job_t", "tiny", answer, stop_reason, 9, 5, None, None)
    assert (plain["stop_reason"], plain["stop_sequence"]) == ended
    delta = next(e for e in _events(monkeypatch, answer_items(sampling, text, "stop", stop_reason))
                 if e["type"] == "message_delta")
    assert (delta["delta"]["stop_reason"], delta["delta"]["stop_sequence"]) == ended
    whole = text + ('"}' if choice == NAMED else '"}}]' if choice == "required" else '"}}</tool_call>')
    plain = message_of("job_t", "tiny", read_answer("job_t", sampling, whole, "stop"), stop_reason, 9, 5, None, None)
    assert plain["stop_reason"] == "tool_use"  # a whole call, the stop after it
