"""The official ``openai`` client against the real app (HTTP), Redis, Celery worker and DB."""

from __future__ import annotations

from functools import partial

import httpx
import openai
import pytest

from tests.conftest import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


@pytest.fixture
def oai(stack) -> openai.OpenAI:
    """The paid key's client of the module's shared stack (its plain worker ``w1``)."""
    return stack.openai()


def test_chat_and_completions_non_streaming(oai, stack, monkeypatch):
    # per-endpoint QoS defaults (the app reads this settings object per request)
    for name, value in {"chat_ttft_ms": 1500.0, "chat_tbt_ms": 90.0, "completions_tbt_ms": 400.0}.items():
        monkeypatch.setattr(stack.settings, name, value)
    models = oai.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].max_model_len == 512  # as vLLM's says it

    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-job_")
    assert chat.choices[0].finish_reason == "length"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens == 7 and chat.usage.prompt_tokens > 3
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 7
    assert chat.usage.prompt_tokens_details.cached_tokens == 0  # the own engine keeps no prefix cache

    # tools offered with tool_choice "none", a history holding a call and its result: the answer is text
    history = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tool_chat = oai.chat.completions.create(model="tiny", messages=history, max_tokens=3, tool_choice="none",
                                            tools=[{"type": "function", "function": {"name": "get_weather"}}],
                                            extra_body={"ignore_eos": True})
    assert tool_chat.choices[0].message.content and tool_chat.choices[0].message.tool_calls is None
    # tool_choice=None, which the openai SDK sends as null: vLLM keeps it and answers in text (no tool parser here,
    # which "auto" would need)
    null_choice = oai.chat.completions.create(model="tiny", messages=history, max_tokens=3, tool_choice=None,
                                              tools=[{"type": "function", "function": {"name": "get_weather"}}],
                                              extra_body={"ignore_eos": True})
    assert null_choice.choices[0].message.content and null_choice.choices[0].message.tool_calls is None

    comp = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, seed=3,
                                  extra_body={"ignore_eos": True, "ttft_ms": 5000, "tier": "free"})
    assert comp.object == "text_completion" and comp.choices[0].text and comp.usage.completion_tokens == 5

    def targets(oai_id):
        job = httpx.get(f"{stack.url}/v1/jobs/{oai_id.split('-', 1)[1]}",
                        headers={"Authorization": f"Bearer {stack.keys.paid}"}).json()
        return job["ttft_ms"], job["tbt_ms"]

    assert targets(chat.id) == (1500.0, 90.0)
    assert targets(comp.id) == (5000.0, 400.0)  # the request's ttft_ms wins; tbt from /v1/completions

    # OpenAI's service_tier picks coserve's tier: "flex" runs as free work (relegated first under load)
    assert chat.service_tier == "priority"  # the paid key's own tier, the highest
    flex = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=2,
                                       service_tier="flex", extra_body={"ignore_eos": True})
    assert flex.service_tier == "flex" and httpx.get(
        f"{stack.url}/v1/jobs/{flex.id.split('-', 1)[1]}", headers={"Authorization": f"Bearer {stack.keys.paid}"}
    ).json()["tier"] == "free"

    # greedy is deterministic: the same request twice gives the same text
    again = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}],
                                        max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == chat.choices[0].message.content

    # a stop sequence taken from the greedy answer ends it there, with finish_reason "stop"
    full = chat.choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    stopped = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=7, temperature=0, stop=[stop, "\u2603never"],
                                          extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == full[:full.index(stop)]
    assert stopped.choices[0].model_extra["stop_reason"] == stop  # vLLM's: which stop ended it
    assert chat.choices[0].model_extra["stop_reason"] is None  # max_tokens ended it
    job = httpx.get(f"{stack.url}/v1/jobs/{stopped.id.removeprefix('chatcmpl-')}",
                    headers={"Authorization": f"Bearer {stack.keys.paid}"}).json()
    assert job["stop_reason"] == stop  # the job keeps it
    last = [c for c in oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=7, temperature=0,
        stop=[stop, "\u2603never"], stream=True, extra_body={"ignore_eos": True}) if c.choices][-1].choices[0]
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", stop)

    # echo: the completion's text starts with its prompt
    echoed = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, seed=3, echo=True,
                                    extra_body={"ignore_eos": True, "ttft_ms": 5000, "tier": "free"})
    assert echoed.choices[0].text == "Once upon a time" + comp.choices[0].text
    streamed = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, seed=3, echo=True,
                                      stream=True, extra_body={"ignore_eos": True, "ttft_ms": 5000, "tier": "free"})
    chunks = [c.choices[0].text for c in streamed]
    assert chunks[0] == "Once upon a time" and "".join(chunks) == echoed.choices[0].text

    # a prompt as token ids (OpenAI's array of tokens) runs those tokens: the text prompt's answer
    from app.services.model_info import encode_input, get_tokenizer

    ids = encode_input(stack.settings.model, "Once upon a time", None)
    by_ids = oai.completions.create(model="tiny", prompt=ids, max_tokens=5, seed=3, echo=True,
                                    extra_body={"ignore_eos": True, "ttft_ms": 5000, "tier": "free"})
    assert by_ids.choices[0].text == get_tokenizer(stack.settings.model).decode(ids) + comp.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model="tiny", prompt=[ids[0], 10**9], max_tokens=2)
    assert exc.value.body["param"] == "prompt" and "token ids" in exc.value.body["message"]

    # vLLM's top_k, which the own engine's sampler applies too: sampling among the single most likely token is greedy
    top1 = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=7,
                                       temperature=1.0, seed=11, extra_body={"ignore_eos": True, "top_k": 1})
    assert top1.choices[0].message.content == full


def test_n_choices_each_a_job(oai):
    """n choices come from n jobs: sampled with seeds seed, seed + 1, ...; streamed interleaved by choice index."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=6, temperature=1.0,
              seed=7, extra_body={"ignore_eos": True})
    three = oai.chat.completions.create(n=3, **kw)
    assert [c.index for c in three.choices] == [0, 1, 2] and three.usage.completion_tokens == 18
    alone = oai.chat.completions.create(**{**kw, "seed": 8})  # choice 1's seed on its own: the same text
    assert three.choices[1].message.content == alone.choices[0].message.content
    assert len({c.message.content for c in three.choices}) > 1  # tiny random model, three seeds: not all alike
    chunks = list(oai.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kw))
    text = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
            for i in (0, 1)}
    assert text == {0: three.choices[0].message.content, 1: three.choices[1].message.content}
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError) as exc:  # greedy: every choice alike, which vLLM refuses
        oai.completions.create(model="tiny", prompt="Once", max_tokens=3, temperature=0, n=2)
    assert exc.value.body["param"] == "n" and "greedy" in exc.value.body["message"]
    # several prompts in one request (token ids too), n each: choice index = prompt x n + choice, usage per prompt once
    sampled = dict(model="tiny", max_tokens=3, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    comp = oai.completions.create(prompt="Once", n=2, **sampled)
    both = oai.completions.create(prompt=["Once", "Hello there"], n=2, **sampled)
    hello = oai.completions.create(prompt="Hello there", n=2, **sampled)
    assert [c.text for c in both.choices] == [c.text for c in comp.choices + hello.choices]
    assert both.usage.prompt_tokens == comp.usage.prompt_tokens + hello.usage.prompt_tokens
    assert both.usage.completion_tokens == 12
    chunks = list(oai.completions.create(prompt=["Once", "Hello there"], stream=True,
                                         stream_options={"include_usage": True}, **sampled))
    assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == 1) == hello.choices[0].text
    assert chunks[-1].usage.prompt_tokens == both.usage.prompt_tokens


def test_streaming_matches_non_streaming(oai):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Count to ten"}], max_tokens=9, temperature=0,
              extra_body={"ignore_eos": True})
    full = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    assert all(c.usage is None for c in chunks[:-1])
    # vLLM's continuous_usage_stats: every chunk tells its choice's usage so far, counting up to the whole
    counted = list(oai.chat.completions.create(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw))
    so_far = [c.usage.completion_tokens for c in counted]
    assert so_far == sorted(so_far) and so_far[0] == 0 and so_far[-2:] == [9, 9]
    assert {c.usage.prompt_tokens for c in counted} == {full.usage.prompt_tokens}

    comp_chunks = list(oai.completions.create(model="tiny", prompt="Hello", max_tokens=4, stream=True,
                                              temperature=0, extra_body={"ignore_eos": True}))
    assert sum(1 for c in comp_chunks if c.choices[0].text) >= 1
    assert comp_chunks[-1].choices[0].finish_reason == "length"


def test_the_sdks_chat_stream_helper_ends_with_the_whole_completion(oai):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Count to ten"}], max_tokens=9, temperature=0,
              extra_body={"ignore_eos": True})
    full = oai.chat.completions.create(**kw).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]  # the SDK's final completion refuses finish_reason "length"
    with oai.chat.completions.stream(**kw, stop=[stop], stream_options={"include_usage": True}) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "content.delta")
        final = stream.get_final_completion()
    assert final.id.startswith("chatcmpl-job_") and final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == deltas == full[:full.index(stop)]
    assert final.usage.completion_tokens >= 1 and final.usage.prompt_tokens > 3


def test_sdk_methods_for_what_coserve_does_not_offer_raise_the_sdks_typed_errors(oai):
    # without their own routes these were 405s, which the SDK raises as a bare APIStatusError
    with pytest.raises(openai.NotFoundError) as compact:
        oai.responses.compact(model="tiny", input="Hi")
    assert compact.value.body["code"] == "unsupported_endpoint" and "truncation" in compact.value.body["message"]
    with pytest.raises(openai.PermissionDeniedError) as served:
        oai.models.delete("tiny")
    assert served.value.body["type"] == "permission_error" and served.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError) as unknown:
        oai.models.delete("nope")
    assert unknown.value.body["code"] == "model_not_found"
    assert [m.id for m in oai.models.list()] == ["tiny"]


def test_return_token_ids_gives_the_prompts_and_the_answers_ids(oai, stack):
    # vLLM's return_token_ids (RL rollouts): the ids the worker fed and generated, no tokenizing the text again
    messages = [{"role": "user", "content": "Count to ten"}]
    kw = dict(model="tiny", messages=messages, max_tokens=9, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    full = oai.chat.completions.create(**kw)
    fed = httpx.post(stack.url + "/tokenize", headers={"Authorization": f"Bearer {stack.keys.paid}"},
                     json={"model": "tiny", "messages": messages}).json()["tokens"]
    ids = full.choices[0].model_extra["token_ids"]
    assert full.model_extra["prompt_token_ids"] == fed and len(fed) == full.usage.prompt_tokens
    assert len(ids) == full.usage.completion_tokens == 9
    said = httpx.post(stack.url + "/detokenize", headers={"Authorization": f"Bearer {stack.keys.paid}"},
                      json={"model": "tiny", "tokens": ids}).json()["prompt"]
    assert said == full.choices[0].message.content
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    assert chunks[0].model_extra["prompt_token_ids"] == fed  # the first chunk says the prompt's
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks if c.choices), []) == ids
    # a completion says both in its choice; a request that did not ask gets neither
    comp = oai.completions.create(model="tiny", prompt=fed, max_tokens=9, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    assert comp.model_extra["prompt_token_ids"] == fed and comp.model_extra["token_ids"] == ids
    plain = oai.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True}})
    assert "token_ids" not in plain.choices[0].model_extra and "prompt_token_ids" not in plain.model_extra


def test_chat_echo_starts_the_answer_with_the_assistants_last_message(oai):
    prefill = [{"role": "user", "content": "Name a color"}, {"role": "assistant", "content": "My favourite is"}]
    kw = dict(model="tiny", messages=prefill, max_tokens=4, temperature=0)
    template = {"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True}
    plain = oai.chat.completions.create(**kw, extra_body=template).choices[0].message.content
    echoed = oai.chat.completions.create(**kw, extra_body={**template, "echo": True}).choices[0].message.content
    assert plain and echoed == "My favourite is" + plain  # vLLM's chat echo: the continued message, then the rest
    chunks = list(oai.chat.completions.create(**kw, stream=True, extra_body={**template, "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    # the last message is not the assistant's: nothing to echo
    asked = [{"role": "user", "content": "Name a color"}]
    assert (oai.chat.completions.create(model="tiny", messages=asked, max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True, "echo": True}).choices[0].message.content
            == oai.chat.completions.create(model="tiny", messages=asked, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].message.content)


def test_errors_have_openai_shape(stack):
    # every error here is caught before a job is submitted: no worker needed
    oai = openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.keys.paid, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=17)
    assert exc.value.body["param"] == "n" and "between 1 and 16" in exc.value.body["message"]
    with pytest.raises(openai.NotFoundError) as exc:
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert exc.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as exc:  # the paid key may not ask for an unknown tier
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    extra_body={"tier": "platinum"})
    assert "tier" in exc.value.body["message"]
    # OpenAI fields coserve does not implement: a clear 400, not an answer that ignored them
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert exc.value.body["param"] == "logprobs" and exc.value.body["code"] == "unsupported_value"
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    # tools without tool_choice mean "auto": the model's own call syntax, which this server does not parse
    assert exc.value.body["param"] == "tool_choice" and exc.value.body["code"] == "unsupported_value"
    with pytest.raises(openai.BadRequestError) as exc:  # a forced call is generated under vLLM's structured outputs
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], tool_choice="required",
                                    tools=[{"type": "function", "function": {"name": "f"}}])
    assert exc.value.body["param"] == "tool_choice" and "COSERVE_BACKEND=vllm" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    response_format={"type": "xml"})
    assert exc.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as exc:  # structured outputs are vLLM's, as the penalties below
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    response_format={"type": "json_object"})
    assert exc.value.body["code"] == "unsupported_value" and "COSERVE_BACKEND=vllm" in exc.value.body["message"]
    # vLLM's prompt_logprobs, on chat as on completions: the own engine gives no logprobs; -1 (the whole vocabulary)
    # is over the 20 alternatives vLLM's max_logprobs allows; streamed, only 0 (as vLLM's protocol)
    for create in (partial(oai.chat.completions.create, messages=[{"role": "user", "content": "x"}]),
                   partial(oai.completions.create, prompt="x")):
        for extra, kw, said in (({"prompt_logprobs": 1}, {}, "COSERVE_BACKEND=vllm"),
                                ({"prompt_logprobs": -1}, {}, "0-20; got -1 (-1, the whole vocabulary"),
                                ({"prompt_logprobs": 1}, {"stream": True}, "stream: true")):
            with pytest.raises(openai.BadRequestError) as exc:
                create(model="tiny", extra_body=extra, **kw)
            assert exc.value.body["param"] == "prompt_logprobs" and said in exc.value.body["message"], exc.value.body
    for kw in ({"best_of": 3}, {"suffix": "end"}, {"logprobs": 2}, {"logit_bias": {"50256": -100}}):
        with pytest.raises(openai.BadRequestError) as exc:
            oai.completions.create(model="tiny", prompt="x", **kw)
        assert exc.value.body["param"] == next(iter(kw)) and exc.value.body["code"] == "unsupported_value"
    # vLLM's fields coserve does not implement are refused by name too, not answered as if they were not there
    for extra in ({"priority": -5}, {"use_beam_search": True}, {"skip_special_tokens": False},
                  {"return_tokens_as_token_ids": True}, {"chat_template": "{{ messages }}"}):
        with pytest.raises(openai.BadRequestError) as exc:
            oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], extra_body=extra)
        assert exc.value.body["param"] == next(iter(extra)) and exc.value.body["code"] == "unsupported_value"
    assert "tier" in exc.value.body["message"] or "COSERVE_CHAT_TEMPLATE" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model="tiny", prompt="x", seed=2**63)
    assert exc.value.body["param"] == "seed"
    # penalties are vLLM's to apply: this server's workers run the own engine, which says so before accepting
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], frequency_penalty=0.5)
    assert exc.value.body["param"] == "frequency_penalty" and exc.value.body["code"] == "unsupported_value"
    assert "COSERVE_BACKEND=vllm" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], presence_penalty=2.5)
    assert exc.value.body["param"] == "presence_penalty"
    # a forced tool call needs vLLM's structured outputs, and "auto" a tool-call parser: the refusal names only the
    # choice this server takes (it sent each client to the other refused one)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], tools=[tool],
                                    tool_choice="required")
    assert exc.value.body["param"] == "tool_choice" and "send tool_choice 'none' (this server has no parser" in (
        exc.value.body["message"])
    bad = openai.OpenAI(base_url=stack.url + "/v1", api_key="cs-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(stack.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {stack.keys.paid}"},
                   json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["param"] == "messages"


def test_client_disconnect_cancels_the_job(live_server, keys, start_worker):
    # slowed steps: the 400-token answer is still streaming when the client hangs up
    start_worker("w1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build", COSERVE_STEP_DELAY_S="0.1")
    auth = {"Authorization": f"Bearer {keys.paid}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live_server + "/v1/chat/completions", headers=auth, json=body, timeout=60) as r:
        assert r.status_code == 200
        job_id = r.headers["x-coserve-job-id"]
        deltas = 0
        for text in r.iter_lines():
            deltas += '"content":"' in text and '"content":""' not in text
            if deltas >= 2:  # generation is under way
                break
    # the connection is closed: the API cancels the job in a worker thread
    wait_for(lambda: httpx.get(f"{live_server}/v1/jobs/{job_id}", headers=auth).json()["status"] == "cancelled",
             30, "the abandoned job to be cancelled", interval=0.2)
    job = httpx.get(f"{live_server}/v1/jobs/{job_id}", headers=auth).json()
    assert job["completion_tokens"] is None or job["completion_tokens"] < 400


def _jobs_of(settings, tenant_id: str) -> list[tuple[str, str, int | None]]:
    """The tenant's jobs (id, status, completion tokens), as SQL has them."""
    from sqlalchemy import select

    from app.db.models import Job
    from app.db.session import session_scope

    with session_scope(settings.sqlalchemy_url) as s:
        return [tuple(row) for row in s.execute(select(Job.id, Job.status, Job.completion_tokens).where(
            Job.tenant_id == tenant_id).order_by(Job.created_at, Job.id))]


def test_client_disconnect_stops_every_conversation_of_a_batched_chat(live_server, keys, settings, start_worker):
    """vLLM's POST /v1/chat/completions/batch answers whole, once every conversation's job ended: a client that hangs
    up meanwhile stops them all, as chat's does (they would run their 400 tokens to the end for no one)."""
    import json
    import socket
    from urllib.parse import urlsplit

    start_worker("w1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build", COSERVE_STEP_DELAY_S="0.1")
    body = json.dumps({"model": "tiny", "max_tokens": 400, "ignore_eos": True, "messages": [
        [{"role": "user", "content": f"Tell me story number {i}"}] for i in range(2)]}).encode()
    url = urlsplit(live_server)
    head = (f"POST /v1/chat/completions/batch HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {keys.paid}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as conn:  # the client: it hangs up below
        conn.sendall(head + body)
        wait_for(lambda: (jobs := _jobs_of(settings, keys.tenant_id)) and len(jobs) == 2 and any(
            status == "running" for _, status, _ in jobs), 60, "the conversations' jobs to run")
    jobs = wait_for(lambda: (jobs := _jobs_of(settings, keys.tenant_id)) and all(
        status == "cancelled" for _, status, _ in jobs) and jobs, 30, "the abandoned jobs to be cancelled",
        interval=0.2)
    assert all(tokens is None or tokens < 400 for _, _, tokens in jobs), jobs


def test_what_the_engine_refuses_is_the_clients_to_fix_not_a_server_error(oai, stack, monkeypatch):
    """A worker's engine may refuse what the API let through (here the API believes vLLM serves, and this worker's own
    engine refuses the penalty): the job fails as an invalid request, and the OpenAI routes answer 400, as vLLM does."""
    monkeypatch.setattr(stack.settings, "backend", "vllm")
    kw = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, frequency_penalty=0.5)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(**kw)
    body = exc.value.body
    assert body["code"] == "invalid_request" and "COSERVE_BACKEND=vllm" in body["message"], body
    with pytest.raises(openai.APIError) as exc:  # streaming: the 200 has gone out; the error comes as an event
        list(oai.chat.completions.create(stream=True, **kw))
    assert "COSERVE_BACKEND=vllm" in str(exc.value)
    job_id = httpx.post(f"{stack.url}/v1/jobs", headers={"Authorization": f"Bearer {stack.keys.paid}"},
                        json={"prompt": "x", "max_tokens": 4, "repetition_penalty": 1.2}).json()["id"]
    job = wait_for(lambda: (j := httpx.get(f"{stack.url}/v1/jobs/{job_id}", headers={
        "Authorization": f"Bearer {stack.keys.paid}"}).json())["status"] == "failed" and j, 60, "the job to fail")
    assert job["error_code"] == "invalid_request" and "repetition_penalty" in job["error"]


def test_the_worker_renders_chat_with_the_operators_template_as_the_api_counted(settings, tmp_path, keys,
                                                                                 start_worker):
    """COSERVE_CHAT_TEMPLATE set alike on the API and a worker: the prompt the worker runs is the one the API
    counted (the job's final prompt_tokens come from the engine; the model's own template gives another count)."""
    from app.main import create_app
    from app.services.model_info import encode_input, use_chat_template

    template = tmp_path / "brackets.jinja"
    template.write_text("{% for m in messages %}<<{{ m['role'] }}: {{ m['content'] }}>>{% endfor %}")
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    own = len(encode_input(settings.model, None, messages))
    settings.chat_template = str(template)
    try:
        from fastapi.testclient import TestClient

        with TestClient(create_app(settings)) as client:
            start_worker("w1", COSERVE_CHAT_TEMPLATE=str(template))
            counted = client.post("/v1/jobs", json={"messages": messages, "max_tokens": 2},
                                  headers={"Authorization": f"Bearer {keys.paid}"}).json()
            assert counted["prompt_tokens"] != own, (counted, own)
            done = wait_for(lambda: (j := client.get(f"/v1/jobs/{counted['id']}", headers={
                "Authorization": f"Bearer {keys.paid}"}).json())["status"] == "succeeded" and j, 120,
                "the job to finish")
            assert done["prompt_tokens"] == counted["prompt_tokens"], done  # the worker ran the same prompt
    finally:
        settings.chat_template = None
        use_chat_template(settings.model, None)


def test_the_sdk_does_not_retry_a_completion_whose_job_was_cancelled(live_server, keys):
    """The official client retries a 409 unless told not to (``x-should-retry``): a chat request whose job a user
    cancelled came back as a second job that ran to the end. No worker: the job waits queued until the cancel."""
    import threading

    client = openai.OpenAI(base_url=live_server + "/v1", api_key=keys.paid, max_retries=2, timeout=30)
    raised: list[BaseException] = []

    def ask() -> None:
        try:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            raised.append(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    auth = {"Authorization": f"Bearer {keys.paid}"}
    job_id = wait_for(lambda: httpx.get(live_server + "/v1/jobs", headers=auth).json()["data"], 20, "the job")[0]["id"]
    assert httpx.post(f"{live_server}/v1/jobs/{job_id}/cancel", headers=auth).status_code == 200
    asking.join(60)
    assert [type(e) for e in raised] == [openai.ConflictError]
    assert raised[0].response.headers["x-should-retry"] == "false"
    assert [j["id"] for j in httpx.get(live_server + "/v1/jobs", headers=auth).json()["data"]] == [job_id]


def test_sagemaker_invocations_route_by_body_and_a_completion_makes_16_tokens_by_default(oai, stack):
    headers = {"Authorization": f"Bearer {stack.keys.paid}"}
    chat = httpx.post(f"{stack.url}/invocations", headers=headers, timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
    # vLLM's and OpenAI's legacy default without max_tokens (256 here before)
    comp = httpx.post(f"{stack.url}/invocations", headers=headers, timeout=120,
                      json={"model": "tiny", "prompt": "Once", "ignore_eos": True})
    assert comp.json()["object"] == "text_completion" and comp.json()["usage"]["completion_tokens"] == 16, comp.text
    both = httpx.post(f"{stack.url}/invocations", headers=headers, json={"model": "tiny", "prompt": "x",
                                                                        "messages": []})
    assert both.status_code == 400 and "give messages" in both.json()["error"]["message"]
    assert httpx.post(f"{stack.url}/invocations", json={"prompt": "x"}).status_code == 401


CONVERSATIONS = [[{"role": "user", "content": "Say hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three"}]]


def _batched_chat(stack, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/chat/completions/batch", headers={"Authorization": f"Bearer {stack.keys.paid}"},
                      json={"model": "tiny", **body}, timeout=120)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_batched_chat_answers_each_conversation_as_the_chat_route_does(oai, stack, sampling):
    # vLLM's POST /v1/chat/completions/batch: one choice per conversation, in order, each the text the chat route
    # gives that conversation alone; the usage sums the conversations' (each prompt counted)
    ask = dict(max_tokens=6, **sampling)
    alone = [oai.chat.completions.create(model="tiny", messages=m, extra_body={"ignore_eos": True}, **ask)
             for m in CONVERSATIONS]
    r = _batched_chat(stack, {"messages": CONVERSATIONS, "ignore_eos": True, "ttft_ms": 4000, "tier": "free", **ask})
    assert r.status_code == 200, r.text
    batch = r.json()
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-job_")
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in batch["choices"]] == [a.choices[0].message.content for a in alone]
    assert batch["usage"]["prompt_tokens"] == sum(a.usage.prompt_tokens for a in alone)
    assert batch["usage"]["completion_tokens"] == 12 and batch["service_tier"] == "flex"
    # each conversation a chat job of its own, with the request's tenant, tier and QoS
    auth = {"Authorization": f"Bearer {stack.keys.paid}"}
    jobs = [httpx.get(f"{stack.url}/v1/jobs/{i}", headers=auth).json() for i in batch["coserve"]["job_ids"]]
    assert r.headers["x-coserve-job-id"] == ",".join(batch["coserve"]["job_ids"])
    assert [(j["tier"], j["ttft_ms"], j["kind"]) for j in jobs] == [("free", 4000, "interactive")] * 2
    # each job's history names the route its request came in by (an operator reading it asks where it came from)
    admin = {"Authorization": f"Bearer {stack.keys.admin}"}
    firsts = [httpx.get(f"{stack.url}/admin/api/jobs/{i}", headers=admin).json()["events"][0]["detail"]
              for i in batch["coserve"]["job_ids"]]
    assert firsts == ["submitted via /v1/chat/completions/batch"] * 2, firsts


@pytest.mark.parametrize("body, param", [
    # not taken, as vLLM's: a stream, tools, more than one choice per conversation, beam search
    ({"stream": True}, "stream"), ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"), ({"n": 2}, "n"), ({"use_beam_search": True}, "use_beam_search"),
    ({"store": True}, "store"),  # a stored completion is one conversation's
    ({"messages": []}, "messages"), ({"messages": [CONVERSATIONS[0], []]}, "messages.1"),
    # a bad conversation is named by its index, its message by its own
    ({"messages": [CONVERSATIONS[0], [{"role": "robot", "content": "x"}]]}, "messages.1.0.role"),
    ({"messages": [CONVERSATIONS[0], [{"role": "user", "content": "word " * 2000}]]}, "messages.1")])
def test_batched_chat_refuses_by_field_and_stores_nothing(stack, body, param):
    auth = {"Authorization": f"Bearer {stack.keys.paid}"}
    def job_ids() -> list[str]:
        return [j["id"] for j in httpx.get(f"{stack.url}/v1/jobs", headers=auth, params={"limit": 100}).json()["data"]]

    before = job_ids()
    r = _batched_chat(stack, {"messages": CONVERSATIONS, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert param.split(".")[0] in r.json()["error"]["message"], r.json()
    assert job_ids() == before


def test_echo_with_max_tokens_0_answers_the_prompt_alone_as_vllm(oai):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=0, echo=True)
    alone = oai.completions.create(**kw)
    assert alone.choices[0].text == "Once upon a time" and alone.choices[0].finish_reason == "length"
    assert alone.usage.completion_tokens == 1  # as vLLM's: one token is generated (for the prompt's logprobs)
    chunks = [c.choices[0].text for c in oai.completions.create(**kw, stream=True) if c.choices]
    assert "".join(chunks) == "Once upon a time"
    with pytest.raises(openai.BadRequestError) as exc:  # without echo it would answer nothing
        oai.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert exc.value.body["param"] == "max_tokens" and "echo" in exc.value.body["message"]


def test_a_thinking_budget_is_refused_where_it_cannot_be_kept(oai, stack, monkeypatch):
    ask = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    with pytest.raises(openai.BadRequestError) as exc:  # the own engine cannot force the end of the thinking
        oai.chat.completions.create(**ask, extra_body={"thinking_token_budget": 8})
    assert exc.value.body["param"] == "thinking_token_budget" and "own torch engine" in exc.value.body["message"]
    assert oai.chat.completions.create(**ask, extra_body={"thinking_token_budget": -1}).choices  # -1: no limit
    monkeypatch.setattr(stack.settings, "backend", "vllm")  # vLLM keeps it, given a parser for where thinking ends
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"thinking_token_budget": 8})
    assert "COSERVE_REASONING_PARSER" in exc.value.body["message"], exc.value.body


@pytest.mark.parametrize("endpoint, field", [
    # OpenAI's: an audio answer, a web search
    ("chat", {"modalities": ["text", "audio"]}), ("chat", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("chat", {"web_search_options": {}}),
    # vLLM's: the chat template's documents, the rendered prompt in the answer, repetition detection,
    # watermarking, a prompt given as embeddings
    ("chat", {"documents": [{"title": "a", "text": "the answer is 42"}]}), ("chat", {"return_prompt_text": True}),
    ("chat", {"repetition_detection": {"max_pattern_size": 4, "min_count": 3}}),
    ("completions", {"watermarking": True}),
    ("completions", {"prompt_embeds": "AAAA"}),
    # vLLM's request_id names the answer (chatcmpl-<request_id>), where coserve's id is its job's; OpenAI's verbosity
    ("chat", {"request_id": "trace-7"}), ("completions", {"request_id": "trace-7"}), ("chat", {"verbosity": "low"}),
    # vLLM cuts to truncation_side "left" after tokenizing, the BOS the tokenizer added gone; unset, the BOS stays
    ("completions", {"truncation_side": "left", "truncate_prompt_tokens": 3}),
    # vLLM's disaggregated prefill and encoder-cache transfer: coserve's workers have neither connector
    ("chat", {"kv_transfer_params": {"do_remote_decode": True}}), ("completions", {"kv_transfer_params": {
        "do_remote_prefill": True, "remote_engine_id": "e1"}}), ("chat", {"ec_transfer_params": {"do_remote": True}}),
    # vLLM's multimodal options (refused unless it runs with --trust-request-mm-kwargs): coserve takes text only
    ("chat", {"mm_processor_kwargs": {"num_crops": 4}}), ("completions", {"media_io_kwargs": {"image": {"x": 1}}})])
def test_a_field_that_would_change_the_answer_is_refused_by_name_not_ignored(oai, endpoint, field):
    create = (partial(oai.chat.completions.create, messages=[{"role": "user", "content": "x"}]) if endpoint == "chat"
              else partial(oai.completions.create, prompt="x"))
    with pytest.raises(openai.BadRequestError) as exc:
        create(model="tiny", max_tokens=1, extra_body=field)
    assert exc.value.body["param"] == next(iter(field)) and exc.value.body["code"] == "unsupported_value"
    # what a client sends for it by default is taken
    default = {"modalities": ["text"]}.get(next(iter(field)))
    assert create(model="tiny", max_tokens=1, extra_body={next(iter(field)): default}).choices


@pytest.mark.parametrize("endpoint, body, param", [
    ("chat", {"stop": [1]}, "stop.0"), ("chat", {"stop": 5}, "stop"), ("chat", {"tool_choice": 5}, "tool_choice"),
    ("chat", {"logit_bias": {"abc": 5}}, "logit_bias"), ("chat", {"logprobs": "yes"}, "logprobs"),
    ("completions", {"prompt": None}, "prompt"), ("completions", {"prompt": ["a", 1]}, "prompt.1")])
def test_a_refusal_names_the_field_as_the_client_wrote_it_not_pydantics_union_members(stack, endpoint, body, param):
    base = ({"messages": [{"role": "user", "content": "x"}]} if endpoint == "chat" else {"prompt": "x"})
    r = httpx.post(f"{stack.url}/v1/{'chat/' if endpoint == 'chat' else ''}completions",
                   headers={"Authorization": f"Bearer {stack.keys.paid}"}, json={"model": "tiny", **base, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "[" not in error["message"] and ".str:" not in error["message"], error


def test_content_parts_are_read_as_vllm_reads_them(oai):
    # the Responses API's part names, an assistant's refusal and vLLM's thinking part are text, as vLLM's chat reads
    # them, and a part without its text is left out (it made an empty line); the same conversation written as
    # strings is the same prompt (the same greedy answer, the same prompt tokens)
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "Say"}, {"type": "text"},
                                          {"type": "text", "text": "hi"}]},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "Rude."}, {"type": "thinking"},
                                               {"type": "refusal", "refusal": "No."}]},
             {"role": "user", "content": [{"type": "output_text", "text": "Please"}]}]
    plain = [{"role": "user", "content": "Say\nhi"}, {"role": "assistant", "content": "Rude.\nNo."},
             {"role": "user", "content": "Please"}]
    ask = dict(model="tiny", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    got, want = (oai.chat.completions.create(messages=m, **ask) for m in (parts, plain))
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "http://x"}}]}], **ask)
    assert exc.value.body["param"] == "messages.0.content" and "'input_text'" in exc.value.body["message"]


def test_every_chunk_says_the_tier_and_fingerprint_the_plain_answer_says(oai):
    ask = dict(model="tiny", max_tokens=2, service_tier="flex", extra_body={"ignore_eos": True})
    plain = oai.chat.completions.create(messages=[{"role": "user", "content": "x"}], **ask)
    chunks = list(oai.chat.completions.create(messages=[{"role": "user", "content": "x"}], stream=True,
                                              stream_options={"include_usage": True}, **ask))
    assert plain.service_tier == "flex" and all(c.service_tier == "flex" for c in chunks), chunks
    assert all("system_fingerprint" in c.model_fields_set for c in chunks)  # null, as the plain answer's
    texts = list(oai.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True,
                                        extra_body={"ignore_eos": True, "service_tier": "flex"}))
    assert all(c.model_extra["service_tier"] == "flex" and "system_fingerprint" in c.model_fields_set for c in texts)


def test_stream_interval_above_one_is_refused_on_a_stream_and_taken_elsewhere(oai):
    # vLLM's stream_interval batches a stream's tokens into fewer chunks; coserve streams each piece as it comes
    ask = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(**ask, stream=True, extra_body={"stream_interval": 4})
    assert exc.value.body["param"] == "stream_interval" and exc.value.body["code"] == "unsupported_value"
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True, extra_body={"stream_interval": 4})
    assert exc.value.body["param"] == "stream_interval", exc.value.body
    assert list(oai.chat.completions.create(**ask, stream=True, extra_body={"stream_interval": 1}))
    assert oai.chat.completions.create(**ask, extra_body={"stream_interval": 4}).choices  # vLLM: ignored unstreamed


def test_fields_that_change_nothing_coserve_answers_are_taken(oai):
    # vLLM's session_id (labels its KV-cache events), return_token_offsets (answered on its /render routes only) and
    # OpenAI's prediction (a latency hint): the answer is the one without them
    ask = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, temperature=0)
    plain = oai.chat.completions.create(**ask).choices[0].message.content
    given = oai.chat.completions.create(**ask, prediction={"type": "content", "content": "Paris"},
                                        extra_body={"session_id": "conv-1", "return_token_offsets": True})
    assert given.choices[0].message.content == plain
    with pytest.raises(openai.BadRequestError) as exc:  # declared: a value of the wrong type is named
        oai.chat.completions.create(**ask, extra_body={"session_id": ["conv-1"]})
    assert exc.value.body["param"] == "session_id", exc.value.body
