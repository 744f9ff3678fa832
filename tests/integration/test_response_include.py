"""A stored response's ``include`` on retrieval (``GET /v1/responses/{id}``, plain and streamed, and its input
items) through the official client against the real app, SQLite and Redis (no worker: the job is finished in SQL,
as a worker writes it): ``message.output_text.logprobs`` gives the token logprobs the response kept, only where the
retrieval asks (OpenAI's include names what to add); a value this server cannot give is a 400 naming ``include``,
as at create."""

from __future__ import annotations

import openai
import pytest
from sqlalchemy import select, update

from app.db.models import Job
from app.db.session import session_scope
from tests.integration.test_conversation_item_include import KEPT, LOGPROBS, oai  # noqa: F401 - oai: a fixture

pytestmark = pytest.mark.integration


def answered_with_logprobs(oai: openai.OpenAI, db_url: str) -> str:
    """A stored response that asked for token logprobs at create and answered "Hello" with ``KEPT``, as a vLLM
    worker finishes it (the own engine of these tests refuses the include at create)."""
    resp = oai.responses.create(model="tiny", input="Hi", background=True)
    job_id = "job_" + resp.id.removeprefix("resp_")
    with session_scope(db_url) as s:
        sampling = s.scalar(select(Job.sampling).where(Job.id == job_id))
        s.execute(update(Job).where(Job.id == job_id).values(
            sampling={**sampling, "logprobs": 2}, status="succeeded", output_text="Hello", finish_reason="stop",
            prompt_tokens=3, completion_tokens=2, output_logprobs=KEPT))
    return resp.id


def test_a_retrieved_response_gives_its_logprobs_only_where_include_asks(oai, db_url):
    resp_id = answered_with_logprobs(oai, db_url)
    plain = oai.responses.retrieve(resp_id)
    assert plain.output_text == "Hello" and plain.output[0].content[0].logprobs == []  # not asked: none
    asked = oai.responses.retrieve(resp_id, include=[LOGPROBS]).output[0].content[0].logprobs
    assert [(t.token, t.logprob) for t in asked] == [("Hel", -0.25), ("lo", -0.5)]
    assert [t.token for t in asked[0].top_logprobs] == ["Hel", "Hi"]


def test_a_streamed_retrieval_gives_the_logprobs_only_where_include_asks(oai, db_url):
    resp_id = answered_with_logprobs(oai, db_url)
    for include, tokens in (([], []), ([LOGPROBS], ["Hel", "lo"])):
        events = list(oai.responses.retrieve(resp_id, stream=True, include=include))
        streamed = [t.token for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
        assert streamed == tokens, include
        assert [t.token for t in events[-1].response.output[0].content[0].logprobs] == tokens, include


def test_input_items_take_the_logprobs_include(oai, db_url):
    resp_id = answered_with_logprobs(oai, db_url)
    (item,) = oai.responses.input_items.list(resp_id, include=[LOGPROBS]).data  # given input: no logprobs to add
    assert item.role == "user" and item.content[0].text == "Hi"


def test_an_include_this_server_cannot_give_is_refused_naming_include_on_retrieval(oai, db_url):
    resp_id = answered_with_logprobs(oai, db_url)
    asks = [lambda include: oai.responses.retrieve(resp_id, include=include),
            lambda include: list(oai.responses.retrieve(resp_id, stream=True, include=include)),
            lambda include: oai.responses.input_items.list(resp_id, include=include)]
    for ask in asks:
        with pytest.raises(openai.BadRequestError) as refused:
            ask([LOGPROBS, "reasoning.encrypted_content"])
        assert refused.value.body["param"] == "include", refused.value.body
        assert "'reasoning.encrypted_content'" in refused.value.body["message"]
