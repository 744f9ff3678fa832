"""A Messages request written as chat (pure translation): a prefilled assistant turn, thinking's checks."""

from __future__ import annotations

import re

import pytest

from app.anthropic_schemas import MessagesRequest
from app.openai_schemas import OpenAIError, openai_parsed

ASK = {"role": "user", "content": "Weather?"}


def chat_of(**fields):
    raw = {"model": "tiny", "max_tokens": 3000, **fields}
    body = MessagesRequest.model_validate(raw)
    body.check(raw)
    return body.chat_request(raw)


@pytest.mark.parametrize("prefill", ["It is", [{"type": "text", "text": "It"}, {"type": "text", "text": "is"}]])
def test_a_last_assistant_turn_is_continued_not_closed(prefill):
    chat, spec = chat_of(messages=[ASK, {"role": "assistant", "content": prefill}])
    assert (spec.add_generation_prompt, spec.continue_final_message) == (False, True)
    assert chat.messages[-1]["role"] == "assistant"


def test_a_conversation_of_no_messages_is_a_400_naming_them():
    with pytest.raises(OpenAIError) as exc:
        chat_of(messages=[{"role": "user", "content": []}])
    assert exc.value.status_code == 400 and exc.value.param == "messages"


@pytest.mark.parametrize("messages", [
    [ASK],  # the usual: a new assistant turn
    [ASK, {"role": "assistant", "content": "  "}],  # nothing to continue
    [ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}],
])
def test_other_conversations_get_a_new_assistant_turn(messages):
    _, spec = chat_of(messages=messages)
    assert (spec.add_generation_prompt, spec.continue_final_message) == (True, False)


@pytest.mark.parametrize(("thinking", "says"), [
    ({"type": "enabled"}, "needs budget_tokens"),
    ({"type": "enabled", "budget_tokens": 512}, "at least 1024"),
    ({"type": "enabled", "budget_tokens": "2000"}, "an integer"),
    ({"type": "enabled", "budget_tokens": 3000}, "less than max_tokens (3000)"),
])
def test_thinking_with_a_budget_is_checked_as_anthropic_checks_it(thinking, says):
    with pytest.raises(OpenAIError) as exc:
        chat_of(messages=[ASK], thinking=thinking)
    assert exc.value.status_code == 400 and exc.value.param == "thinking.budget_tokens" and says in exc.value.message


def test_a_budget_within_max_tokens_and_an_effort_are_taken():
    chat, spec = chat_of(messages=[ASK], thinking={"type": "enabled", "budget_tokens": 1024})
    assert chat.reasoning_effort is None  # the model thinks as its template has it
    assert spec.sampling(16)["thinking_token_budget"] == 1024  # as vLLM: kept by its reasoning_config
    assert "thinking_token_budget" not in chat_of(messages=[ASK])[1].sampling(16)
    chat, _ = chat_of(messages=[ASK], output_config={"effort": "low"})
    assert chat.reasoning_effort == "low"  # as vLLM: the template's reasoning effort
    chat, _ = chat_of(messages=[ASK], output_config={"effort": "low"}, thinking={"type": "disabled"})
    assert chat.reasoning_effort == "none"
    with pytest.raises(OpenAIError) as exc:
        chat_of(messages=[ASK], output_config={"effort": "hard"})
    assert exc.value.param == "output_config.effort" and "output_config.effort" in exc.value.message
    # count_tokens has no max_tokens to hold the budget under
    from app.anthropic_schemas import CountTokensRequest
    raw = {"model": "tiny", "messages": [ASK], "thinking": {"type": "enabled", "budget_tokens": 2048}}
    CountTokensRequest.model_validate(raw).check(raw)


def test_errors_name_the_messages_field_and_keep_their_words():
    with pytest.raises(OpenAIError) as exc:
        chat_of(messages=[ASK], stop_sequences=["a", "b", "c", "d", "e"])
    assert exc.value.param == "stop_sequences"
    assert exc.value.message == "stop_sequences: at most 4 stop sequences"  # not "stop_sequences sequences"


def test_anthropics_service_tiers_are_taken():
    _, standard = chat_of(messages=[ASK], service_tier="standard_only")
    _, auto = chat_of(messages=[ASK], service_tier="auto")
    _, unset = chat_of(messages=[ASK])
    assert standard.tier == auto.tier == unset.tier  # the key's own tier


def test_the_end_user_is_the_jobs_as_on_chat():
    """Anthropic's metadata.user_id, OpenAI chat's safety_identifier (else user): the job's end user (Usage API)."""
    from app.openai_schemas import ChatCompletionRequest
    _, spec = chat_of(messages=[ASK], metadata={"user_id": "user_ada"})
    assert spec.user == "user_ada"
    with pytest.raises(OpenAIError) as exc:
        chat_of(messages=[ASK], metadata={"user_id": "u" * 257})
    assert exc.value.param == "metadata.user_id"
    for body, user in (({"user": "old"}, "old"), ({"user": "old", "safety_identifier": "sid"}, "sid"), ({}, None)):
        chat = ChatCompletionRequest.model_validate({"model": "tiny", "messages": [ASK], **body})
        assert chat.job_spec(messages=chat.chat_messages()).user == user


def test_usage_counts_the_prompt_apart_as_read_written_and_neither():
    from app.anthropic_schemas import usage_of
    # Anthropic's total input is input_tokens + cache_read_input_tokens + cache_creation_input_tokens
    assert usage_of(100, 7, 64, 32) == {"input_tokens": 4, "output_tokens": 7, "cache_read_input_tokens": 64,
                                        "cache_creation_input_tokens": 32}
    assert usage_of(100, 7, 0, 0) == {"input_tokens": 100, "output_tokens": 7, "cache_read_input_tokens": 0,
                                      "cache_creation_input_tokens": 0}
    assert usage_of(100, 0, None) == {"input_tokens": 100, "output_tokens": 0}  # what the engine did not say


@pytest.mark.parametrize("status, kind", [(409, "conflict_error"), (503, "overloaded_error"), (504, "timeout_error"),
                                          (500, "api_error"), (422, "invalid_request_error")])
def test_an_error_is_typed_as_anthropic_types_its_status(status, kind):
    # Anthropic's errors: 409 conflict_error, 504 timeout_error, 529 overloaded_error (coserve answers 503 for it)
    from app.anthropic_schemas import error_body

    assert error_body(status, "why") == {"type": "error", "error": {"type": kind, "message": "why"}}


@pytest.mark.parametrize("user_id", [42, ["u"], {"id": "u"}, True])
def test_a_user_id_that_is_no_string_is_a_400_naming_it_not_dropped(user_id):
    with pytest.raises(OpenAIError) as exc:
        openai_parsed(MessagesRequest, {"model": "tiny", "max_tokens": 3, "messages": [ASK],
                                        "metadata": {"user_id": user_id}})
    assert (exc.value.status_code, exc.value.param) == (400, "metadata.user_id")
    assert "valid string" in exc.value.message


def test_a_null_user_id_names_no_end_user():
    _, spec = chat_of(messages=[ASK], metadata={"user_id": None})
    assert spec.user is None


def test_an_answer_of_no_text_is_one_empty_text_block_as_vllm_answers_it():
    # vLLM's Messages API (messages_full_converter): an empty completion is a single empty text block, not [], so a
    # client's message.content[0].text reads "" (a stop sequence the answer began with, a prefill nothing followed)
    from app.anthropic_schemas import message_of
    from app.tool_calls import Answer

    empty = message_of("job_1", "tiny", Answer("", None, "stop"), "\n\n", 9, 1, None, None)
    assert empty["content"] == [{"type": "text", "text": ""}]
    assert (empty["stop_reason"], empty["stop_sequence"]) == ("stop_sequence", "\n\n")
    said = message_of("job_2", "tiny", Answer("Hi", None, "stop"), None, 9, 1, None, None)
    assert said["content"] == [{"type": "text", "text": "Hi"}]


def _call(arguments: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


@pytest.mark.parametrize(("arguments", "stop"), [
    ('{"city": "Pa', ("stop_sequence", "ris")),  # a stop string cut the call short: it must not run
    ('{"city": "Paris"}', ("tool_use", None)),  # a whole call wins over the stop string after it
])
def test_a_tool_call_a_stop_sequence_cut_short_ends_in_the_stop_sequence_as_vllm_says(arguments, stop):
    # vLLM's _to_anthropic_stop_reason: "A matched stop string wins unless the tool calls are complete"
    from app.anthropic_schemas import message_of, stop_of
    from app.tool_calls import Answer

    assert stop_of("stop", "ris", [_call(arguments)]) == stop
    message = message_of("job_1", "tiny", Answer(None, [_call(arguments)], "stop"), "ris", 9, 5, None, None)
    assert (message["stop_reason"], message["stop_sequence"]) == stop
    # no stop string: the model's call, where whole; one the end-of-sequence token cut short must not run either
    assert stop_of("stop", None, [_call(arguments)]) == (stop[0].replace("stop_sequence", "end_turn"), None)
    assert stop_of("length", "ris", [_call(arguments)]) == ("max_tokens", None)  # max_tokens always wins


@pytest.mark.parametrize("model", [{}, {"model": None}, {"model": ""}], ids=["missing", "null", "empty"])
def test_a_request_without_a_model_is_a_400_naming_it_as_vllms_request_type_answers_it(model):
    # vLLM's AnthropicMessagesRequest and AnthropicCountTokensRequest: model: str, "Model is required"; Anthropic's
    # API too. Not served with the default model, as OpenAI's chat is (vLLM's ChatCompletionRequest: model optional)
    from app.anthropic_schemas import CountTokensRequest
    from app.openai_schemas import ChatCompletionRequest

    for kind in (MessagesRequest, CountTokensRequest):
        with pytest.raises(OpenAIError) as exc:
            openai_parsed(kind, {"max_tokens": 3, "messages": [ASK], **model})
        assert (exc.value.status_code, exc.value.param) == (400, "model")
        assert exc.value.message.startswith("model: ")
    assert ChatCompletionRequest.model_validate({"messages": [ASK], **model}).model in (None, "")


BILLING = "x-anthropic-billing-header: cc_version=2.1.3.a1b; cc_entrypoint=cli; cch=0f3e2;"


def test_system_blocks_are_joined_as_vllm_joins_them_and_claude_codes_billing_header_is_dropped():
    # vLLM's _convert_system_message: the text blocks joined with "", a billing header (a per-request hash that
    # defeats the prefix cache) left out, and no system message where no text is left
    def system(blocks):
        chat, _ = chat_of(messages=[ASK], system=blocks)
        return [m["content"] for m in chat.messages if m["role"] == "system"]

    text = [{"type": "text", "text": "You are terse. "}, {"type": "text", "text": BILLING},
            {"type": "text", "text": "Answer in French."}]
    assert system(text) == ["You are terse. Answer in French."]
    assert system([{"type": "text", "text": BILLING}]) == [] == system([{"type": "text", "text": ""}])
    assert system("Be brief") == ["Be brief"]
    # a tool's answer of text blocks stays joined by a newline, as vLLM's _convert_user_tool_result joins it
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}
    chat, _ = chat_of(messages=[{"role": "user", "content": [result]}])
    assert chat.messages[0]["content"] == "a\nb"


def test_a_thinking_block_is_signed_as_vllm_signs_it_the_same_each_time_it_is_read():
    # vLLM's messages_full_converter gives a thinking block a signature (uuid4().hex), which clients keep and send
    # back with the block; coserve's is the job's own, so a stored message reads the same every time
    from app.anthropic_schemas import message_of
    from app.tool_calls import Answer

    def thinking(job_id):
        message = message_of(job_id, "tiny", Answer("Hi", None, "stop", reasoning="Hmm."), None, 9, 3, None, None)
        return message["content"][0]

    block = thinking("job_1")
    assert block["type"] == "thinking" and block["thinking"] == "Hmm."
    assert re.fullmatch(r"[0-9a-f]{32}", block["signature"]), block
    assert thinking("job_1") == block and thinking("job_2")["signature"] != block["signature"]
