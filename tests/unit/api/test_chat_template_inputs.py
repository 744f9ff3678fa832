"""What a chat request's messages and tools reach the chat template as, held to what vLLM 0.32 gives the same
template for the same request: its tool dump (``tool.model_dump()`` of its ``ChatCompletionToolsParam``) and its
own chat-message parser, rendered with the bundled model's tokenizer (no server needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from app.openai_schemas import ChatCompletionRequest
from app.schemas import ChatMessage
from app.services.jobs import encode_spec
from app.services.model_info import get_tokenizer, use_chat_template
from tests.unit.api.test_anthropic_conversation import vllm_rendered

MODEL = "smollm2-135m"
# writes the tools as JSON, as many models' templates do (Qwen's, Llama 3.1's): every key the dump holds counts
TOOLS_AS_JSON = ("{%- if tools %}<tools>{{ tools | tojson }}</tools>{%- endif %}"
                 "{%- for message in messages %}<{{ message.role }}>{{ message.content }}{%- endfor %}"
                 "{%- if add_generation_prompt %}<assistant>{%- endif %}")
ASK = {"role": "user", "content": "Weather?"}


@pytest.fixture(scope="module")
def tok():
    use_chat_template(MODEL, None)
    yield get_tokenizer(MODEL)
    use_chat_template(MODEL, None)


def vllm_prompt(tok: Any, raw: dict[str, Any], template: str) -> list[int]:
    """The token ids vLLM's /v1/chat/completions renders ``raw`` to with ``template`` (a text-only model)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChatRequest
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import _detect_content_format

    request = VllmChatRequest.model_validate(raw)
    tools = None if request.tools is None else [tool.model_dump() for tool in request.tools]  # as its serving
    text_only = SimpleNamespace(multimodal_config=None, is_multimodal_model=False, enable_prompt_embeds=False)
    content_format = _detect_content_format(template, default="string")
    conversation = parse_chat_messages(request.messages, text_only, content_format)[0]
    return vllm_rendered(tok, conversation, tools, template)


def coserve_prompt(raw: dict[str, Any], template: str) -> list[int]:
    """The token ids coserve's job of ``raw`` renders to with ``template`` in use (COSERVE_CHAT_TEMPLATE)."""
    use_chat_template(MODEL, template)
    chat = ChatCompletionRequest.model_validate(raw)
    chat.check()
    return encode_spec(MODEL, chat.job_spec(messages=chat.chat_messages()))


@pytest.mark.parametrize("function, tool", [
    ({"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}, {}),
    ({"name": "weather", "description": "Today's weather", "strict": True}, {}),
    ({"name": "weather", "defer_loading": False, "extra": 1}, {}),
    ({"name": "weather"}, {"defer_loading": True}),  # the tool's own, given to its function (as vLLM's validator)
    ({"name": "github.create_issue"}, {}),  # vLLM takes any name (an MCP server's tools are often named so)
], ids=["no-description", "strict", "function-defer-loading", "tool-defer-loading", "dotted-name"])
def test_the_tools_reach_the_template_as_vllm_dumps_them(tok, function, tool):
    # vLLM's FunctionDefinition keeps description and parameters where null, and strict and defer_loading where
    # given; a template that writes the tools as JSON counts every one of them
    raw = {"model": "tiny", "messages": [ASK], "tools": [{"type": "function", "function": function, **tool}],
           "tool_choice": "none"}
    assert coserve_prompt(raw, TOOLS_AS_JSON) == vllm_prompt(tok, raw, TOOLS_AS_JSON)


# loops over each message's content parts, as multimodal models' templates do (Gemma 3's, Llama 4's): vLLM's
# "openai" content format, each part a {"type": "text", "text": ...}; writes the part count, as such templates' checks
PARTS_LOOP = ("{%- for message in messages %}<{{ message.role }}:{{ message.content | length }}>"
              "{%- if message.content is string %}{{ message.content }}"
              "{%- else %}{%- for part in message['content'] %}[{{ part.text }}]{%- endfor %}{%- endif %}"
              "{%- endfor %}{%- if add_generation_prompt %}<assistant>{%- endif %}")
# reads each message's content as one text (vLLM detects "string"): a list given it is written as Python's repr
STRING_READ = ("{%- for message in messages %}<{{ message.role }}>{{ message.content }}{%- endfor %}"
               "{%- if add_generation_prompt %}<assistant>{%- endif %}")
PARTS_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "input_text", "text": "in Oslo?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Sunny"},
                                                            {"type": "text", "text": "12C"}]},
    {"role": "user", "content": [{"type": "text", "text": "Tomorrow?"}]}]


def test_a_template_that_loops_over_content_parts_gets_them_as_vllm_gives_them(tok):
    # vLLM detects the loop over message['content'] and gives every message's content as its text parts (a string
    # one part, none for no content, a tool's result joined back into a text); coserve joined them, so the template
    # looped over the text's characters
    raw = {"model": "tiny", "messages": PARTS_MESSAGES}
    ids = coserve_prompt(raw, PARTS_LOOP)
    assert ids == vllm_prompt(tok, raw, PARTS_LOOP)
    assert "<user:2>[Weather][in Oslo?]" in tok.decode(ids)


@pytest.mark.parametrize("forced, template", [("string", PARTS_LOOP), ("openai", STRING_READ)],
                         ids=["string-on-a-parts-loop", "openai-on-a-string-read"])
def test_a_forced_content_format_renders_as_vllms_option_forces_it(tok, forced, template):
    # `vllm serve --chat-template-content-format string|openai` gives the template that format whatever its
    # detection picks; coserve always detected it (COSERVE_CHAT_TEMPLATE_CONTENT_FORMAT: auto, the default)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChatRequest
    from vllm.renderers.chat_utils import parse_chat_messages

    raw = {"model": "tiny", "messages": PARTS_MESSAGES}
    detected = coserve_prompt(raw, template)
    use_chat_template(MODEL, template, content_format=forced)
    chat = ChatCompletionRequest.model_validate(raw)
    ids = encode_spec(MODEL, chat.job_spec(messages=chat.chat_messages()))
    text_only = SimpleNamespace(multimodal_config=None, is_multimodal_model=False, enable_prompt_embeds=False)
    conversation = parse_chat_messages(VllmChatRequest.model_validate(raw).messages, text_only, forced)[0]
    assert ids == vllm_rendered(tok, conversation, None, template)
    assert ids != detected  # the format forced is not the one detected
    use_chat_template(MODEL, template)  # auto again: detected
    assert encode_spec(MODEL, chat.job_spec(messages=chat.chat_messages())) == detected


def test_a_template_that_reads_content_as_a_string_gets_the_parts_joined(tok):
    raw = {"model": "tiny", "messages": PARTS_MESSAGES}
    assert coserve_prompt(raw, TOOLS_AS_JSON) == vllm_prompt(tok, raw, TOOLS_AS_JSON)


@pytest.mark.parametrize("template", [
    TOOLS_AS_JSON, PARTS_LOOP,
    # a macro given the content, looping over its parameter (Llama 4's render_content)
    "{%- macro render(c) %}{%- for p in c %}{{ p.text }}{%- endfor %}{%- endmacro %}"
    "{%- for m in messages %}{{ render(m.content) }}{%- endfor %}",
    "{%- macro render(c) %}{%- for p in c %}{{ p.text }}{%- endfor %}{%- endmacro %}"
    "{%- for m in messages %}{{ render(c=m['content'] | list) }}{%- endfor %}",
    # a macro looping over a parameter no call gives the content
    "{%- macro render(c) %}{%- for p in c %}{{ p }}{%- endfor %}{%- endmacro %}"
    "{%- for m in messages %}{{ render(m.role) }}{{ m.content }}{%- endfor %}",
    # the messages under another name, sliced; the content set to a variable named content
    "{%- set rest = messages[1:] %}{%- for m in rest %}{%- for p in m.content %}{{ p.text }}{%- endfor %}"
    "{%- endfor %}",
    "{%- for m in messages %}{%- set content = m.content %}{%- for p in content %}{{ p.text }}{%- endfor %}"
    "{%- endfor %}",
    # a loop over a message's other field; a tuple loop (vLLM: not read, "string"); a template that fails to parse
    "{%- for m in messages %}{%- for c in m.tool_calls %}{{ c.id }}{%- endfor %}{{ m.content }}{%- endfor %}",
    "{%- for i, m in messages | enumerate %}{%- for p in m.content %}{{ p }}{%- endfor %}{%- endfor %}",
    "{%- for m in messages %}{{ m.content }",
    # a {% generation %} block, as transformers' templates for assistant masks write them
    "{%- for m in messages %}{% generation %}{%- for p in m.content %}{{ p.text }}{%- endfor %}"
    "{% endgeneration %}{%- endfor %}",
], ids=["string", "parts-loop", "macro-positional", "macro-keyword", "macro-other", "alias-slice", "content-name",
        "other-field", "tuple-loop", "unparsable", "generation-block"])
def test_the_content_format_is_detected_as_vllm_detects_it(tok, template):
    from vllm.renderers.hf import _detect_content_format

    from app.content_format import content_format

    assert content_format(template) == _detect_content_format(template, default="string")


def test_the_bundled_templates_content_format_is_vllms(tok):
    from vllm.renderers.hf import _detect_content_format

    from app.content_format import content_format

    assert content_format(tok.chat_template) == _detect_content_format(tok.chat_template, default="string")


def test_a_messages_parts_are_its_content_as_coserve_joins_them():
    # a native job's message could give content and parts that disagree: a string-format template read one, a
    # parts-format template the other
    with pytest.raises(ValidationError) as refused:
        ChatMessage(role="user", content="a", parts=["b"])
    assert [e["loc"] for e in refused.value.errors()] == [("parts",)], refused.value.errors()
    assert ChatMessage(role="user", content="a\nb", parts=["a", "b"]).parts == ["a", "b"]
    assert ChatMessage(role="user", content="", parts=[]).parts == []
    assert ChatMessage(role="user", content="a").parts is None  # as a job stored before parts keeps it


# writes each assistant's calls where the message has the key, as Llama 3.1's template does ('tool_calls' in
# message), with their arguments as JSON (a string would be written quoted)
CALLS_WRITTEN = ("{%- for message in messages %}<{{ message.role }}>{{ message.content }}"
                 "{%- if 'tool_calls' in message %}[calls:{%- for c in message.tool_calls %}{{ c.function.name }}"
                 "{{ c.function.arguments | tojson }}{%- endfor %}]{%- endif %}{%- endfor %}")


def _history(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [ASK, {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
            *({"role": "tool", "tool_call_id": c["id"], "content": "Sunny"} for c in calls)]


@pytest.mark.parametrize("arguments", ["", "{not json", "[1, 2]", '"Oslo"', "42"],
                         ids=["empty", "not-json", "array", "string", "number"])
def test_a_history_calls_arguments_that_are_no_object_reach_the_template_as_vllm_gives_them(tok, arguments):
    # vLLM's chat parser gives a template a mapping for every call's arguments: text that is no JSON object (an
    # empty one, as clients send for a call without parameters, too) becomes {}; coserve gave the text itself
    raw = {"model": "tiny", "messages": _history([
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}}])}
    ids = coserve_prompt(raw, CALLS_WRITTEN)
    assert ids == vllm_prompt(tok, raw, CALLS_WRITTEN)
    assert "[calls:weather{}]" in tok.decode(ids)


def test_an_empty_list_of_calls_is_no_calls_to_the_template_as_vllm_gives_it(tok):
    # vLLM drops an assistant's empty tool_calls, so the template takes its plain path; coserve kept the key
    raw = {"model": "tiny", "messages": _history([])}
    ids = coserve_prompt(raw, CALLS_WRITTEN)
    assert ids == vllm_prompt(tok, raw, CALLS_WRITTEN)
    assert "[calls:" not in tok.decode(ids)


# dumps each assistant's calls whole, as templates that write a history call as JSON do: the keys' order counts
CALLS_DUMPED = ("{%- for message in messages %}<{{ message.role }}>{{ message.content }}"
                "{%- if message.tool_calls %}{{ message.tool_calls | tojson }}{%- endif %}{%- endfor %}")


@pytest.mark.parametrize("call", [
    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
    {"function": {"arguments": '{"city": "Oslo"}', "name": "weather"}, "type": "function", "id": "call_1"},
], ids=["openai-order", "reversed"])
def test_a_history_call_dumped_as_json_reads_as_vllms_chat_route_gives_it(tok, call):
    # vLLM's chat request validates a call as OpenAI's ChatCompletionMessageFunctionToolCallParam, whose keys come
    # in its order (id, function: arguments then name, type) whatever order was sent; coserve gave its own (id,
    # type, function: name then arguments), so a template dumping the calls wrote another prompt than vLLM's
    raw = {"model": "tiny", "messages": _history([call])}
    ids = coserve_prompt(raw, CALLS_DUMPED)
    assert ids == vllm_prompt(tok, raw, CALLS_DUMPED)
    assert '[{"id": "call_1", "function": {"arguments": {"city": "Oslo"}, "name": "weather"}, "type": "function"}]' \
        in tok.decode(ids)


@pytest.mark.parametrize("call", [
    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}, "extra": 5},
    {"extra": {"trace": [1, None]}, "id": "call_1", "type": "function",
     "function": {"strict": True, "name": "weather", "arguments": "{}"}},
    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}, "extra": None},
], ids=["on-the-call", "on-both", "null"])
def test_a_history_calls_own_keys_reach_the_template_as_vllms_chat_route_gives_them(tok, call):
    # vLLM's chat request keeps a call's keys OpenAI's type does not name (pydantic keeps a TypedDict's extra keys),
    # after the type's own, and its function's after name; the openai SDK sends a message's dict as given. coserve's
    # ToolCall dropped them, so a template dumping the calls wrote another prompt than vLLM's
    raw = {"model": "tiny", "messages": _history([call])}
    ids = coserve_prompt(raw, CALLS_DUMPED)
    assert ids == vllm_prompt(tok, raw, CALLS_DUMPED)
    assert '"type": "function", "extra": ' in tok.decode(ids)


def test_a_history_calls_own_keys_that_are_no_json_number_are_a_400():
    # Python's JSON reader takes NaN and Infinity, which no stored job (JSON) can hold
    from app.openai_schemas import OpenAIError

    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"},
            "extra": float("nan")}
    chat = ChatCompletionRequest.model_validate({"model": "tiny", "messages": _history([call])})
    with pytest.raises(OpenAIError) as refused:
        chat.chat_messages()
    assert refused.value.status_code == 400 and "finite" in str(refused.value)


# writes each message's role, and whether it has tools of its own (vLLM gives a developer message ``tools``)
ROLE_AND_TOOLS = ("{%- for message in messages %}<{{ message.role }}:{{ message.tools is defined }}>"
                  "{{ message.content }}{%- endfor %}{%- if add_generation_prompt %}<assistant>{%- endif %}")
# the same, with a developer turn of its own (as gpt-oss' and DeepSeek's templates have)
NAMES_DEVELOPER = ("{%- for message in messages %}"
                   "<{{ 'dev' if message.role == 'developer' else message.role }}:{{ message.tools is defined }}>"
                   "{{ message.content }}{%- endfor %}{%- if add_generation_prompt %}<assistant>{%- endif %}")
DEVELOPER_MESSAGES = [{"role": "developer", "content": "Answer in French."}, ASK]


@pytest.mark.parametrize("template, shown", [(NAMES_DEVELOPER, "<dev:True>"), (ROLE_AND_TOOLS, "<system:False>"),
                                             (None, "<|im_start|>system\n")],
                         ids=["names-developer", "role-and-tools", "model-template"])
def test_a_developer_message_reaches_the_template_as_developer_where_it_knows_the_role(tok, template, shown):
    # vLLM's chat parser passes the developer role as is (with its tools, None where it has none): coserve too where
    # the template names the role (gpt-oss', DeepSeek's tell them apart), and gives it as the system message to one
    # that does not (SmolLM2's wrote it as an unknown turn after its own default system prompt)
    raw = {"model": "tiny", "messages": DEVELOPER_MESSAGES}
    ids = coserve_prompt(raw, template)
    assert ids == vllm_prompt(tok, raw, template or tok.chat_template)  # (vllm_rendered: developer_role)
    assert tok.decode(ids).startswith(shown + "Answer in French.")


# SmolLM2's own template (the bundled model's: it writes any role as a turn of that name), mentioning the developer
# role where it does not tell the role apart: in a comment, or in its default system prompt's text
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nDEFAULT_PROMPT<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SMOLLM2_OWN = SMOLLM2.replace("DEFAULT_PROMPT", "You are a helpful AI assistant named SmolLM, trained by Hugging Face")
MENTIONS_DEVELOPER = {
    "comment": "{#- a 'developer' message is written as a turn of its own role, as any #}" + SMOLLM2_OWN,
    "default-prompt": SMOLLM2.replace("DEFAULT_PROMPT", "You are SmolLM, made by the developers at Hugging Face"),
}


def test_the_smollm2_template_here_is_the_bundled_models(tok):
    assert SMOLLM2_OWN == tok.chat_template


@pytest.mark.parametrize("template", list(MENTIONS_DEVELOPER.values()), ids=list(MENTIONS_DEVELOPER))
def test_a_template_that_only_mentions_the_developer_role_is_given_it_as_the_system_message(tok, template):
    # the word developer anywhere in the template's text counted as knowing the role: SmolLM2's template then wrote
    # "<|im_start|>developer" after its own default system prompt, which stood in for the developer's instructions
    developer = tok.decode(coserve_prompt({"model": "tiny", "messages": DEVELOPER_MESSAGES}, template))
    assert developer == tok.decode(coserve_prompt({"model": "tiny", "messages": [
        {"role": "system", "content": "Answer in French."}, ASK]}, template))
    assert developer.startswith("<|im_start|>system\nAnswer in French.<|im_end|>")


@pytest.mark.parametrize("template, role", [
    (NAMES_DEVELOPER, "developer"),
    ("{%- for m in messages %}{%- if m['role'] in ['system', \"developer\"] %}<sys>{%- endif %}{{ m.content }}"
     "{%- endfor %}", "developer"),
    ("{%- set tags = {'developer': '<dev>', 'user': '<u>'} %}{%- for m in messages %}{{ tags[m.role] }}{%- endfor %}",
     "developer"),
    ("{%- for m in messages | selectattr('role', 'equalto', 'developer') %}{{ m.content }}{%- endfor %}",
     "developer"),
    ("{%- if messages[0].role == 'developer' %}{{ messages[0].content }}{%- endif %}", "developer"),  # gpt-oss'
    (MENTIONS_DEVELOPER["comment"], "system"), (MENTIONS_DEVELOPER["default-prompt"], "system"),
    ("{%- for m in messages %}{{ 'developer' }}: {{ m.content }}{%- endfor %}", "system"),  # written, not compared
    (ROLE_AND_TOOLS, "system"), ("{%- for m in messages %}{{ m.content }", "system"), (None, "system"),
], ids=["compared", "in-a-list", "a-key", "selected", "first-compared", "comment", "default-prompt", "written",
        "any-role", "unparsable", "none"])
def test_a_template_knows_the_developer_role_where_it_tells_a_role_by_it(template, role):
    from app.services.model_info import developer_role

    assert developer_role(template) == role


def test_a_developer_messages_own_tools_reach_the_template_as_vllm_gives_them(tok):
    # vLLM's chat parser gives a developer message its own tools (DeepSeek's templates write them); coserve dropped them
    template = ("{%- for message in messages %}<{{ message.role }}>{{ message.content }}"
                "{%- if message.role == 'developer' and message.tools %}{{ message.tools | tojson }}{%- endif %}"
                "{%- endfor %}")
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    raw = {"model": "tiny", "messages": [{"role": "developer", "content": "Use tools.", "tools": tools}, ASK]}
    ids = coserve_prompt(raw, template)
    assert ids == vllm_prompt(tok, raw, template)
    assert '"name": "weather"' in tok.decode(ids)


@pytest.mark.parametrize("messages", [
    [{"role": "developer", "content": "Use tools.", "tools": [{"type": "function", "function": {"name": "weather"}}]},
     ASK],
    [{"role": "system", "content": "Be brief."}, ASK,
     {"role": "developer", "content": "Use tools.", "tools": [{"type": "function", "function": {"name": "weather"}}]}],
], ids=["first", "joined"])
@pytest.mark.parametrize("template", [ROLE_AND_TOOLS, "QWEN_LIKE"], ids=["any-role", "system-first"])
def test_a_developer_message_given_as_system_has_no_tools_as_vllm_gives_it(tok, messages, template):
    # OpenAI's developer message has no tools (ChatCompletionDeveloperMessageParam: content, role, name); vLLM's parser
    # gives a developer message its own for a template that knows the role (DeepSeek's), and where it converts the
    # message to a system one (_convert_developer_to_system) drops them: a system message has none. coserve kept
    # them on the first developer message turned system, and dropped them from one joined to the system prompt
    from vllm.renderers.hf import _convert_developer_to_system

    from app.services.model_info import template_conversation
    from tests.unit.api.test_anthropic_conversation import QWEN_LIKE, vllm_conversation

    template = QWEN_LIKE if template == "QWEN_LIKE" else template
    chat = ChatCompletionRequest.model_validate({"model": "tiny", "messages": messages})
    given = template_conversation([m.stored() for m in chat.chat_messages()], "string", template)
    assert "system" in [m["role"] for m in given] and "developer" not in [m["role"] for m in given]
    assert [m for m in given if "tools" in m] == []
    assert [m for m in _convert_developer_to_system(vllm_conversation(messages)) if "tools" in m] == []


@pytest.mark.parametrize("tools, param", [([{"type": "function"}], "messages.0.tools.0"),
                                          ({"name": "weather"}, "messages.0.tools")], ids=["unnamed", "not-a-list"])
def test_a_developer_messages_malformed_tools_are_a_400(tools, param):
    # vLLM hands them to the template as given (its union of message types takes them); coserve says what to fix
    from app.openai_schemas import OpenAIError

    chat = ChatCompletionRequest.model_validate({"model": "tiny", "messages": [
        {"role": "developer", "content": "Use tools.", "tools": tools}, ASK]})
    with pytest.raises(OpenAIError) as refused:
        chat.chat_messages()
    assert refused.value.status_code == 400 and refused.value.param == param


BILLED = "x-anthropic-billing-header: cc_version=2.1.3; cch=7f3a1;"


@pytest.mark.parametrize("content", [BILLED, BILLED + "\nYou are Claude Code.", "Note: " + BILLED,
                                     [{"type": "text", "text": BILLED}, {"type": "text", "text": "Be brief."}],
                                     [{"type": "text", "text": BILLED + "\n"}, {"type": "text", "text": ""}]],
                         ids=["header-alone", "header-line", "not-first", "header-part", "empty-parts"])
@pytest.mark.parametrize("template", [None, PARTS_LOOP], ids=["model-template", "parts-loop"])
def test_a_system_messages_billing_header_is_left_out_as_vllm_leaves_it_out(tok, content, template):
    # vLLM's chat parser drops Claude Code's billing header line from a system message's text parts; coserve kept it
    raw = {"model": "tiny", "messages": [{"role": "system", "content": content}, ASK]}
    assert coserve_prompt(raw, template) == vllm_prompt(tok, raw, template or tok.chat_template)


@pytest.mark.parametrize("messages, system", [
    ([{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer in French."}, ASK],
     "Be brief.\n\nAnswer in French."),
    ([{"role": "developer", "content": "Answer in French."}, ASK, {"role": "developer", "content": "Use metric."}],
     "Answer in French.\n\nUse metric."),
    ([ASK, {"role": "developer", "content": "Answer in French."}], "Answer in French."),
    ([{"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]},
      ASK, {"role": "developer", "content": "Answer in French."}], "Be brief.\nBe kind.\n\nAnswer in French."),
], ids=["system-then-developer", "developer-twice", "developer-after-user", "system-of-parts"])
def test_a_developer_message_joins_the_system_prompt_of_a_template_that_takes_a_system_message_only_first(
        tok, messages, system):
    # given as a system message where it was not first, it met Qwen's "system message must be first" (a 400); it
    # joins the leading system prompt now, a paragraph each
    from tests.unit.api.test_anthropic_conversation import QWEN_LIKE

    ids = coserve_prompt({"model": "tiny", "messages": messages}, QWEN_LIKE)
    assert ids == vllm_prompt(tok, {"model": "tiny", "messages": messages}, QWEN_LIKE)
    assert tok.decode(ids) == (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
                               "<|im_start|>assistant\n")


# writes each message's role and content: takes a system message anywhere
ANY_ROLE = STRING_READ


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "Be brief."}, ASK, {"role": "developer", "content": "Answer in French."}],
    [ASK, {"role": "developer", "content": "Answer in French."}],
    [{"role": "developer", "content": "Answer in French."}, ASK, {"role": "system", "content": "Be brief."}],
    [{"role": "system", "content": ""}, ASK, {"role": "developer", "content": "Answer in French."}],
    [{"role": "developer", "content": "Answer in French.", "name": "lead"}, ASK],
    [{"role": "system", "content": "Be brief."}, ASK, {"role": "system", "content": "Be kind."}],
], ids=["system-user-developer", "developer-after-user", "developer-user-system", "empty-system", "developer-alone",
        "no-developer"])
@pytest.mark.parametrize("template", [None, ANY_ROLE], ids=["model-template", "any-role"])
def test_a_developer_given_as_system_merges_every_system_message_first_as_vllm_does(tok, messages, template):
    # where vLLM converts a developer message to a system one, it merges every system message into the first, a
    # paragraph each (_consolidate_system_messages), for any template; coserve merged only for a template that takes
    # a system message only first, and only the developer messages: SmolLM2's got a system turn after the user's
    raw = {"model": "tiny", "messages": messages}
    assert coserve_prompt(raw, template) == vllm_prompt(tok, raw, template or tok.chat_template)


def test_merged_system_messages_reach_a_template_that_loops_over_parts_as_one_text_as_vllm_gives_them(tok):
    # vLLM's merge joins each system message's text parts with newlines, and gives the merged message a text
    raw = {"model": "tiny", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]},
        ASK, {"role": "developer", "content": [{"type": "text", "text": "Answer in French."}]}]}
    ids = coserve_prompt(raw, PARTS_LOOP)
    assert ids == vllm_prompt(tok, raw, PARTS_LOOP)
    assert tok.decode(ids).startswith("<system:37>Be brief.\nBe kind.\n\nAnswer in French.<user:")
