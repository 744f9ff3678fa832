"""Token logprobs: vLLM's per-position dicts as coserve keeps them, OpenAI's two response shapes, and a stream
that hands each token's logprob on once across a rerun."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.openai_schemas import (ChatCompletionRequest, CompletionRequest, OpenAIError, chat_answer, chat_completion,
                                chat_job, chat_logprobs, completion_logprobs, merge_choices, openai_parsed,
                                text_completion, usage)
from app.services.streaming import StreamEvent, _Progress
from gpu_runtime.logprobs import FLOOR, TokenLogprob

ENTRIES = [TokenLogprob("Hel", -0.1, (("Hel", -0.1), ("He", -2.5))).as_dict(),
           TokenLogprob("lo", -0.7, (("lo", -0.7), ("p", -1.0))).as_dict()]


def lp(logprob: float, rank: int, text: str) -> SimpleNamespace:  # vllm.logprobs.Logprob's fields
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=text)


def test_vllm_positions_become_the_chosen_token_and_its_ranked_alternatives():
    from gpu_runtime.vllm.engine import token_logprobs

    # the sampled token (id 7, rank 3) comes first in vLLM's dict, then the top 2; a token ruled out is -inf
    steps = [{7: lp(-1.5, 3, " b"), 4: lp(-0.2, 1, " a"), 9: lp(-0.9, 2, " c")},
             {4: lp(float("-inf"), 1, " a")}]
    got = token_logprobs([7, 4], steps, 2)
    assert got[0] == TokenLogprob(" b", -1.5, ((" a", -0.2), (" c", -0.9)), token_id=7, rank=3, top_ids=(4, 9))
    assert got[1] == TokenLogprob(" a", FLOOR, ((" a", FLOOR),), token_id=4, rank=1, top_ids=(4,))
    assert TokenLogprob.of(got[0].as_dict()) == got[0]


def test_openai_shapes():
    chat = chat_logprobs(ENTRIES)["content"]
    assert [c["token"] for c in chat] == ["Hel", "lo"] and chat[0]["bytes"] == list(b"Hel")
    assert chat[1]["top_logprobs"] == [{"token": "lo", "logprob": -0.7, "bytes": list(b"lo")},
                                       {"token": "p", "logprob": -1.0, "bytes": list(b"p")}]
    comp = completion_logprobs(ENTRIES, offset=5)
    assert comp == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.1, -0.7],
                    "top_logprobs": [{"Hel": -0.1, "He": -2.5}, {"lo": -0.7, "p": -1.0}], "text_offset": [5, 8]}
    assert chat_logprobs(None) is None and completion_logprobs(None) is None
    # the legacy shape holds the chosen token too where it is not among the top (logprobs: 1, or 0)
    sampled = [TokenLogprob(" b", -1.5, ((" a", -0.2),)).as_dict(), TokenLogprob(" c", -0.4, ()).as_dict()]
    assert completion_logprobs(sampled)["top_logprobs"] == [{" b": -1.5, " a": -0.2}, {" c": -0.4}]
    assert chat_logprobs(sampled)["content"][0]["top_logprobs"] == [{"token": " a", "logprob": -0.2,
                                                                     "bytes": list(b" a")}]  # chat's: the top only


def test_a_rerun_repeats_no_logprob_the_stream_already_sent():
    def delta(attempt, text, offset, first):
        return StreamEvent("delta", attempt, text, [1], offset=offset,
                           data={"logprobs": ENTRIES[first:first + 1], "logprobs_offset": first})

    follower = _Progress("job")
    sent = [follower.admit(delta(1, "Hel", 0, 0))]
    # the worker died; attempt 2 regenerates both tokens: only the second one's logprob is new
    sent += [follower.admit(delta(2, "Hel", 0, 0)), follower.admit(delta(2, "lo", 3, 1))]
    kept = [e.data["logprobs"] for e in sent if e is not None]
    assert kept == [ENTRIES[:1], ENTRIES[1:]] and follower.logprobs_delivered == 2


def test_echo_puts_the_prompt_and_its_logprobs_first():
    prompt = [TokenLogprob("Say", None).as_dict(), TokenLogprob(" hi", -3.0, ((" hello", -1.0),)).as_dict()]
    body = text_completion("cmpl-1", "m", 0, "Hello", "length", 2, 2, logprobs=ENTRIES, echo=("Say hi", prompt))
    choice = body["choices"][0]
    assert choice["text"] == "Say hiHello"
    assert choice["logprobs"]["tokens"] == ["Say", " hi", "Hel", "lo"]
    assert choice["logprobs"]["token_logprobs"][:2] == [None, -3.0] and choice["logprobs"]["top_logprobs"][0] is None
    assert choice["logprobs"]["text_offset"] == [0, 3, 6, 9]
    plain = text_completion("cmpl-1", "m", 0, "Hello", "length", 2, 2, echo=("Say hi", None))["choices"][0]
    assert plain["text"] == "Say hiHello" and plain["logprobs"] is None
    # vLLM's echo with max_tokens 0: the prompt and its logprobs alone, the one token generated left out
    alone = text_completion("cmpl-1", "m", 0, "Hel", "length", 2, 1, logprobs=ENTRIES[:1], echo=("Say hi", prompt),
                            sampling={"echo": True, "echo_only": True})["choices"][0]
    assert alone["text"] == "Say hi" and alone["logprobs"]["tokens"] == ["Say", " hi"]
    asked = {"prompt": "Say hi", "max_tokens": 0, "echo": True, "logprobs": 1}
    spec = CompletionRequest.model_validate(asked).job_spec(prompt="Say hi")
    assert spec.sampling(16)["max_tokens"] == 1 and spec.sampling(16)["echo_only"] is True
    assert spec.sampling(16)["prompt_logprobs"] == 1


def prompt_and_vllm_form() -> tuple[list[dict], list[dict | None]]:
    """A job's stored prompt logprobs (prompt [5, 7]: its first token unscored, the second (rank 3) with its 2
    likeliest alternatives), and vLLM's form of them."""
    from gpu_runtime.vllm.engine import token_logprobs

    prompt = [TokenLogprob("Say", None, token_id=5).as_dict(),
              *(t.as_dict() for t in token_logprobs([7], [{7: lp(-1.5, 3, " b"), 4: lp(-0.2, 1, " a"),
                                                          9: lp(-0.9, 2, " c")}], 2))]
    return prompt, [None, {"7": {"logprob": -1.5, "rank": 3, "decoded_token": " b"},
                           "4": {"logprob": -0.2, "rank": 1, "decoded_token": " a"},
                           "9": {"logprob": -0.9, "rank": 2, "decoded_token": " c"}}]


def test_a_completion_choice_carries_vllms_prompt_logprobs_where_the_job_asked():
    prompt, vllm_form = prompt_and_vllm_form()
    for asked in ({"prompt": "Say b", "echo": True, "logprobs": 2}, {"prompt": "Say b", "prompt_logprobs": 2},
                  {"prompt": "Say b", "echo": True, "prompt_logprobs": 2}):
        sampling = CompletionRequest.model_validate(asked).job_spec(prompt="Say b").sampling(16)
        assert sampling["prompt_logprobs"] == 2, asked
        echo = ("Say b", prompt) if asked.get("echo") else None
        choice = text_completion("cmpl-1", "m", 0, "!", "length", 2, 1, logprobs=ENTRIES[:1], echo=echo,
                                 sampling=sampling, prompt_logprobs=prompt)["choices"][0]
        assert choice["prompt_logprobs"] == vllm_form, asked
    unasked = CompletionRequest.model_validate({"prompt": "Say b", "logprobs": 2}).job_spec(prompt="Say b")
    choice = text_completion("cmpl-1", "m", 0, "!", "length", 2, 1, logprobs=ENTRIES[:1],
                             sampling=unasked.sampling(16))["choices"][0]
    assert "prompt_logprobs" in choice and choice["prompt_logprobs"] is None  # not asked: null, as vLLM answers
    # a job stored before the engine said token ids: no ids to key them by
    assert text_completion("cmpl-1", "m", 0, "!", "length", 2, 1, prompt_logprobs=[{"token": "S", "logprob": None,
                                                                                     "top": []}],
                           sampling={"prompt_logprobs": 0})["choices"][0]["prompt_logprobs"] is None


def test_a_chat_answer_carries_vllms_prompt_logprobs_at_its_top_where_the_job_asked_as_a_batch_line_too():
    from app.batch.objects import output_line
    from app.db.models import Job

    prompt, vllm_form = prompt_and_vllm_form()
    messages = [{"role": "user", "content": "Say b"}]
    _chat, spec = chat_job({"model": "m", "messages": messages, "prompt_logprobs": 2}, ("free", "paid"), lambda e: e)
    sampling = spec.sampling(16)
    assert sampling["prompt_logprobs"] == 2 and sampling["logprobs"] is None  # the output's were not asked for
    body = chat_answer("chatcmpl-1", "m", 0, "job_1", sampling, "b", "stop", 2, 1, prompt_logprobs=prompt)
    assert body["prompt_logprobs"] == vllm_form and "prompt_logprobs" not in body["choices"][0]  # vLLM's place
    assert body["choices"][0]["logprobs"] is None
    job = Job(id="job_c", endpoint="/v1/chat/completions", model="m", messages=messages, output_text="b",
              finish_reason="stop", sampling=sampling, prompt_tokens=2, completion_tokens=1, custom_id="r1",
              prompt_logprobs=prompt)
    assert output_line([job])["response"]["body"]["prompt_logprobs"] == vllm_form
    job.sampling = chat_job({"model": "m", "messages": messages}, ("free", "paid"), lambda e: e)[1].sampling(16)
    body = output_line([job])["response"]["body"]
    assert "prompt_logprobs" in body and body["prompt_logprobs"] is None  # not asked: null, as vLLM answers


@pytest.mark.parametrize("request_type, body", [(CompletionRequest, {"prompt": "x"}),
                                                (ChatCompletionRequest, {"messages": [{"role": "user",
                                                                                       "content": "x"}]})])
def test_prompt_logprobs_stream_only_at_0_as_vllm_takes_them(request_type, body):
    streamed = openai_parsed(request_type, {**body, "stream": True, "prompt_logprobs": 0})
    streamed.check()
    spec = streamed.job_spec(prompt="x") if request_type is CompletionRequest else streamed.job_spec(
        messages=streamed.chat_messages())
    assert spec.sampling(16)["prompt_logprobs"] == 0
    for asked in (1, 20):
        with pytest.raises(OpenAIError) as exc:
            openai_parsed(request_type, {**body, "stream": True, "prompt_logprobs": asked}).check()
        assert exc.value.param == "prompt_logprobs" and "stream" in exc.value.message
        openai_parsed(request_type, {**body, "prompt_logprobs": asked}).check()  # unstreamed: answered


@pytest.mark.parametrize("request_type, body, field", [
    (CompletionRequest, {"prompt": "x"}, "prompt_logprobs"), (CompletionRequest, {"prompt": "x"}, "logprobs"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}, "prompt_logprobs"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "top_logprobs")])
def test_the_whole_vocabulary_of_alternatives_is_a_400_that_says_the_range(request_type, body, field):
    for value, whole in ((-1, True), (21, False), (-2, False)):
        with pytest.raises(OpenAIError) as exc:
            req = openai_parsed(request_type, {**body, field: value})
            req.check()
            req.logprob_count()
        assert exc.value.status_code == 400 and exc.value.param == field, value
        assert f"{field}: the number of alternatives per token is 0-20" in exc.value.message, exc.value.message
        assert ("-1, the whole vocabulary" in exc.value.message) == whole, exc.value.message


def test_a_lost_delta_of_logprobs_is_a_gap_the_end_fills_from_sql():
    follower = _Progress("job")
    first = StreamEvent("delta", 1, "Hel", [1], offset=0, data={"logprobs": ENTRIES[:1], "logprobs_offset": 0})
    assert follower.admit(first) is not None
    # the delta of token 1 (its text held back by the detokenizer) was lost; token 2's text follows on
    later = StreamEvent("delta", 1, "lo", [2], offset=3, data={"logprobs": ENTRIES[1:], "logprobs_offset": 2})
    assert follower.admit(later) is None and follower.gap


def test_several_prompts_make_a_job_each_and_one_usage():
    req = CompletionRequest.model_validate({"prompt": [[1, 2], [3]]})
    assert req.prompt_inputs() == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert (CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompt_inputs()
            == [{"prompt": "a"}, {"prompt": "b"}])
    assert CompletionRequest.model_validate({"prompt": [7, 8]}).prompt_inputs() == [{"prompt_token_ids": [7, 8]}]
    # two prompts of 5 and 3 tokens, n = 2 each: a prompt's tokens count once
    bodies = [text_completion("c", "m", 0, t, "length", p, 2) for t, p in (("a", 5), ("b", 5), ("c", 3), ("d", 3))]
    merged = merge_choices(bodies, n=2)
    assert [c["index"] for c in merged["choices"]] == [0, 1, 2, 3] and [c["text"] for c in merged["choices"]] == list(
        "abcd")
    assert merged["usage"] == {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16}


def test_usage_says_the_cached_prompt_tokens_where_the_engine_counted_them():
    assert "prompt_tokens_details" not in usage(5, 2)  # a count not known (a stream's running usage) is left out
    assert usage(5, 2, 0)["prompt_tokens_details"] == {"cached_tokens": 0}
    # two prompts, n = 2: a prompt's cached tokens count once, as its prompt tokens do
    bodies = [text_completion("c", "m", 0, t, "stop", p, 1, cached_tokens=k)
              for t, p, k in (("a", 300, 256), ("b", 300, 256), ("c", 200, 128), ("d", 200, 128))]
    merged = merge_choices(bodies, n=2)["usage"]
    assert merged["prompt_tokens"] == 500 and merged["prompt_tokens_details"] == {"cached_tokens": 384}
    chat = chat_completion("x", "m", 0, "hi", "stop", 300, 1, cached_tokens=256)
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == 256


def test_usage_says_the_reasoning_tokens_where_a_parser_counted_them():
    assert "completion_tokens_details" not in usage(5, 2)  # no reasoning parser: not known
    assert usage(5, 9, reasoning_tokens=6)["completion_tokens_details"] == {"reasoning_tokens": 6}
    # n = 2 choices of one prompt: every choice's thinking counts, as its completion tokens do
    bodies = [chat_completion("x", "m", 0, "hi", "stop", 300, c, reasoning="hm", reasoning_tokens=r)
              for c, r in ((9, 6), (4, 3))]
    merged = merge_choices(bodies, n=2)["usage"]
    assert merged["completion_tokens"] == 13 and merged["completion_tokens_details"] == {"reasoning_tokens": 9}


def test_echo_with_max_tokens_0_refuses_min_tokens_naming_what_the_client_sent():
    """The job's max_tokens is 1 (vLLM generates one token it does not answer): a min_tokens refusal names the 0 the
    client sent and the field to change, not that 1."""
    import pytest

    from app.openai_schemas import OpenAIError

    req = CompletionRequest.model_validate({"prompt": "Say hi", "max_tokens": 0, "echo": True, "min_tokens": 3})
    with pytest.raises(OpenAIError) as refused:
        req.check()
    assert refused.value.param == "min_tokens" and "max_tokens (0" in refused.value.message
