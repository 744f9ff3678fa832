"""Batched chat's refusals name the conversation and the field within it (``messages.<i>...``): located where they
are raised (``chat_messages``' ``at``), or, for a conversation's messages as a whole, by ``in_conversation``."""

from __future__ import annotations

import pytest

from app.openai_schemas import BatchChatCompletionRequest, OpenAIError, in_conversation

FINE = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("bad, param, message", [
    ({"role": "robot", "content": "x"}, "messages.1.0.role", "messages.1.0.role: Input should be"),
    ({"role": "user", "content": [{"type": "image_url"}]}, "messages.1.0.content", "only text content parts"),
    ({"role": "user", "content": [{"type": "text", "text": 7}]}, "messages.1.0.content.0.text",
     "messages.1.0.content.0.text must be a string")])
def test_a_refusal_within_a_conversation_names_it_and_the_field(bad, param, message):
    request = BatchChatCompletionRequest.model_validate({"model": "m", "messages": [FINE, [bad]]})
    with pytest.raises(OpenAIError) as refused:
        request.conversation_specs(("free", "paid"))
    assert refused.value.param == param and message in refused.value.message, vars(refused.value)


def test_a_refusal_of_a_conversations_messages_as_a_whole_names_the_conversation():
    whole = in_conversation(OpenAIError(400, "the prompt is too long", param="messages", code="too_long"), 3)
    assert (whole.param, whole.message, whole.code) == ("messages.3", "messages.3: the prompt is too long", "too_long")
    other = OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    assert in_conversation(other, 3) is other  # the request's own field


def test_an_empty_tools_list_offers_the_template_no_tools_as_vllms_batched_chat():
    # vLLM's batched chat reads no tools (it has no such field): tools: [] is taken and the template given none;
    # coserve gave it [] (a template testing 'tools is not none' rendered otherwise)
    request = BatchChatCompletionRequest.model_validate({"model": "m", "messages": [FINE, FINE], "tools": []})
    request.check()
    assert [spec.tools for spec in request.conversation_specs(("free", "paid"))] == [None, None]
