"""What a chat request's messages and tools reach the chat template as, held to what vLLM 0.32 gives the same
template for the same request: its tool dump (``tool.model_dump()`` of its ``ChatCompletionToolsParam``) and its
own chat-message parser, rendered with the bundled model's tokenizer (no server needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from app.openai_schemas import ChatCompletionRequest
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
], ids=["no-description", "strict", "function-defer-loading", "tool-defer-loading"])
def test_the_tools_reach_the_template_as_vllm_dumps_them(tok, function, tool):
    # vLLM's FunctionDefinition keeps description and parameters where null, and strict and defer_loading where
    # given; a template that writes the tools as JSON counts every one of them
    raw = {"model": "tiny", "messages": [ASK], "tools": [{"type": "function", "function": function, **tool}],
           "tool_choice": "none"}
    assert coserve_prompt(raw, TOOLS_AS_JSON) == vllm_prompt(tok, raw, TOOLS_AS_JSON)
