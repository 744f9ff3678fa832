"""A rerun goes on from what the job's earlier attempts streamed (``workers.resume``): the pure arithmetic."""

from __future__ import annotations

from app.services.streaming import StreamEvent
from gpu_runtime.sampling import OutputConstraint, SamplingParams
from workers.resume import Resumed, Streamed, plan, streamed

WORDS = {1: "The", 2: " sea", 3: " is", 4: " blue", 6: " EN"}


def decode(ids: list[int]) -> str:
    """A byte-level-like decoder: id 5 is half a character (decodes to the replacement character)."""
    return "".join("\ufffd" if i == 5 else WORDS[i] for i in ids)


def delta(attempt: int, text: str, ids: list[int], offset: int | None, token_offset: int | None,
          logprobs: list[dict] | None = None, logprobs_offset: int = 0) -> StreamEvent:
    data = {} if token_offset is None else {"token_offset": token_offset}
    if logprobs is not None:
        data |= {"logprobs": logprobs, "logprobs_offset": logprobs_offset}
    return StreamEvent("delta", attempt, text, ids, data=data, offset=offset)


def test_the_longest_whole_attempt_is_what_the_rerun_goes_on_from():
    events = [delta(1, "The", [1], 0, 0), delta(1, " sea", [2], 3, 1),
              delta(1, " sea", [2], 3, 1),  # a repeated publish
              StreamEvent("status", 1, status="relegated"),
              delta(2, "The", [1], 0, 0),  # a rerun from scratch that streamed less
              delta(3, "The sea is", [1, 2, 3], 0, 0)]  # the attempt now starting: not an earlier one
    assert streamed(events, before=3) == Streamed("The sea", (1, 2))
    assert streamed(events, before=4) == Streamed("The sea is", (1, 2, 3))


def test_a_stream_with_a_hole_or_without_offsets_is_not_gone_on_from():
    assert streamed([delta(1, "The", [1], 0, 0), delta(1, " is", [3], 7, 2)], before=2) is None  # " sea" lost
    assert streamed([delta(1, "The", [1], None, None)], before=2) is None  # an older publisher
    assert streamed([StreamEvent("end", 1, status="failed")], before=2) is None  # nothing streamed


def test_a_rerun_feeds_the_produced_ids_after_the_prompt_and_counts_every_token_once():
    sp = SamplingParams(max_tokens=10, min_tokens=4, temperature=0.8)
    r = plan(sp, [9, 9, 9], Streamed("The sea", (1, 2)), decode)
    assert r == Resumed((1, 2), "The sea", (), 3)
    assert r.prompt([9, 9, 9]) == [9, 9, 9, 1, 2]
    left = r.sampling(sp)
    assert (left.max_tokens, left.min_tokens, left.temperature) == (8, 2, 0.8)
    # the engine made 5 more tokens and found 4 tokens (3 of the prompt, 1 produced id) in its prefix cache
    assert r.usage(5, 4, 1) == {"completion_tokens": 7, "prompt_tokens": 3, "cached_tokens": 3,
                                "cache_write_tokens": 0}
    assert r.usage(5, 0, 5)["cache_write_tokens"] == 3


def test_text_the_engine_held_back_comes_with_the_rerun_and_a_split_character_is_not_resumed():
    sp = SamplingParams(max_tokens=10, stop=("STOP",))
    # the engine held back " blue" (it could have begun a stop string); the rerun's text carries it
    assert plan(sp, [9], Streamed("The sea", (1, 2, 4)), decode).text == "The sea blue"
    assert plan(sp, [9], Streamed("The", (1, 5)), decode) is None  # ends inside a character
    assert plan(sp, [9], Streamed("The sea", (1, 3)), decode) is None  # the ids decode to other text


def test_a_stop_string_the_prompts_end_would_cut_in_two_means_a_rerun_from_scratch():
    done = Streamed("The EN", (1, 6))
    assert plan(SamplingParams(max_tokens=10, stop=("END",)), [9], done, decode) is None
    assert plan(SamplingParams(max_tokens=10, stop=("ENX", "AB")), [9], Streamed("The EN", (1, 6)), decode) is None
    assert plan(SamplingParams(max_tokens=10, stop=("AB",)), [9], done, decode) is not None


def test_what_depends_on_where_the_prompt_ends_runs_from_scratch():
    done = Streamed("The sea", (1, 2), ({"token": "The"}, {"token": " sea"}))
    assert plan(SamplingParams(max_tokens=2), [9], done, decode) is None  # all its tokens made
    for sp in (SamplingParams(max_tokens=10, presence_penalty=0.5), SamplingParams(max_tokens=10, bad_words=("x",)),
               SamplingParams(max_tokens=10, prompt_logprobs=1),
               SamplingParams(max_tokens=10, structured=OutputConstraint.of({"regex": "[a-z]+"}))):
        assert plan(sp, [9], done, decode) is None, sp
    # token logprobs go on from the streamed ones, where the stream has them for every produced token
    assert plan(SamplingParams(max_tokens=10, logprobs=1), [9], done, decode).logprobs == done.logprobs
    assert plan(SamplingParams(max_tokens=10, logprobs=1), [9], Streamed("The sea", (1, 2)), decode) is None


def test_the_client_got_each_token_when_the_first_attempt_that_streamed_it_went_out():
    """Attempt 2 went on from attempt 1's two tokens and streamed them again at its start: a client had them since
    attempt 1 (the stream entries' times), the third since attempt 2."""
    def at(ev: StreamEvent, t: float) -> StreamEvent:
        ev.at = t
        return ev

    events = [at(delta(1, "The", [1], 0, 0), 10.0), at(delta(1, " sea", [2], 3, 1), 11.0),
              at(delta(2, "The sea", [1, 2], 0, 0), 20.0), at(delta(2, " is", [3], 7, 2), 21.0)]
    assert streamed(events, before=3).token_times == (10.0, 11.0, 21.0)
    assert streamed(events[:3] + [delta(2, " is", [3], 7, 2)], before=3).token_times == ()  # one time unknown
    assert StreamEvent.parse(StreamEvent("delta", 1, "x").fields(), b"1700000000123-4").at == 1700000000.123
