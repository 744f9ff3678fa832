"""The Responses API written as chat: input items to messages, tools and formats to chat's, errors named
in Responses' terms, a finished response's conversation, and a job written back as a Response."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from app.openai_schemas import OpenAIError, chat_job, openai_parsed
from app.responses_schemas import (ResponsesRequest, history_of, input_items, input_messages, job_id_of,
                                   response_body, response_id)
from app.tool_calls import Answer

CALL = {"id": "call_ab_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}


def chat(body: dict, history: list | None = None):
    req = openai_parsed(ResponsesRequest, body)  # as the route reads it (a 400 naming the field)
    req.check()
    return req.chat_request(body, history or [])[0]


def test_input_items_become_chat_messages_and_parallel_calls_one_turn():
    items = [{"role": "developer", "content": "Terse."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                             {"type": "input_text", "text": "today?"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    assert input_messages(items) == [
        {"role": "developer", "content": "Terse."},
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "today?"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    # read back as items: the same kinds, calls and outputs in the same order
    back = input_items("job_ab", input_messages(items))
    assert [(i["type"], i.get("role"), i.get("call_id")) for i in back] == [
        ("message", "developer", None), ("message", "user", None), ("function_call", None, "c1"),
        ("function_call", None, "c2"), ("function_call_output", None, "c1")]
    assert len({i["id"] for i in back}) == len(back) and back[1]["content"] == [  # its parts kept apart
        {"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "today?"}]
    # the model reads them joined, as chat joins text parts (vLLM's join)
    assert chat({"input": items}).chat_messages()[1].content == "Weather\ntoday?"


def test_a_call_output_answers_a_call_made_before_it():
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    with pytest.raises(OpenAIError) as exc:  # OpenAI refuses it: the model would read an answer to no call
        chat({"input": [output]})
    assert exc.value.param == "input" and "'c1'" in exc.value.message
    made = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]
    assert chat({"input": [output]}, history=made).messages[-1] == {  # the call in the continued conversation
        "role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_the_chat_request_carries_instructions_tools_format_and_qos():
    req = chat({"input": "Hi", "instructions": "Be brief", "max_output_tokens": 5, "tier": "free", "ttft_ms": 900,
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                "tool_choice": {"type": "function", "name": "f"}},
               history=[{"role": "user", "content": "Before"}])
    assert [m.content for m in req.chat_messages()] == ["Be brief", "Before", "Hi"]  # vLLM's order
    assert req.max_tokens == 5 and req.tier == "free" and req.ttft_ms == 900
    assert req.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert req.tool_choice == {"type": "function", "function": {"name": "f"}}
    formatted = chat({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                         "schema": {"type": "object"}}}})
    assert formatted.response_format == {"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": {"type": "object"}}}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, "input.0"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "conversation": {"name": "c"}}, "conversation"),
    ({"input": "x", "max_tool_calls": -1}, "max_tool_calls"),
    # vLLM refuses structured_outputs beside any text.format, a plain text one too
    ({"input": "x", "text": {"format": {"type": "text"}}, "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a+"}},
     "structured_outputs"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),  # the answer's length: refused, as on chat
    # a function tool is flat here: chat's tools.0.function.<field> is the Responses tools.0.<field>
    ({"input": "x", "tools": [{"type": "function"}]}, "tools.0.name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 5}]}, "tools.0.parameters"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "g",
                                                                  "description": 5}]}, "tools.1.description"),
])
def test_errors_name_the_field_the_client_wrote(body, param):
    with pytest.raises(OpenAIError) as exc:
        chat(body)
    assert exc.value.status_code == 400 and exc.value.param == param, exc.value.message
    assert ".function." not in exc.value.message  # the message names the field as the client wrote it too


def test_a_continued_conversation_drops_the_instructions_and_adds_the_answer():
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Weather?"}]
    answer = Answer(content=None, tool_calls=[{**CALL, "index": 0}], finish_reason="tool_calls")
    assert history_of(messages, {"instructions": "Be brief", "input_from": 1}, answer) == [
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    # a continued conversation that had a system message of the same text keeps it: the instructions are
    # the message before the input
    earlier = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello"}]
    body = {"model": "m", "input": "Weather?", "instructions": "Be brief"}
    req = ResponsesRequest.model_validate(body)
    job_messages = req.chat_request(body, earlier)[0].messages
    assert history_of(job_messages, req.kept(earlier), answer)[:4] == [
        *earlier, {"role": "user", "content": "Weather?"}]
    # without instructions every message stays, a system one too
    text = Answer(content="Sunny", tool_calls=None, finish_reason="stop")
    assert history_of(messages, {}, text)[0] == messages[0]


def test_a_job_written_as_a_response():
    job = SimpleNamespace(id="job_ab", status="succeeded", created_at=datetime(2026, 1, 1, tzinfo=UTC),
                          model="m", tier="free", sampling={"temperature": 0.5, "top_p": 1.0},
                          finished_at=datetime(2026, 1, 1, 0, 0, 9, tzinfo=UTC))
    assert response_id(job.id) == "resp_ab" and job_id_of("resp_ab") == "job_ab" and job_id_of("job_ab") is None
    cut = response_body(job, {"max_output_tokens": 3}, ("free", "paid"),
                        answer=Answer("Hel", None, "length"), prompt_tokens=4, completion_tokens=3)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["content"][0]["text"] == "Hel" and cut["service_tier"] == "flex"
    assert cut["output"][0]["status"] == "incomplete" and cut["completed_at"] is None  # max_output_tokens cut it
    assert cut["usage"]["total_tokens"] == 7 and cut["max_output_tokens"] == 3
    assert cut["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}  # no counts
    hit = response_body(job, {}, ("free", "paid"), answer=Answer("Hel", None, "stop"), prompt_tokens=300,
                        completion_tokens=3, cached_tokens=256)
    assert hit["usage"]["input_tokens_details"] == {"cached_tokens": 256, "cache_write_tokens": 0}
    assert hit["usage"]["input_tokens"] == 300 and hit["completed_at"] == 1767225609  # when the job ended
    assert (hit["tool_choice"], hit["user"], hit["top_logprobs"]) == ("auto", None, None)  # OpenAI's defaults
    assert hit["max_tool_calls"] is None
    asked = ResponsesRequest.model_validate({"input": "x", "user": "u1", "top_logprobs": 2, "max_tool_calls": 3})
    kept = response_body(job, asked.kept([]), ("free", "paid"))
    assert (kept["user"], kept["top_logprobs"], kept["max_tool_calls"]) == ("u1", 2, 3)  # the request's, echoed
    called = response_body(job, {}, ("free", "paid"), answer=Answer(None, [CALL], "tool_calls"))
    assert called["status"] == "completed" and called["output"] == [
        {"id": "fc_ab_0", "type": "function_call", "status": "completed", "call_id": "call_ab_0",
         "name": "get_weather", "arguments": '{"city":"Rome"}'}]
    running = response_body(job, {}, ("free", "paid"), status="running")
    assert running["status"] == "in_progress" and running["output"] == [] and running["usage"] is None
    failed = response_body(job, {}, ("free", "paid"), status="expired", error={"code": "deadline_exceeded",
                                                                               "message": "late"})
    assert failed["status"] == "failed" and failed["error"]["code"] == "deadline_exceeded"


def test_a_cancelled_response_shows_what_it_produced_as_incomplete_items():
    job = SimpleNamespace(id="job_ab", status="cancelled", created_at=datetime(2026, 1, 1, tzinfo=UTC),
                          model="m", tier="paid", sampling={})
    body = response_body(job, {}, ("free", "paid"), answer=Answer("Hel", [CALL], "cancelled"), prompt_tokens=4,
                         completion_tokens=3)
    assert body["status"] == "cancelled" and body["incomplete_details"] is None
    assert [(item["type"], item["status"]) for item in body["output"]] == [("message", "incomplete"),
                                                                           ("function_call", "incomplete")]
    assert body["output"][0]["content"][0]["text"] == "Hel" and body["usage"]["output_tokens"] == 3


def test_vllms_request_fields_reach_the_job_or_are_refused_by_name_as_on_chat():
    raw = {"model": "m", "input": "hi", "cache_salt": "a", "truncate_prompt_tokens": 5, "bad_words": ["no"],
           "include_stop_str_in_output": True, "prompt_cache_key": "user-1"}
    _chat, spec = ResponsesRequest.model_validate(raw).chat_request(raw, [])
    assert (spec.cache_salt, spec.truncate_prompt_tokens, spec.bad_words, spec.include_stop_str_in_output,
            spec.prompt_cache_key) == ("a", 5, ["no"], True, "user-1")
    for field, value in (("priority", 2), ("use_beam_search", True), ("return_token_ids", True),
                         ("prompt_logprobs", 0)):
        raw = {"model": "m", "input": "hi", field: value}
        with pytest.raises(OpenAIError) as exc:
            ResponsesRequest.model_validate(raw).chat_request(raw, [])
        assert exc.value.param == field and exc.value.status_code == 400


def test_the_reasoning_effort_and_thinking_budget_reach_the_job_as_on_chat():
    raw = {"model": "m", "input": "hi", "reasoning": {"effort": "low"}, "thinking_token_budget": 64}
    _chat, spec = ResponsesRequest.model_validate(raw).chat_request(raw, [])
    chat_raw = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low",
                "thinking_token_budget": 64}
    _chat, chat_spec = chat_job(chat_raw, ("free", "paid"), lambda exc: exc)
    assert spec.thinking_token_budget == chat_spec.thinking_token_budget == 64
    assert spec.chat_template_kwargs == chat_spec.chat_template_kwargs == {"reasoning_effort": "low",
                                                                           "enable_thinking": True}
    raw = {"model": "m", "input": "hi", "thinking_token_budget": -2}  # checked as chat's, named as the client wrote it
    with pytest.raises(OpenAIError) as exc:
        ResponsesRequest.model_validate(raw).chat_request(raw, [])
    assert exc.value.param == "thinking_token_budget" and exc.value.status_code == 400


def test_the_default_verbosity_is_taken():
    req = chat({"input": "x", "text": {"verbosity": "medium"}})  # OpenAI's default: the answer as it comes
    assert req.verbosity == "medium" and req.messages == [{"role": "user", "content": "x"}]


def test_tool_choice_is_read_as_vllms_responses_request_reads_it():
    # vLLM's ResponsesRequest: tool_choice defaults to "auto", made "none" where no tools are given (an explicit
    # "auto" too); an explicit null is no choice it takes (a 400). coserve read null as "auto", and refused "auto"
    # without tools
    tools = [{"type": "function", "name": "f"}]
    for body in ({"input": "x", "tool_choice": None}, {"input": "x", "tools": tools, "tool_choice": None}):
        with pytest.raises(OpenAIError) as exc:
            chat(body)
        assert exc.value.status_code == 400 and exc.value.param == "tool_choice", exc.value.message
        assert "leave it out" in exc.value.message, exc.value.message
    assert chat({"input": "x", "tools": tools}).tool_fields()["tool_choice"] == "auto"
    for choice in ("auto", "none"):
        body = {"input": "x", "tool_choice": choice}
        assert ResponsesRequest.model_validate(body).chat_request(body, [])[1].sampling(8)["tool_choice"] is None
