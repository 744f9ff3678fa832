"""The prompt a Messages request's conversation becomes, held to what vLLM 0.32 makes of the same request: its own
converter (``AnthropicServingMessages.to_chat_completion_request``, a classmethod that needs no server) and its own
chat-message parser, rendered through the same chat template with the bundled model's tokenizer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from app.anthropic_schemas import MessagesRequest
from app.services.jobs import encode_spec
from app.services.model_info import get_tokenizer, use_chat_template

MODEL = "smollm2-135m"
# the bundled model's own template: renders any role anywhere, and no reasoning
BUNDLED = "bundled"
QWEN = "qwen-like"
# as Qwen3's: a system message only first (else raise_exception), an assistant turn's reasoning_content as <think>
QWEN_LIKE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and not loop.first %}{{ raise_exception('System message must be first') }}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' and message.reasoning_content is string %}"
    "{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{ message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
ASK = {"role": "user", "content": "Weather?"}


@pytest.fixture(scope="module")
def tok():
    use_chat_template(MODEL, None)  # the model's own in use (where another test left one)
    yield get_tokenizer(MODEL)
    use_chat_template(MODEL, None)


@pytest.fixture(scope="module")
def templates(tok) -> dict[str, str]:
    return {BUNDLED: tok.chat_template, QWEN: QWEN_LIKE}


def vllm_conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as vLLM's chat parser gives them to the template (a text-only model, string content)."""
    from vllm.renderers.chat_utils import parse_chat_messages

    text_only = SimpleNamespace(multimodal_config=None, is_multimodal_model=False, enable_prompt_embeds=False)
    return parse_chat_messages(messages, text_only, "string")[0]


def vllm_rendered(tok: Any, conversation: list[dict[str, Any]], tools: list[dict] | None, template: str) -> list[int]:
    """vLLM's HfRenderer: ``conversation`` and ``tools`` rendered through ``template`` to text, then tokenized without
    special tokens added; where it holds a developer message and coserve finds the template does not know the role
    (``developer_role``; vLLM's own check counts the quoted name anywhere), the developer messages converted to
    system ones and every system message merged into the first, as vLLM's ``safe_apply_chat_template`` does
    (``_convert_developer_to_system``: tools dropped; ``_consolidate_system_messages``)."""
    from vllm.renderers.hf import _consolidate_system_messages, _convert_developer_to_system

    from app.services.model_info import developer_role

    if any(m["role"] == "developer" for m in conversation) and developer_role(template) == "system":
        conversation = _consolidate_system_messages(_convert_developer_to_system(conversation))
    text = tok.apply_chat_template(conversation, tools=tools, chat_template=template, add_generation_prompt=True,
                                   tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def vllm_prompt(tok: Any, raw: dict[str, Any], template: str) -> list[int]:
    """The token ids vLLM's /v1/messages renders ``raw`` to with ``template``."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    merge = AnthropicServingMessages._detect_merge_inline_system(template)
    chat = AnthropicServingMessages.to_chat_completion_request(AnthropicMessagesRequest.model_validate(raw),
                                                               merge_inline_system=merge)
    tools = None if chat.tools is None else [tool.model_dump() for tool in chat.tools]  # as its chat serving
    return vllm_rendered(tok, vllm_conversation(chat.messages), tools, template)


def coserve_prompt(raw: dict[str, Any], template: str) -> list[int]:
    """The token ids coserve's job of ``raw`` renders to with ``template`` in use (COSERVE_CHAT_TEMPLATE)."""
    use_chat_template(MODEL, template)
    body = MessagesRequest.model_validate(raw)
    body.check(raw)
    _, spec = body.chat_request(raw, model=MODEL)
    return encode_spec(MODEL, spec)  # as its worker feeds it


@pytest.mark.parametrize("template", [BUNDLED, QWEN])
def test_an_assistant_turns_thinking_reaches_the_template_as_vllm_gives_it(tok, templates, template):
    # vLLM's _convert_block: a thinking block is the assistant message's reasoning (several joined with nothing,
    # a redacted one left out), which its chat parser gives the template as reasoning and reasoning_content
    raw = {"model": "tiny", "max_tokens": 64, "messages": [ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Look it up.", "signature": "s1"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "thinking", "thinking": " Sunny, says the tool.", "signature": "s2"},
        {"type": "text", "text": "Sunny."}]}, {"role": "user", "content": "Tomorrow?"}]}
    ids = coserve_prompt(raw, templates[template])
    assert ids == vllm_prompt(tok, raw, templates[template])
    if template != BUNDLED:  # a template that renders it has it
        assert "<think>\nLook it up. Sunny, says the tool.\n</think>" in tok.decode(ids)


def test_a_chat_assistant_messages_reasoning_reaches_the_template_as_vllms_chat_gives_it():
    # vLLM's _parse_chat_message_content: an assistant message's reasoning, as reasoning and reasoning_content; a
    # user message's is dropped
    from app.openai_schemas import ChatCompletionRequest
    from app.tool_calls import template_messages

    messages = [{"role": "user", "content": "Weather?", "reasoning": "not mine"},
                {"role": "assistant", "content": "Sunny.", "reasoning": "Look it up."},
                {"role": "user", "content": "Tomorrow?"}]
    chat = ChatCompletionRequest.model_validate({"model": "tiny", "messages": messages})
    assert template_messages([m.stored() for m in chat.chat_messages()]) == vllm_conversation(messages)


@pytest.mark.parametrize("tool", [
    {"name": "weather", "description": "", "input_schema": {"type": "object"}},
    {"name": "weather", "input_schema": {"type": "object"}, "strict": True},
    {"name": "weather", "description": "Today's", "input_schema": {"type": "object"}, "defer_loading": False},
    {"name": "weather", "input_schema": {"properties": {"city": {"type": "string"}}}},
], ids=["empty-description", "strict", "defer-loading", "schema-without-type"])
def test_the_tools_reach_the_template_as_vllm_converts_them(tok, tool):
    # vLLM's _convert_tools: description, strict and defer_loading as given, an input_schema without a type an
    # object's (AnthropicTool's validator); a template that writes the tools as
    # JSON counts every one of them
    from tests.unit.api.test_chat_template_inputs import TOOLS_AS_JSON

    raw = {"model": "tiny", "max_tokens": 64, "messages": [ASK], "tools": [tool]}
    assert coserve_prompt(raw, TOOLS_AS_JSON) == vllm_prompt(tok, raw, TOOLS_AS_JSON)


def test_a_history_tool_use_dumped_as_json_reads_as_vllm_gives_it(tok):
    # vLLM's _convert_tool_use_block writes the call as a chat request's, validated as OpenAI's call type (id,
    # function: arguments then name, type); coserve gave its own key order to a template dumping the calls
    from tests.unit.api.test_chat_template_inputs import CALLS_DUMPED

    raw = {"model": "tiny", "max_tokens": 64, "messages": [
        ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "weather",
                                                 "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]}]}
    assert coserve_prompt(raw, CALLS_DUMPED) == vllm_prompt(tok, raw, CALLS_DUMPED)


# writes whether tools were given at all, as templates that test ``tools is not none`` (Mistral's, Hermes')
TOOLS_GIVEN = ("{%- if tools is not none %}<tools:{{ tools | length }}>{%- endif %}"
               "{%- for message in messages %}<{{ message.role }}>{{ message.content }}{%- endfor %}"
               "{%- if add_generation_prompt %}<assistant>{%- endif %}")


def test_an_empty_tools_list_reaches_the_template_as_vllm_gives_it(tok):
    # vLLM's _convert_tools keeps tools: [] (only an absent list is none); coserve dropped it to none
    raw = {"model": "tiny", "max_tokens": 64, "messages": [ASK], "tools": []}
    ids = coserve_prompt(raw, TOOLS_GIVEN)
    assert ids == vllm_prompt(tok, raw, TOOLS_GIVEN)
    assert tok.decode(ids).startswith("<tools:0>")


BILLING = "x-anthropic-billing-header: cc_version=2.1.3.a1b; cc_entrypoint=cli; cch=0f3e2;"


@pytest.mark.parametrize("template", [BUNDLED, QWEN])
def test_system_messages_in_the_conversation_are_taken_where_vllm_takes_them(tok, templates, template):
    # Claude Code's per-turn reminders: vLLM keeps each in place where the template takes a system message anywhere,
    # and merges them into the leading system prompt where it does not (_detect_merge_inline_system), the billing
    # header dropped either way
    reminder = {"role": "system", "content": [{"type": "text", "text": BILLING},
                                              {"type": "text", "text": "Reminder: be brief. "},
                                              {"type": "text", "text": "Cite sources."}]}
    raw = {"model": "tiny", "max_tokens": 64, "system": "You are terse. ", "messages": [
        ASK, {"role": "assistant", "content": "Sunny."}, reminder, {"role": "system", "content": "Use metric."},
        {"role": "user", "content": "Tomorrow?"}]}
    ids = coserve_prompt(raw, templates[template])
    assert ids == vllm_prompt(tok, raw, templates[template])
    rendered = tok.decode(ids)
    assert "Reminder: be brief. Cite sources." in rendered and "billing" not in rendered
    if template == BUNDLED:  # in place, as sent
        assert rendered.index("Sunny.") < rendered.index("Reminder") < rendered.index("Tomorrow?")
    else:
        assert rendered.startswith("<|im_start|>system\nYou are terse. Reminder: be brief. Cite sources.Use metric.")


def test_a_system_message_without_text_is_left_out_and_one_of_other_blocks_is_a_400_naming_it():
    only_header = {"role": "system", "content": [{"type": "text", "text": BILLING}]}
    body = MessagesRequest.model_validate({"model": "tiny", "max_tokens": 8, "messages": [ASK, only_header]})
    assert [m["role"] for m in body.chat_messages()] == ["user"]
    from app.openai_schemas import OpenAIError

    image = {"role": "system", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]}
    body = MessagesRequest.model_validate({"model": "tiny", "max_tokens": 8, "messages": [ASK, image]})
    with pytest.raises(OpenAIError) as exc:
        body.chat_messages()
    assert exc.value.status_code == 400 and exc.value.param == "messages.1.content.0.type"
