"""The official ``openai`` client against the real app (HTTP), Redis, Celery worker and DB."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


@pytest.fixture
def oai(live_server, keys, start_worker) -> openai.OpenAI:
    start_worker("w1")
    return openai.OpenAI(base_url=live_server + "/v1", api_key=keys.paid, max_retries=0, timeout=120)


def test_chat_and_completions_non_streaming(oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == ["tiny"]

    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-job_")
    assert chat.choices[0].finish_reason == "length"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens == 7 and chat.usage.prompt_tokens > 3
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 7

    comp = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, seed=3,
                                  extra_body={"ignore_eos": True, "ttft_ms": 5000, "tier": "free"})
    assert comp.object == "text_completion" and comp.choices[0].text and comp.usage.completion_tokens == 5

    # greedy is deterministic: the same request twice gives the same text
    again = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}],
                                        max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == chat.choices[0].message.content


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
    assert all(c.usage is None for c in chunks[:-1])

    comp_chunks = list(oai.completions.create(model="tiny", prompt="Hello", max_tokens=4, stream=True,
                                              temperature=0, extra_body={"ignore_eos": True}))
    assert sum(1 for c in comp_chunks if c.choices[0].text) >= 1
    assert comp_chunks[-1].choices[0].finish_reason == "length"


def test_errors_have_openai_shape(live_server, keys):
    # every error here is caught before a job is submitted: no worker needed
    oai = openai.OpenAI(base_url=live_server + "/v1", api_key=keys.paid, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2)
    assert exc.value.body["param"] == "n" and "n=1" in exc.value.body["message"]
    with pytest.raises(openai.NotFoundError) as exc:
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert exc.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as exc:  # the paid key may not ask for an unknown tier
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    extra_body={"tier": "platinum"})
    assert "tier" in exc.value.body["message"]
    bad = openai.OpenAI(base_url=live_server + "/v1", api_key="cs-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(live_server + "/v1/chat/completions", headers={"Authorization": f"Bearer {keys.paid}"},
                   json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["param"] == "messages"
