"""Conversation items' ``include`` through the official client against the real app and SQLite (no worker: the
response's job is finished in SQL, as a worker writes it): ``message.output_text.logprobs`` gives a response's kept
token logprobs, and a value this server cannot give is a 400 naming ``include``, as the Responses API's own is."""

from __future__ import annotations

import openai
import pytest
from sqlalchemy import update

from app.db.models import Job
from app.db.session import session_scope

pytestmark = pytest.mark.integration

LOGPROBS = "message.output_text.logprobs"
KEPT = [{"token": "Hel", "logprob": -0.25, "bytes": [72, 101, 108], "top": [["Hel", -0.25], ["Hi", -1.5]]},
        {"token": "lo", "logprob": -0.5, "bytes": [108, 111], "top": [["lo", -0.5], ["p", -2.0]]}]


@pytest.fixture
def oai(client, keys) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=keys.paid, http_client=client, max_retries=0)


def answered_turn(oai: openai.OpenAI, db_url: str) -> tuple[str, str]:
    """A conversation and its response's message item id, the response answered "Hello" with ``KEPT``."""
    conv = oai.conversations.create()
    resp = oai.responses.create(model="tiny", conversation=conv.id, input="Hi", background=True)
    with session_scope(db_url) as s:
        s.execute(update(Job).where(Job.id == "job_" + resp.id.removeprefix("resp_")).values(
            status="succeeded", output_text="Hello", finish_reason="stop", prompt_tokens=3, completion_tokens=2,
            output_logprobs=KEPT))
    (message,) = [i for i in oai.conversations.items.list(conv.id).data if i.role == "assistant"]
    return conv.id, message.id


def test_conversation_items_give_a_responses_logprobs_where_include_asks(oai, db_url):
    conv_id, msg_id = answered_turn(oai, db_url)
    plain = oai.conversations.items.retrieve(msg_id, conversation_id=conv_id)
    assert plain.content[0].text == "Hello" and plain.content[0].logprobs == []  # not asked: none
    listed = oai.conversations.items.list(conv_id, include=[LOGPROBS], order="asc").data
    (text,) = [i.content[0] for i in listed if i.id == msg_id]
    assert [(t.token, t.logprob) for t in text.logprobs] == [("Hel", -0.25), ("lo", -0.5)]
    assert [t.token for t in text.logprobs[0].top_logprobs] == ["Hel", "Hi"]
    got = oai.conversations.items.retrieve(msg_id, conversation_id=conv_id, include=[LOGPROBS])
    assert got.content[0].logprobs == text.logprobs


def test_an_include_this_server_cannot_give_is_refused_naming_include(oai, db_url):
    conv_id, msg_id = answered_turn(oai, db_url)
    asks = [lambda include: oai.conversations.items.list(conv_id, include=include),
            lambda include: oai.conversations.items.retrieve(msg_id, conversation_id=conv_id, include=include),
            lambda include: oai.conversations.items.create(
                conv_id, items=[{"type": "message", "role": "user", "content": "x"}], include=include)]
    for ask in asks:
        with pytest.raises(openai.BadRequestError) as refused:
            ask([LOGPROBS, "reasoning.encrypted_content"])
        assert refused.value.body["param"] == "include", refused.value.body
        assert "'reasoning.encrypted_content'" in refused.value.body["message"]
