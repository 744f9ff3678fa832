"""The prompt a Responses request's input items become, held to what vLLM 0.32 makes of the same request: its own
request model and converter (``ResponsesRequest``, ``construct_input_messages``: no server) and its own chat-message
parser, rendered through the same chat template with the bundled model's tokenizer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from app.api.responses import ENDPOINT
from app.openai_schemas import OpenAIError, openai_parsed
from app.responses_schemas import ResponsesRequest, input_items
from app.services.jobs import encode_spec
from app.services.model_info import use_chat_template
from tests.unit.api.test_anthropic_conversation import (  # noqa: F401
    BUNDLED, MODEL, QWEN_LIKE, tok, vllm_conversation, vllm_rendered)

# as Qwen3's: an assistant turn's reasoning_content as <think>, its tool calls after its content, tool results
QWEN_TOOLS = "qwen-tools"
QWEN_TOOLS_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' and message.reasoning_content is string %}"
    "{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{ '<tool_call>' + call.function.name + ' ' + (call.function.arguments | tojson) + '</tool_call>' }}"
    "{%- endfor %}"
    "{%- if message.role == 'tool' %}{{ ' (for ' + message.tool_call_id + ')' }}{%- endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
ASK = {"role": "user", "content": "Weather in Rome and Paris?"}
THOUGHT = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                          "text": "Look both up."}]}
SAID = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]}
ROME = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Rome"}'}
PARIS = {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city":"Paris"}'}
ROME_OUT = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
PARIS_OUT = {"type": "function_call_output", "call_id": "c2", "output": "rain"}
THOUGHT_2 = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Mixed."}]}
ANSWER = {"type": "message", "role": "assistant", "content": "Rome sunny, Paris rain."}

# the orders a client sends a tool turn back in (a reasoning model's output items, then the call outputs)
TURNS = {
    "reasoning-call-output": [ASK, THOUGHT, ROME, ROME_OUT],
    "reasoning-message-calls-outputs": [ASK, THOUGHT, SAID, ROME, PARIS, ROME_OUT, PARIS_OUT],
    "message-calls-outputs": [ASK, SAID, ROME, PARIS, ROME_OUT, PARIS_OUT],
    "calls-outputs-reasoning-answer": [ASK, THOUGHT, ROME, PARIS, ROME_OUT, PARIS_OUT, THOUGHT_2, ANSWER,
                                       {"role": "user", "content": "And tomorrow?"}],
    "call-then-message": [ASK, ROME, SAID, ROME_OUT],
    "message-then-reasoning": [ASK, SAID, THOUGHT, ROME, ROME_OUT],
    "summary-only-reasoning": [ASK, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Brief."}]},
                               ROME, ROME_OUT],
}


@pytest.fixture(scope="module")
def templates(tok) -> dict[str, str]:  # noqa: F811
    return {BUNDLED: tok.chat_template, QWEN_TOOLS: QWEN_TOOLS_TEMPLATE}


def vllm_prompt(tok: Any, raw: dict[str, Any], template: str) -> list[int]:  # noqa: F811
    """The token ids vLLM's /v1/responses renders ``raw`` to with ``template`` (its OnlineRenderer's steps)."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest as VllmResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

    request = VllmResponsesRequest.model_validate(raw)
    messages = construct_input_messages(request_instructions=request.instructions, request_input=request.input)
    tools = construct_tool_dicts(request.tools, request.tool_choice)
    return vllm_rendered(tok, vllm_conversation(messages), tools, template)


def coserve_request(raw: dict[str, Any]) -> Any:
    body = openai_parsed(ResponsesRequest, raw)  # as the route reads it
    body.check()
    return body


def coserve_prompt(raw: dict[str, Any], template: str) -> list[int]:
    """The token ids coserve's job of ``raw`` renders to with ``template`` in use (COSERVE_CHAT_TEMPLATE)."""
    use_chat_template(MODEL, template)
    _, spec = coserve_request(raw).chat_request(raw, [])
    return encode_spec(MODEL, spec, ENDPOINT)  # as its worker feeds it


@pytest.mark.parametrize("template", [BUNDLED, QWEN_TOOLS])
@pytest.mark.parametrize("turn", list(TURNS))
def test_a_tool_turns_items_become_the_chat_messages_vllm_makes_of_them(tok, templates, turn, template):  # noqa: F811
    # vLLM's construct_chat_messages_with_tool_call: a reasoning item is the assistant message's reasoning, an
    # assistant message fills a message that has no content yet, and a function call joins the assistant message
    # before it (content or not)
    raw = {"model": "tiny", "input": TURNS[turn], "tools": TOOLS, "instructions": "Be brief."}
    ids = coserve_prompt(raw, templates[template])
    assert ids == vllm_prompt(tok, raw, templates[template])
    if template == QWEN_TOOLS and any(item.get("type") == "reasoning" for item in TURNS[turn]):
        assert "<think>\n" in tok.decode(ids)  # the thinking reaches the template


@pytest.mark.parametrize("tool", [
    {"type": "function", "name": "get_weather", "defer_loading": True},
    {"type": "function", "name": "get_weather", "description": "", "parameters": {"type": "object"}, "strict": False,
     "defer_loading": False},
], ids=["defer-loading", "all-fields"])
def test_the_tools_reach_the_template_as_vllm_converts_them(tok, tool):  # noqa: F811
    # vLLM's convert_tool_responses_to_completions_format: the flat tool's fields go to FunctionDefinition, which
    # keeps defer_loading (and strict) where given; a template that writes the tools as JSON counts every one
    from tests.unit.api.test_chat_template_inputs import TOOLS_AS_JSON

    raw = {"model": "tiny", "input": [ASK], "tools": [tool]}
    assert coserve_prompt(raw, TOOLS_AS_JSON) == vllm_prompt(tok, raw, TOOLS_AS_JSON)


def test_a_tool_turn_lists_back_as_the_items_sent_less_the_reasoning():
    # the input items a response lists back are as before: one for each message, call and output, in the order
    # sent; reasoning items are not listed
    raw = {"model": "tiny", "input": TURNS["calls-outputs-reasoning-answer"]}
    body = coserve_request(raw)
    chat, spec = body.chat_request(raw, [])
    kept = body.kept([])
    own = kept.get("own_input") or [m.stored() for m in spec.messages][kept["input_from"]:]
    listed = input_items("job_ab", own)
    assert [(i["type"], i.get("role"), i.get("call_id")) for i in listed] == [
        ("message", "user", None), ("function_call", None, "c1"), ("function_call", None, "c2"),
        ("function_call_output", None, "c1"), ("function_call_output", None, "c2"), ("message", "assistant", None),
        ("message", "user", None)]
    assert [i["id"] for i in listed] == ["msg_ab_0", "fc_ab_1_0", "fc_ab_1_1", "fco_ab_2", "fco_ab_3", "msg_ab_4",
                                         "msg_ab_5"]


def test_a_reasoning_item_with_encrypted_content_is_a_400_as_vllm_refuses_it():
    raw = {"model": "tiny", "input": [ASK, {**THOUGHT, "encrypted_content": "opaque"}, ROME, ROME_OUT]}
    with pytest.raises(OpenAIError) as exc:
        coserve_request(raw).chat_request(raw, [])
    assert exc.value.status_code == 400 and exc.value.param == "input.1.encrypted_content"


@pytest.mark.parametrize("template", [BUNDLED, QWEN_TOOLS])
def test_an_assistant_message_of_several_parts_is_read_as_vllm_reads_it(tok, templates, template):  # noqa: F811
    # vLLM's construct_chat_messages_with_tool_call reads an assistant message item's first output_text part alone;
    # coserve joined every part with a newline
    said = {**SAID, "content": [{"type": "output_text", "text": "Checking.", "annotations": []},
                                {"type": "output_text", "text": "Both cities.", "annotations": []}]}
    raw = {"model": "tiny", "input": [ASK, said, {"role": "user", "content": "Go on."}], "tools": TOOLS}
    assert coserve_prompt(raw, templates[template]) == vllm_prompt(tok, raw, templates[template])


def vllm_continued_prompt(tok: Any, first: dict[str, Any], answer: str, then: dict[str, Any],
                          template: str) -> list[int]:
    """The token ids vLLM's /v1/responses renders ``then`` to with ``template``, ``then`` continuing the stored
    response to ``first`` (``previous_response_id``) whose answer was ``answer``: its msg_store keeps ``first``'s
    input messages as it built them, and ``construct_input_messages`` puts them (less system ones) and the previous
    output's text before the new input; its chat parser reads them in the template's content format."""
    from openai.types.responses import ResponseOutputMessage, ResponseOutputText
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest as VllmResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    earlier = VllmResponsesRequest.model_validate(first)
    stored = construct_input_messages(request_instructions=earlier.instructions, request_input=earlier.input)
    said = ResponseOutputMessage(id="msg_1", type="message", role="assistant", status="completed",
                                 content=[ResponseOutputText(type="output_text", text=answer, annotations=[])])
    request = VllmResponsesRequest.model_validate(then)
    messages = construct_input_messages(request_instructions=request.instructions, request_input=request.input,
                                        prev_msg=stored, prev_response_output=[said])
    return vllm_read(tok, messages, template)


def vllm_read(tok: Any, messages: list[dict[str, Any]], template: str) -> list[int]:
    """The token ids vLLM renders chat ``messages`` to with ``template``, its chat parser reading them in the
    template's content format (its detection: a template that loops over a message's parts gets them)."""
    from types import SimpleNamespace

    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import _detect_content_format

    text_only = SimpleNamespace(multimodal_config=None, is_multimodal_model=False, enable_prompt_embeds=False)
    conversation = parse_chat_messages(messages, text_only, _detect_content_format(template, default="string"))[0]
    return vllm_rendered(tok, conversation, None, template)


def coserve_continued_prompt(first: dict[str, Any], answer: str, then: dict[str, Any], template: str) -> list[int]:
    """The token ids coserve's job of ``then`` renders to, ``then`` continuing the stored response to ``first`` whose
    answer was ``answer``: the first job's messages as it keeps them, read back as the route reads them
    (``history_of``)."""
    from app.responses_schemas import history_of
    from app.tool_calls import Answer

    use_chat_template(MODEL, template)
    body = coserve_request(first)
    _, spec = body.chat_request(first, [])
    history = history_of([m.stored() for m in spec.messages], body.kept([]),
                         Answer(content=answer, tool_calls=None, finish_reason="stop"))
    _, spec = coserve_request(then).chat_request(then, history)
    return encode_spec(MODEL, spec)


PARTED_ASK = {"role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                          {"type": "input_text", "text": "in Oslo?"}]}


@pytest.mark.parametrize("template", [BUNDLED, "parts-loop"])
def test_a_continued_responses_history_keeps_its_parts_as_vllm_keeps_them(tok, templates, template):  # noqa: F811
    # vLLM keeps a stored response's input messages as they came (a message's text parts apart) and a later response
    # (previous_response_id) gives them to the template as such; coserve's history read each one as one part
    from tests.unit.api.test_chat_template_inputs import PARTS_LOOP

    template = PARTS_LOOP if template == "parts-loop" else templates[template]
    first = {"model": "tiny", "input": [PARTED_ASK], "instructions": "Be brief."}
    then = {"model": "tiny", "input": "And tomorrow?", "previous_response_id": "resp_1"}
    ids = coserve_continued_prompt(first, "Sunny.", then, template)
    assert ids == vllm_continued_prompt(tok, first, "Sunny.", then, template)


@pytest.mark.parametrize("template", [BUNDLED, "parts-loop"])
def test_a_continued_response_drops_the_system_messages_vllm_drops(tok, templates, template):  # noqa: F811
    # vLLM's construct_input_messages drops every system message of the previous response (its instructions and its
    # system input alike) and keeps a developer's; coserve dropped the instructions alone
    from tests.unit.api.test_chat_template_inputs import PARTS_LOOP

    template = PARTS_LOOP if template == "parts-loop" else templates[template]
    first = {"model": "tiny", "instructions": "Be brief.", "input": [
        {"role": "system", "content": "Answer in French."}, {"role": "developer", "content": "Terse."}, ASK]}
    then = {"model": "tiny", "input": "And tomorrow?", "previous_response_id": "resp_1"}
    ids = coserve_continued_prompt(first, "Sunny.", then, template)
    assert ids == vllm_continued_prompt(tok, first, "Sunny.", then, template)
    assert "Terse." in tok.decode(ids) and "French" not in tok.decode(ids)


def test_a_continued_responses_developer_message_stays_in_every_later_turn():
    # vLLM keeps a developer's message in the history it stores, so a third response still reads it; a response stored
    # before its input's roles were kept reads back as it did (its system input stays)
    from app.responses_schemas import history_of
    from app.tool_calls import Answer

    said = Answer(content="Sunny.", tool_calls=None, finish_reason="stop")
    first = {"model": "tiny", "input": [{"role": "system", "content": "French."}, {"role": "developer",
                                                                                 "content": "Terse."}, ASK]}
    body = coserve_request(first)
    _, spec = body.chat_request(first, [])
    stored, kept = [m.stored() for m in spec.messages], body.kept([])
    history = history_of(stored, kept, said)
    assert [m["content"] for m in history] == ["Terse.", ASK["content"], "Sunny."]
    then = {"model": "tiny", "input": "And tomorrow?", "previous_response_id": "resp_1"}
    body = coserve_request(then)
    _, spec = body.chat_request(then, history)
    again = history_of([m.stored() for m in spec.messages], body.kept(history), said)
    assert [m["content"] for m in again] == ["Terse.", ASK["content"], "Sunny.", "And tomorrow?", "Sunny."]
    old_row = {k: v for k, v in kept.items() if k != "system_input"}
    assert [m["content"] for m in history_of(stored, old_row, said)][:2] == ["French.", "Terse."]


@pytest.mark.parametrize("template", [BUNDLED, "qwen-like"])
def test_a_continued_responses_instructions_come_first_as_vllm_puts_them(tok, templates, template):  # noqa: F811
    # vLLM's construct_input_messages writes the request's instructions first, then the previous response's
    # messages; coserve wrote them after, mid-conversation, where a template that takes a system message only first
    # (Qwen's) refused the continued response
    template = QWEN_LIKE if template == "qwen-like" else templates[template]
    first = {"model": "tiny", "input": [ASK], "instructions": "Be brief."}
    then = {"model": "tiny", "input": "And tomorrow?", "instructions": "Be terse.", "previous_response_id": "resp_1"}
    ids = coserve_continued_prompt(first, "Sunny.", then, template)
    assert ids == vllm_continued_prompt(tok, first, "Sunny.", then, template)


def test_the_instructions_first_are_left_out_of_the_history_and_old_rows_read_as_before():
    # the next response reads the history without the instructions, where they are now (first) and where a
    # response stored before kept them (just before its input)
    from app.responses_schemas import history_of
    from app.tool_calls import Answer

    said = Answer(content="Sunny.", tool_calls=None, finish_reason="stop")
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    then = {"model": "tiny", "input": "Weather?", "instructions": "Be brief.", "previous_response_id": "resp_1"}
    body = coserve_request(then)
    chat, _ = body.chat_request(then, earlier)
    assert [m["content"] for m in chat.messages] == ["Be brief.", "Hi", "Hello", "Weather?"]
    assert [m["content"] for m in history_of(chat.messages, body.kept(earlier), said)] == [
        "Hi", "Hello", "Weather?", "Sunny."]
    old_row = [*earlier, {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    kept = {"instructions": "Be brief.", "input_from": 3}
    assert [m["content"] for m in history_of(old_row, kept, said)] == ["Hi", "Hello", "Weather?", "Sunny."]


@pytest.mark.parametrize("template", [BUNDLED, QWEN_TOOLS])
def test_a_call_output_of_text_parts_is_read_as_vllm_reads_it(tok, templates, template):  # noqa: F811
    # OpenAI's function_call_output takes its output as a string or a list of parts (the openai SDK's
    # ResponseFunctionCallOutputItemList); vLLM's tool message reads the text parts joined by a newline. coserve
    # refused a list: "a function_call_output has call_id and output (strings)"
    parts = [{"type": "input_text", "text": "sunny"}, {"type": "input_text", "text": "24 degrees"}]
    raw = {"model": "tiny", "input": [ASK, ROME, {**ROME_OUT, "output": parts}], "tools": TOOLS}
    body = coserve_request(raw)  # it lists back as it was sent
    _, spec = body.chat_request(raw, [])
    kept = body.kept([])
    own = kept.get("own_input") or [m.stored() for m in spec.messages][kept["input_from"]:]
    assert input_items("job_ab", own)[-1]["output"] == parts
    ids = coserve_prompt(raw, templates[template])
    assert ids == vllm_prompt(tok, raw, templates[template])
    assert "sunny\n24 degrees" in tok.decode(ids)


def test_a_call_output_part_that_is_no_text_is_a_400_naming_it():
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    raw = {"model": "tiny", "input": [ASK, ROME, {**ROME_OUT, "output": [image]}], "tools": TOOLS}
    with pytest.raises(OpenAIError) as exc:
        coserve_request(raw).chat_request(raw, [])
    assert exc.value.status_code == 400 and exc.value.param == "input.2.output.0"


@pytest.mark.parametrize("turn", ["reasoning-call-output", "reasoning-message-calls-outputs"])
def test_a_history_call_dumped_as_json_reads_as_vllms_responses_route_gives_it(tok, turn):  # noqa: F811
    # vLLM's Responses converter builds each call itself (id, function: name then arguments, type), which its chat
    # parser keeps; coserve gave every route the chat route's order (function: arguments then name), so a template
    # dumping the calls wrote another prompt than vLLM's
    from tests.unit.api.test_chat_template_inputs import CALLS_DUMPED

    raw = {"model": "tiny", "input": TURNS[turn], "tools": TOOLS}
    ids = coserve_prompt(raw, CALLS_DUMPED)
    assert ids == vllm_prompt(tok, raw, CALLS_DUMPED)
    assert '"function": {"name": "get_weather", "arguments": {"city": "Rome"}}' in tok.decode(ids)


def test_a_responses_job_reaches_its_worker_with_the_calls_as_vllms_responses_route_gives_them(tok):  # noqa: F811
    # the worker renders a job from its row (fed_prompt): the row's endpoint says whose order the calls come in
    from app.services.truncation import fed_prompt
    from app.tool_calls import template_tools
    from tests.unit.api.test_chat_template_inputs import CALLS_DUMPED

    raw = {"model": "tiny", "input": TURNS["reasoning-call-output"], "tools": TOOLS}
    use_chat_template(MODEL, CALLS_DUMPED)
    _, spec = coserve_request(raw).chat_request(raw, [])
    row = SimpleNamespace(prompt_token_ids=None, prompt=None, messages=[m.stored() for m in spec.messages],
                          tools=template_tools(spec.tools), template_options=spec.template_options(), sampling={},
                          endpoint=ENDPOINT)
    assert fed_prompt(SimpleNamespace(model=MODEL), row, 2048) == vllm_prompt(tok, raw, CALLS_DUMPED)


@pytest.mark.parametrize("template", [BUNDLED, QWEN_TOOLS])
def test_a_developer_input_item_joins_the_instructions_as_vllm_merges_them(tok, templates, template):  # noqa: F811
    # vLLM gives a template that does not know the developer role every system message merged into the first, the
    # instructions' then the developer's (_consolidate_system_messages); SmolLM2's got a system turn after the user's
    raw = {"model": "tiny", "instructions": "Be brief.",
           "input": [ASK, {"role": "developer", "content": "Answer in French."}]}
    ids = coserve_prompt(raw, templates[template])
    assert ids == vllm_prompt(tok, raw, templates[template])
    assert "Be brief.\n\nAnswer in French." in tok.decode(ids)
