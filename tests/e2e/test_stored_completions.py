"""Stored chat completions (``store: true``) through the official ``openai`` client against the real app (HTTP),
Redis, Celery worker and DB: listed, filtered, paged, retrieved, their messages, updated, deleted, per tenant."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionContentPartText

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

GREEDY = {"model": "tiny", "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def oai(live_server, keys, start_worker) -> openai.OpenAI:
    start_worker("w1")
    return openai.OpenAI(base_url=live_server + "/v1", api_key=keys.paid, max_retries=0, timeout=120)


def test_stored_chat_completions_are_listed_retrieved_updated_and_deleted(oai, live_server, keys):
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Say hi"}]
    a = oai.chat.completions.create(messages=messages, max_tokens=4, store=True, metadata={"run": "a"}, **GREEDY)
    b = oai.chat.completions.create(messages=[{"role": "user", "content": "Two"}], max_tokens=3, n=2, seed=1,
                                    store=True, metadata={"run": "b", "kind": "pair"},
                                    **{**GREEDY, "temperature": 1.0})  # n 2: sampled (greedy takes n 1)
    plain = oai.chat.completions.create(messages=[{"role": "user", "content": "Not kept"}], max_tokens=2, **GREEDY)
    streamed = oai.chat.completions.create(messages=[{"role": "user", "content": "Stream"}], max_tokens=3, store=True,
                                           stream=True, **GREEDY)
    chunks = list(streamed)
    s_id, s_text = chunks[0].id, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # listed oldest first (desc: newest first), every page by the client's cursor; not the unstored one
    assert [c.id for c in oai.chat.completions.list()] == [a.id, b.id, s_id]
    assert [c.id for c in oai.chat.completions.list(order="desc")] == [s_id, b.id, a.id]
    first = oai.chat.completions.list(limit=1)
    assert [c.id for c in first.data] == [a.id] and first.has_more
    assert [c.id for c in oai.chat.completions.list(limit=1)] == [a.id, b.id, s_id]  # iterating follows the pages
    assert [c.id for c in oai.chat.completions.list(after=a.id)] == [b.id, s_id]
    # filters: every metadata pair given, the model
    assert [c.id for c in oai.chat.completions.list(metadata={"run": "b"})] == [b.id]
    assert [c.id for c in oai.chat.completions.list(metadata={"run": "b", "kind": "other"})] == []
    assert [c.id for c in oai.chat.completions.list(model="tiny")] == [a.id, b.id, s_id]
    assert [c.id for c in oai.chat.completions.list(model="another")] == []

    # retrieved as it was answered, with its metadata; n choices together
    got = oai.chat.completions.retrieve(a.id)
    assert got.choices[0].message.content == a.choices[0].message.content and got.usage == a.usage
    assert got.metadata == {"run": "a"} and abs(got.created - a.created) <= 5
    pair = oai.chat.completions.retrieve(b.id)
    assert [c.message.content for c in pair.choices] == [c.message.content for c in b.choices]
    assert pair.usage.completion_tokens == 6
    assert oai.chat.completions.retrieve(s_id).choices[0].message.content == s_text
    with pytest.raises(openai.NotFoundError, match="store: true"):
        oai.chat.completions.retrieve(plain.id)

    # the request's messages, in order (desc: last first), paged
    listed = oai.chat.completions.messages.list(a.id)
    assert [(m.id, m.role, m.content) for m in listed.data] == [(f"{a.id}-0", "system", "Be brief"),
                                                                 (f"{a.id}-1", "user", "Say hi")]
    assert [m.content for m in oai.chat.completions.messages.list(a.id, order="desc")] == ["Say hi", "Be brief"]
    assert [m.id for m in oai.chat.completions.messages.list(a.id, limit=1)] == [f"{a.id}-0", f"{a.id}-1"]

    # the metadata can change; the filter sees the new pairs
    updated = oai.chat.completions.update(a.id, metadata={"run": "z"})
    assert updated.metadata == {"run": "z"} and updated.choices[0].message == got.choices[0].message
    assert [c.id for c in oai.chat.completions.list(metadata={"run": "a"})] == []
    assert [c.id for c in oai.chat.completions.list(metadata={"run": "z"})] == [a.id]

    # another tenant sees none of them
    other = openai.OpenAI(base_url=live_server + "/v1", api_key=keys.other, max_retries=0)
    assert list(other.chat.completions.list()) == []
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.retrieve(a.id)
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.delete(a.id)

    # deleted: no longer retrieved or listed; its id still works as a cursor; its job stays
    deleted = oai.chat.completions.delete(a.id)
    assert deleted.deleted and deleted.id == a.id and deleted.object == "chat.completion.deleted"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.retrieve(a.id)
    assert [c.id for c in oai.chat.completions.list()] == [b.id, s_id]
    assert [c.id for c in oai.chat.completions.list(after=a.id)] == [b.id, s_id]
    auth = {"Authorization": f"Bearer {keys.paid}"}
    assert httpx.get(f"{live_server}/v1/jobs/{a.id.removeprefix('chatcmpl-')}", headers=auth).json()["status"] == \
        "succeeded"

    # refusals say what to fix
    with pytest.raises(openai.BadRequestError, match="to list after"):
        oai.chat.completions.list(after="chatcmpl-job_nope")
    with pytest.raises(openai.BadRequestError, match="metadata"):
        oai.chat.completions.create(messages=[{"role": "user", "content": "x"}], max_tokens=1, store=True,
                                    metadata={"k" * 65: "v"}, **GREEDY)
    bad = httpx.post(f"{live_server}/v1/chat/completions/{b.id}", headers=auth,
                     json={"metadata": {}, "temperature": 1})
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
    wide = httpx.get(f"{live_server}/v1/chat/completions", headers=auth,
                     params={f"metadata[k{i}]": "v" for i in range(17)})
    assert wide.status_code == 400 and wide.json()["error"]["param"] == "metadata"


def test_a_stored_completions_messages_are_listed_as_they_were_sent(oai):
    parts = [{"type": "text", "text": "Weather"}, {"type": "text", "text": "today?"}]
    sent = oai.chat.completions.create(messages=[{"role": "developer", "content": "Be brief"},
                                                 {"role": "user", "content": parts}], max_tokens=1, store=True,
                                       **GREEDY)
    listed = oai.chat.completions.messages.list(sent.id).data
    # the developer's role stays (it read system) and the parts are content_parts (they read null)
    assert [m.role for m in listed] == ["developer", "user"]
    assert [m.content_parts for m in listed] == [None, [ChatCompletionContentPartText(**p) for p in parts]]
    assert listed[1].content == "Weather\ntoday?"  # the text the model read


def test_an_assistant_message_sent_with_tool_calls_and_null_content_is_listed_with_null_content(oai):
    """It was listed with content "" (the text the model read); OpenAI lists it as sent: null."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    sent = oai.chat.completions.create(messages=[
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}], max_tokens=1, store=True, **GREEDY)
    user, assistant, tool = oai.chat.completions.messages.list(sent.id, order="asc").data
    assert assistant.content is None and assistant.tool_calls[0].id == "call_1", assistant
    assert (user.content, tool.content) == ("Weather in Paris?", "Sunny")
