"""The reasoning parsers (``app.reasoning``): the whole-text split as vLLM's parsers make it, and the stream, which
gives the same reasoning and content however the text is cut into pieces."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.reasoning import CLOSE, OPEN, ReasoningStream, ReasoningTokens, split_reasoning
from app.tool_calls import Answer, AnswerStream, read_answer


@pytest.mark.parametrize("parser, text, expected", [
    ("deepseek_r1", "<think>hmm</think>Paris", ("hmm", "Paris")),
    ("deepseek_r1", "hmm</think>\n\nParis", ("hmm", "\n\nParis")),  # the template opened the thought
    ("deepseek_r1", "still thinking", ("still thinking", None)),  # cut off: all reasoning
    ("deepseek_r1", "a</think>b</think>c", ("a", "b</think>c")),  # the first close ends it
    ("qwen3", "<think>hmm</think>Paris", ("hmm", "Paris")),
    ("qwen3", "<think>cut off", ("cut off", None)),
    ("qwen3", "Paris", (None, "Paris")),  # thinking off
    ("qwen3", "no</think>tag", (None, "no</think>tag")),
    ("qwen3", "", (None, "")),
])
def test_split(parser, text, expected):
    assert split_reasoning(parser, text) == expected


def _streamed(parser: str, pieces: list[str]) -> tuple[str, str]:
    stream, reasoning, content = ReasoningStream(parser), [], []
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = stream.end()
    return "".join(reasoning) + r, "".join(content) + c


TEXT = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "<th", "ink>", "/think", ">", "a", "b c", "\n"]),
                max_size=12).map("".join)


@given(parser=st.sampled_from(["deepseek_r1", "qwen3"]), text=TEXT, cuts=st.lists(st.integers(0, 60), max_size=8))
def test_the_stream_gives_what_the_whole_text_gives(parser, text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    reasoning, content = split_reasoning(parser, text)
    assert _streamed(parser, pieces) == (reasoning or "", content or "")


def test_the_stream_holds_back_only_a_possible_tag():
    stream = ReasoningStream("deepseek_r1")
    assert stream.feed("<think>I think") == ("I think", "")
    assert stream.feed(" so </th") == (" so ", "")  # "</th" may begin the close
    assert stream.feed("ink>Paris") == ("", "Paris")
    assert stream.feed(" is it") == ("", " is it")
    qwen = ReasoningStream("qwen3")
    assert qwen.feed("<thi") == ("", "")  # may still open a thought
    assert qwen.feed("s is content") == ("", "<this is content")


@given(parser=st.sampled_from(["deepseek_r1", "qwen3"]), text=TEXT, cuts=st.lists(st.integers(0, 60), max_size=8))
def test_a_chat_answers_stream_shows_what_its_whole_answer_holds(parser, text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    sampling = {"reasoning_parser": parser}
    stream, shown = AnswerStream("job_r", sampling), [("", "")]
    for a, b in zip(bounds, bounds[1:]):
        reasoning, content, _ = stream.feed(text[a:b])
        shown.append((reasoning, content))
    reasoning, content, _, answer = stream.end("stop")
    shown.append((reasoning, content))
    assert answer == read_answer("job_r", sampling, text, "stop")
    assert "".join(r for r, _ in shown) == (answer.reasoning or "") and "".join(c for _, c in shown) == \
        (answer.content or "")


def test_tool_calls_are_read_after_the_thinking():
    sampling = {"reasoning_parser": "qwen3", "tool_choice": "auto", "tool_parser": "hermes"}
    text = '<think>I need <tool_call> weather</think>Let me check.<tool_call>{"name": "get_weather", ' \
           '"arguments": {"city": "Oslo"}}</tool_call>'
    answer = read_answer("job_c", sampling, text, "stop")
    assert answer.reasoning == "I need <tool_call> weather" and answer.content == "Let me check."
    assert [c["function"]["name"] for c in answer.tool_calls] == ["get_weather"]
    assert answer.finish_reason == "tool_calls"
    stream = AnswerStream("job_c", sampling)
    fed = [stream.feed(text[i:i + 7]) for i in range(0, len(text), 7)]
    reasoning, content, calls, whole = stream.end("stop")
    assert "".join(f[0] for f in fed) + reasoning == answer.reasoning  # the tag inside the thinking is no call
    assert "".join(f[1] for f in fed) + content == "Let me check." and whole == answer
    assert read_answer("job_d", {"reasoning_parser": "deepseek_r1"}, "cut off", "length") == \
        Answer(None, None, "length", reasoning="cut off")  # never stopped thinking: no content


def test_include_reasoning_false_leaves_the_thinking_out_and_still_not_in_the_content():
    sampling = {"reasoning_parser": "deepseek_r1", "include_reasoning": False}
    assert read_answer("job_h", sampling, "hmm</think>Paris", "stop") == Answer("Paris", None, "stop")
    stream = AnswerStream("job_h", sampling)
    fed = [stream.feed(p) for p in ["hm", "m</th", "ink>Par", "is"]]
    assert [f[0] for f in fed] == ["", "", "", ""] and "".join(f[1] for f in fed) == "Paris"
    assert stream.end("stop")[:2] == ("", "")


def _depth_count(tokens: list[str], starts_in_thought: bool) -> int:
    """vLLM's ``count_reasoning_tokens`` over single-token tags (a deepseek_r1 answer starts inside the thought its
    template opened): the tokens between the open and the close, the tags left out."""
    depth, count = int(starts_in_thought), 0
    for token in tokens:
        if token == OPEN:
            depth = 1
        elif token == CLOSE:
            depth = 0
        elif depth:
            count += 1
    return count


WORDS = st.sampled_from(["a", " b", "c.", "\n", " <", "x"])


@given(parser=st.sampled_from(["deepseek_r1", "qwen3"]), thought=st.lists(WORDS, max_size=10),
       answer=st.lists(WORDS, max_size=6), opened=st.booleans(), closed=st.booleans())
def test_thinking_tokens_are_counted_as_vllm_counts_single_token_tags(parser, thought, answer, opened, closed):
    tokens = ([OPEN] if opened else []) + thought + ([CLOSE] + answer if closed else [])
    count = ReasoningTokens(parser)
    for token in tokens:  # one token a step
        count.feed(token, 1)
    thinks = opened or parser == "deepseek_r1"  # qwen3 thinks only where the answer opens a thought
    expected = _depth_count(tokens, parser == "deepseek_r1") if thinks else 0
    reasoning = split_reasoning(parser, "".join(tokens))[0]
    # a " <" held back as a possible tag is thought all the same: the count is the tokens, not the text
    assert count.count == expected, (tokens, reasoning)


def test_a_step_of_several_tokens_that_closes_the_thought_counts_its_share():
    count = ReasoningTokens("qwen3")
    count.feed("<think>", 1)
    count.feed("one two", 2)
    assert count.count == 2
    count.feed(" three" + CLOSE + "Paris", 4)  # speculation: 4 tokens, 6 characters of thought in 19
    assert count.count == 2 + round(4 * 6 / 19)
    count.feed(" is it", 2)
    assert count.count == 3  # the answer adds none
    off = ReasoningTokens("qwen3")  # thinking switched off: nothing is thought
    off.feed("Paris", 1)
    assert off.count == 0
