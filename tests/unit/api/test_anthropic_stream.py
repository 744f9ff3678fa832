"""A Messages stream's events of a job's answer events (pure logic: the job's events are given, not read from
Redis), read as the ``anthropic`` SDK's stream accumulator reads them."""

from __future__ import annotations

import asyncio
import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import given, settings
from hypothesis import strategies as st

from app.anthropic_schemas import message_of
from app.api import anthropic_messages
from app.db.models import Job
from app.services.answer_events import Finished, Piece
from app.tool_calls import Answer, read_answer
from app.tool_input import StreamedInput, tool_input
from tests.unit.api.test_tool_calls import ARGUMENT_VALUES, BROKEN_BLOCKS, CUT_BY, CUT_CALLS, NAMED, answer_items

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


def sdk_message(events: list[dict]):
    """The message the ``anthropic`` SDK's stream puts together of ``events`` (its errors raised, as its stream's)."""
    snapshot, json_bufs = None, {}  # each tool_use block's JSON so far, as the SDK's stream keeps it
    for event in events:
        if event["type"] != "ping":
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    return snapshot


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
    snapshot = sdk_message(events)
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


@pytest.mark.parametrize(("block", "arguments", "_reason"), BROKEN_BLOCKS)
@pytest.mark.parametrize("size", [1, 4, 9])
def test_a_call_whose_json_breaks_streams_what_the_sdk_reads_as_the_plain_answer_gives_it(monkeypatch, block,
                                                                                           arguments, _reason, size):
    # a call's arguments that no JSON parser could go on from ({"tz": "UTC",} or a bare word) went out whole as
    # input_json_delta: the anthropic SDK's stream raised "Unable to parse tool parameter JSON from model" at the
    # block's end, where the plain answer gave input {}. Now the stream stops at that character, and both give the
    # input the SDK reads of what came before it
    sampling = {"tool_choice": "auto", "tool_parser": "hermes"}
    text = (f'Checking. <tool_call>{block}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    plain = message_of("job_t", "tiny", read_answer("job_t", sampling, text, "stop"), None, 9, 5, None, None)
    streamed = sdk_message(_events(monkeypatch, answer_items(sampling, text, "stop", size=size)))
    assert streamed.model_dump(exclude_none=True)["content"] == plain["content"]
    assert plain["content"][1]["input"] == tool_input(arguments) and plain["content"][2]["input"] == {"city": "Oslo"}


def test_a_good_calls_input_streams_as_it_comes(monkeypatch):
    # an editor shows a call's input while it streams: each piece of good arguments goes out as it comes
    sampling = {"tool_choice": "auto", "tool_parser": "hermes"}
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}</tool_call>'
    events = _events(monkeypatch, answer_items(sampling, text, "stop", size=4))
    partials = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert len(partials) > 5 and "".join(partials) == '{"city": "Oslo", "days": 3}'
    assert sdk_message(events).content[0].input == {"city": "Oslo", "days": 3}


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def sdk_input(partials: list[str]) -> object:
    """What the SDK's stream reads of a tool_use block's ``partials`` (its ``input_json_delta`` pieces)."""
    start = {"type": "message_start", "message": message_of("job_t", "tiny", Answer("", None, "stop"), None, 9, 1,
                                                            None, None) | {"content": []}}
    block = {"type": "content_block_start", "index": 0,
             "content_block": {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}}
    deltas = [{"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": p}}
              for p in partials if p]
    return sdk_message([start, block, *deltas]).content[0].input


# JSON's numbers: no NaN nor infinity, which json.dumps writes as NaN and Infinity (no JSON: a broken call's)
@given(arguments=st.dictionaries(st.text(max_size=5), ARGUMENT_VALUES | st.floats(allow_nan=False,
                                                                                   allow_infinity=False),
                                 max_size=4),
       indent=st.sampled_from([None, 0, 2]), ascii=st.booleans(), lead=st.sampled_from(["", " ", "\n  "]),
       cuts=st.lists(st.integers(0, 200), max_size=20))
@settings(max_examples=300, deadline=None)
def test_good_arguments_stream_every_piece_as_it_comes(arguments, indent, ascii, lead, cuts):
    # no piece of a whole object is held back (but whitespace before it, which the SDK does not read alone)
    text = lead + json.dumps(arguments, indent=indent, ensure_ascii=ascii)
    streamed, sent = StreamedInput(), []
    for piece in pieces_of(text, cuts):
        sent.append(streamed.more(piece))
        assert "".join(sent) == ("" if not streamed.arguments.strip() else streamed.arguments)
    assert sdk_input(sent) == tool_input(text) == arguments


@pytest.mark.parametrize(("value", "before"), [("NaN", {}), ("Infinity", {}), ("-Infinity", {}),
                                               ("1e999", {"a": 1e99})])  # the digit past a float's range breaks it
def test_arguments_holding_nan_or_infinity_stream_as_broken_ones_up_to_it(value, before):
    # the SDK's parser reads them (as floats no answer can write back as JSON): the stream stops before them, as at
    # any broken character, and the plain answer's input is what came before
    text = f'{{"b": 1, "a": {value}, "c": 2}}'
    streamed = StreamedInput()
    sent = [streamed.more(text[i:i + 3]) for i in range(0, len(text), 3)]
    assert streamed.broken and '"c"' not in "".join(sent)
    assert sdk_input(sent) == tool_input(text) == {"b": 1, **before}


@given(text=st.text(alphabet='{}[]",:1.e-\\ antrueUl', max_size=40), cuts=st.lists(st.integers(0, 40), max_size=12))
@settings(max_examples=500, deadline=None)
def test_any_arguments_stream_what_the_sdk_reads_as_the_plain_answer_gives_them(text, cuts):
    # broken, cut short or whole: the SDK reads every piece sent, and what it reads is the plain answer's input
    sent = [streamed.more(piece) for streamed in [StreamedInput()] for piece in pieces_of(text, cuts)]
    assert sdk_input(sent) == tool_input(text)
    assert isinstance(tool_input(text), dict)
