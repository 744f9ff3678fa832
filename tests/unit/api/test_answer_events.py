"""``answer_events`` on hand-made job events: what each choice adds, the rest of a text SQL ended, a choice's
failure and an interrupted stream; ``abandoned_on_hangup`` stops the jobs only of a client that left."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from app.services import answer_events as module
from app.services.answer_events import (Begun, Failed, Finished, Interrupted, Piece, abandoned_on_hangup,
                                        answer_events, kept_alive)
from app.services.streaming import StreamEvent

CALL_JOB = SimpleNamespace(id="job_c", sampling={"tool_choice": {"type": "function", "function": {"name": "f"}}})
TEXT_JOB = SimpleNamespace(id="job_t", sampling=None)


def delta(text: str, tokens: int = 1, **data) -> StreamEvent:
    return StreamEvent("delta", 1, text, list(range(tokens)), data=data)


def end(status: str = "succeeded", **data) -> StreamEvent:
    return StreamEvent("end", 1, status=status, finish_reason="length",
                       data={"prompt_tokens": 5, "completion_tokens": 3, **data})


def items_of(monkeypatch, jobs, events: list[tuple[int, StreamEvent]], chat: bool = True) -> list:
    async def merged(_settings, _jobs):
        for ev in events:
            yield ev

    async def run():
        return [item async for item in answer_events(None, jobs, chat)]

    monkeypatch.setattr(module, "merged_events", merged)
    return asyncio.run(run())


def test_each_choice_adds_its_text_and_ends_with_its_whole_answer(monkeypatch):
    events = [(0, delta("He", 2, prompt_logprobs=[{"x": 1}])), (1, delta("{\"a\"")), (0, delta("llo")),
              (1, delta(": 1}")), (0, end()), (1, end())]
    items = items_of(monkeypatch, [TEXT_JOB, CALL_JOB], events)
    assert items[0] == Begun(0, [{"x": 1}])
    assert items[1] == Piece(0, "He", "", None, None, offset=0, generated=2, token_ids=[0, 1])
    assert [i for i in items if isinstance(i, Piece) and i.choice == 0][1] == Piece(0, "llo", "", None, None, 2, 3,
                                                                                   [0])
    call_args = "".join(d["function"]["arguments"] for i in items if isinstance(i, Piece) and i.choice == 1
                        for d in i.calls or ())
    assert call_args == '{"a": 1}'
    finished = [i for i in items if isinstance(i, Finished)]
    assert finished[0].answer.content == "Hello" and finished[0].completion_tokens == 3
    assert finished[1].answer.tool_calls[0]["function"]["arguments"] == '{"a": 1}'
    assert finished[1].answer.finish_reason == "length"


def test_an_end_from_sql_gives_the_rest_of_the_text_and_its_logprobs(monkeypatch):
    lp = [{"token": "a", "logprob": -1.0}, {"token": "b", "logprob": -2.0}]
    sql_end = end(from_sql=True, output_text="Hello", logprobs=lp, output_token_ids=[7, 8])
    items = items_of(monkeypatch, [TEXT_JOB], [(0, delta("He", logprobs=lp[:1])), (0, sql_end)])
    pieces = [i for i in items if isinstance(i, Piece)]
    assert pieces[-1] == Piece(0, "llo", "", None, lp[1:], offset=2, generated=1, token_ids=[8])  # the ids after
    assert pieces[0].token_ids == [0]  # the stream's (this fake's ids count from 0)
    assert items[-1].answer.content == "Hello"


def test_a_failed_choice_or_a_broken_stream_ends_the_items(monkeypatch):
    failed = items_of(monkeypatch, [TEXT_JOB, TEXT_JOB], [
        (0, delta("a")), (1, end("expired", error="too late", code="deadline")), (0, end())])
    assert failed[-1] == Failed(1, "expired", "too late", "deadline") and not any(
        isinstance(i, Finished) for i in failed)
    broken = items_of(monkeypatch, [TEXT_JOB], [(0, StreamEvent("error", data={"error": "gone"})), (0, end())])
    assert broken == [Interrupted("gone")]


@pytest.mark.parametrize("leaves", [False, True])
def test_only_a_client_that_leaves_before_the_end_stops_the_jobs(monkeypatch, leaves):
    stopped = []

    async def abandon(_settings, jobs, detail=module.ABANDONED):
        stopped.extend(jobs)

    async def chunks():
        yield b"a"
        yield b"b"

    async def run():
        stream = abandoned_on_hangup(None, [TEXT_JOB], chunks())
        got = [await anext(stream)]
        if leaves:
            await stream.aclose()  # what Starlette does with the response of a client that hung up
        else:
            got += [chunk async for chunk in stream]
        return got

    monkeypatch.setattr(module, "abandon", abandon)
    assert asyncio.run(run()) == ([b"a"] if leaves else [b"a", b"b"])
    assert stopped == ([TEXT_JOB] if leaves else [])


def test_generated_ids_go_with_the_piece_that_shows_their_text_or_with_the_end(monkeypatch):
    # a forced call's text is held back until its arguments are whole: its ids wait for the piece that shows it
    events = [(0, delta('{"a', 2)), (0, delta("", 1)), (0, delta('": 1}', 1)), (0, end())]
    items = items_of(monkeypatch, [CALL_JOB], events)
    ids = [i.token_ids for i in items if isinstance(i, (Piece, Finished))]
    assert sum(ids, []) == [0, 1, 0, 0] and all(isinstance(i, list) for i in ids)


def test_a_kept_alive_stream_closed_while_it_waits_stops_its_source(monkeypatch):
    """``kept_alive`` reads its stream in a task of its own: a client that hangs up while the stream waits (sending
    keepalives) closes that task's stream too, rather than leaving it reading a job's events for nobody."""
    monkeypatch.setattr(module, "KEEPALIVE_S", 0.01)
    closed = []

    async def waiting():
        try:
            yield b"a"
            await asyncio.Event().wait()  # a job that says nothing more
            yield b"never"
        finally:
            closed.append(True)

    async def run():
        stream = kept_alive(waiting(), b": keepalive\n\n")
        got = [await anext(stream), await anext(stream), await anext(stream)]
        await stream.aclose()
        return got

    assert asyncio.run(run()) == [b"a", b": keepalive\n\n", b": keepalive\n\n"] and closed == [True]


def test_a_kept_alive_stream_raises_what_its_source_raised():
    async def failing():
        yield b"a"
        raise RuntimeError("a bug")

    async def run():
        return [chunk async for chunk in kept_alive(failing(), b": keepalive\n\n")]

    with pytest.raises(RuntimeError, match="a bug"):
        asyncio.run(run())
