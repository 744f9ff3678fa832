"""Anthropic's Messages API (``POST /v1/messages``, as vLLM serves it) in coserve's terms.

A Messages request is a chat request written differently: ``system`` is the first message, a user turn's
``tool_result`` blocks are tool messages, an assistant turn's ``tool_use`` blocks are its tool calls, the tools
carry ``input_schema``, ``stop_sequences`` are chat's ``stop``. ``MessagesRequest.chat_request`` makes that chat
request, so one set of checks runs (an error names the Messages field), and a last assistant turn is a
prefill the answer continues (chat's ``continue_final_message``); coserve's QoS fields and vLLM's sampling
extensions are taken as chat takes them. ``message_body`` writes a chat answer as a Message, and ``stop_of`` its
end in Anthropic's terms.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.openai_schemas import ChatCompletionRequest, OpenAIError, chat_job
from app.responses_schemas import SHARED_FIELDS
from app.schemas import JobCreate
from app.services.model_info import merges_inline_system
from app.settings import DEFAULT_TIERS
from app.tool_calls import (BILLING_HEADER, NAMED_CHOICE, Answer, in_choice_terms, into_system_prompt, is_json,
                            read_answer)
from app.tool_input import tool_input
from app.wire import Text, shown

ENDPOINT = "/v1/messages"
# a chat field named in an error -> the Messages field the client wrote
MESSAGES_PARAM = {"stop": "stop_sequences", "response_format": "output_config.format",
                  "reasoning_effort": "output_config.effort", "thinking_token_budget": "thinking.budget_tokens",
                  "user": "metadata.user_id"}
# a chat tool's field named in an error -> the Messages tool's field (a Messages tool is flat: name, input_schema)
MESSAGES_TOOL_FIELDS = {"name": "name", "description": "description", "parameters": "input_schema"}
TOOL_FIELD = re.compile(r"tools\.(?P<index>\d+)\.function\.(?P<field>" + "|".join(MESSAGES_TOOL_FIELDS)
                        + r")(?P<within>\..+)?")
# Anthropic's words for the tool choices chat's words name (app.tool_calls.CHAT_CHOICE)
CHOICE_FORMS = {"'required'": '{"type": "any"}', "'auto'": '{"type": "auto"}', "'none'": '{"type": "none"}',
                NAMED_CHOICE: '{"type": "tool", "name": ...}'}
# Anthropic's error type of an HTTP status (its SDKs raise by status; the type is what a log shows). coserve's 503
# (no worker for the model, the store or broker away) is Anthropic's overloaded_error in kind: come back shortly
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
# Anthropic's tool_choice types as chat's
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Anthropic's own request fields that change what is generated and that coserve does not serve
UNSERVED = ("mcp_servers", "container", "context_management")
MIN_THINKING_BUDGET = 1024  # Anthropic's least thinking.budget_tokens
# a tool_result with is_error: chat's tool message has no such field (vLLM drops it), so its text says it failed
TOOL_ERROR_PREFIX = "Error: "


def message_id(job_id: str) -> str:
    return "msg_" + job_id.removeprefix("job_")


class Block(BaseModel):
    """A content block of a message: text, a tool call (``tool_use``), a tool's answer (``tool_result``) or thinking."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None


class Message(BaseModel):
    role: Literal["user", "assistant", "system"]  # system: within the conversation (Claude Code's reminders)
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    defer_loading: bool | None = None

    @field_validator("input_schema")
    @classmethod
    def _an_object_where_untyped(cls, schema: dict[str, Any]) -> dict[str, Any]:
        """A schema without a type is an object's, its type added last (vLLM's ``AnthropicTool``)."""
        return schema if "type" in schema else {**schema, "type": "object"}

    def chat_tool(self) -> dict[str, Any]:
        """The tool in chat's form, as vLLM's ``_convert_tools`` writes it: description, strict and defer_loading
        as given (chat's ``ToolSpec`` dumps them for the template)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.input_schema, "strict": self.strict,
                                                 "defer_loading": self.defer_loading}}


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(BaseModel):
    """docs.anthropic.com/en/api/messages: ``metadata.user_id``, a string naming the end user, or null; it is
    chat's ``user``, whose checks (at most 256 characters) it gets."""

    model_config = ConfigDict(extra="ignore")

    user_id: str | None = None


class MessagesRequest(BaseModel):
    """The Messages-only fields; the rest of the body is read as chat reads it (``chat_request``)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    # required, as vLLM's AnthropicMessagesRequest and Anthropic have it (OpenAI's chat may leave it out: the default)
    model: Text = Field(min_length=1, description="the model to answer (GET /v1/models lists them)")
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: Metadata | None = None

    def check(self, raw: dict[str, Any]) -> None:
        for name in UNSERVED:
            if raw.get(name):
                raise OpenAIError(400, f"{name} is not served by coserve; leave it out", param=name,
                                  code="unsupported_value")
        if self.tool_choice is not None and self.tool_choice.type == "tool" and not self.tool_choice.name:
            raise OpenAIError(400, "tool_choice of type 'tool' needs the tool's name", param="tool_choice.name")
        thinking = self.thinking or {}
        if thinking.get("type") not in (None, "enabled", "disabled", "adaptive"):
            raise OpenAIError(400, "thinking.type is 'enabled', 'disabled' or 'adaptive'", param="thinking.type")
        if thinking.get("type") == "enabled":  # docs.anthropic.com/en/api/messages: 1024 <= budget < max_tokens
            budget = thinking.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
                raise OpenAIError(400, f"thinking of type 'enabled' needs budget_tokens, an integer of at least "
                                       f"{MIN_THINKING_BUDGET}", param="thinking.budget_tokens")
            if "max_tokens" in raw and budget >= self.max_tokens:
                raise OpenAIError(400, f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                                       f"({self.max_tokens})", param="thinking.budget_tokens")

    def system_prompt(self) -> str:
        """The system prompt as vLLM's ``_convert_system_message`` writes it: its text blocks joined with nothing
        between them, less Claude Code's billing header (a per-request hash that would defeat the prefix cache)."""
        if not isinstance(self.system, list):
            return self.system or ""
        return _system_text(self.system, "system")

    def system_first(self, model: str) -> bool:
        """Whether this conversation's system messages go into the leading system prompt: it holds some, and
        ``model``'s chat template takes a system message only first (``merges_inline_system``)."""
        return any(m.role == "system" for m in self.messages) and merges_inline_system(model)

    def chat_messages(self, system_first: bool = False) -> list[dict[str, Any]]:
        """The conversation as chat messages, as vLLM's ``_convert_messages`` writes it: the system prompt first,
        each turn's blocks as chat writes them, a system message within the conversation where it is, or, with
        ``system_first``, after the request's ``system`` in the system prompt (``into_system_prompt``; one with no
        text left out)."""
        out = [{"role": "system", "content": system}] if (system := self.system_prompt()) else []
        for i, message in enumerate(self.messages):
            if message.role == "system":
                text = _system_text(message.content, f"messages.{i}.content")
                out += [{"role": "system", "content": text}] if text else []
            elif isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
            elif message.role == "user":
                out += _user_turn(message.content, i)
            else:
                out.append(_assistant_turn(message.content, i))
        return into_system_prompt(out) if system_first else out

    def chat_request(self, raw: dict[str, Any], tiers: tuple[str, ...] = DEFAULT_TIERS, count_only: bool = False,
                     batch_window_s: float | None = None,
                     model: str | None = None) -> tuple[ChatCompletionRequest, JobCreate]:
        """The chat request this one is, and its job; ``tiers``: the configured ones (what ``service_tier``
        names); ``count_only``: for ``count_tokens``, whose body has no ``max_tokens``; ``batch_window_s``: a
        message batch's window (the job is a batch job then); ``model``: the served model (settings.model), whose
        chat template says where system messages within the conversation go (none: where they are)."""
        body: dict[str, Any] = {k: raw[k] for k in SHARED_FIELDS if k in raw}
        if body.get("service_tier") == "standard_only":  # Anthropic's: no priority capacity; the key's own tier
            body["service_tier"] = "default"
        body["messages"] = self.chat_messages(system_first=model is not None and self.system_first(model))
        if body["messages"] and _prefilled(body["messages"][-1]):
            # docs.anthropic.com/en/api/messages: a last assistant turn is a prefill the answer continues
            body["add_generation_prompt"], body["continue_final_message"] = False, True
        if not count_only:
            body["max_tokens"] = self.max_tokens
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.tools is not None:  # [] too, which vLLM's _convert_tools gives the template as []
            body["tools"] = [t.chat_tool() for t in self.tools]
        if (choice := self.tool_choice) is not None:
            body["tool_choice"] = TOOL_CHOICES.get(choice.type) or {"type": "function",
                                                                    "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if (effort := (self.output_config or {}).get("effort")) is not None:  # as vLLM: the template's effort
            body["reasoning_effort"] = effort
        if (self.thinking or {}).get("type") == "disabled":  # as vLLM: the template's reasoning effort "none"
            body["reasoning_effort"] = "none"
        if (self.thinking or {}).get("type") == "enabled" and not count_only:  # as vLLM: its thinking budget
            body["thinking_token_budget"] = self.thinking["budget_tokens"]  # type: ignore[index]
        if (fmt := (self.output_config or {}).get("format")) is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
                raise OpenAIError(400, "output_config.format is {\"type\": \"json_schema\", \"schema\": {...}}",
                                  param="output_config.format")
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt.get("schema")}}
        if self.metadata is not None and self.metadata.user_id is not None:
            body.setdefault("user", self.metadata.user_id)
        return chat_job(body, tiers, in_messages_terms, batch_window_s)


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages request without ``max_tokens``."""

    max_tokens: int = 1


def in_messages_terms(exc: OpenAIError) -> OpenAIError:
    """The error with the chat field it names written as the Messages field, and an over-long request in Anthropic's
    words (``ContextOverflow``: ``prompt is too long: N tokens > M maximum``)."""
    if (overflow := getattr(exc.__cause__, "overflow", None)) is not None:
        return OpenAIError(exc.status_code, overflow.anthropic_message(), param=exc.param, code=exc.code,
                           type=exc.type, headers=exc.headers)
    param = exc.param or ""
    head = param.partition(".")[0]
    message = in_choice_terms(exc.message, CHOICE_FORMS)
    if head in MESSAGES_PARAM:
        # the field's name, not the word in the text ("stop: at most 4 stop sequences")
        message = re.sub(rf"(?<![\w.]){re.escape(head)}(?![\w]| sequence)", MESSAGES_PARAM[head], message)
        param = MESSAGES_PARAM[head]
    elif (tool_field := TOOL_FIELD.fullmatch(param)) is not None:  # chat's tools.0.function.parameters
        named = f"tools.{tool_field['index']}.{MESSAGES_TOOL_FIELDS[tool_field['field']]}{tool_field['within'] or ''}"
        message, param = message.replace(param, named), named
    if message == exc.message and param == (exc.param or ""):
        return exc
    return OpenAIError(exc.status_code, message, param=param or None, code=exc.code, type=exc.type,
                       headers=exc.headers)


def _prefilled(last: dict[str, Any]) -> bool:
    """The conversation ends in the assistant's own words (not a tool call): the answer goes on from them."""
    return last["role"] == "assistant" and not last.get("tool_calls") and bool(last["content"].strip())


def _text(content: str | list[Block] | list[dict[str, Any]], where: str) -> str:
    """The text of a string or of text blocks (a tool's answer), joined by a newline as vLLM joins a tool's."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        kind, text = (block.get("type"), block.get("text")) if isinstance(block, dict) else (block.type, block.text)
        if kind != "text" or not isinstance(text, str):
            raise OpenAIError(400, f"{where}.{j}: only text blocks are supported here (a {shown(kind)} block is not)",
                              param=f"{where}.{j}.type")
        texts.append(text)
    return "\n".join(texts)


def _system_text(content: str | list[Block], where: str) -> str:
    """A system prompt's or message's text as vLLM's ``_extract_system_text`` takes it: a string, or its text blocks
    joined with nothing between them (another block is refused by name), less Claude Code's billing header."""
    if isinstance(content, str):
        return "" if content.startswith(BILLING_HEADER) else content
    _text(content, where)  # only text blocks
    return "".join(b.text for b in content if b.text and not b.text.startswith(BILLING_HEADER))


def _user_turn(blocks: list[Block], i: int) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages (first, answering the calls before; one that failed,
    ``is_error``, starts with ``TOOL_ERROR_PREFIX``), then its text."""
    out, texts = [], []
    for j, block in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if block.type == "tool_result":
            if not block.tool_use_id:
                raise OpenAIError(400, f"{where}: a tool_result needs tool_use_id", param=f"{where}.tool_use_id")
            text = _text(block.content or "", f"{where}.content")
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": TOOL_ERROR_PREFIX + text if block.is_error else text})
        elif block.type == "text" and block.text is not None:
            texts.append(block.text)
        else:
            raise OpenAIError(400, f"{where}: a user turn holds text and tool_result blocks (a {shown(block.type)} "
                                   "block is not supported)", param=f"{where}.type")
    return out + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant_turn(blocks: list[Block], i: int) -> dict[str, Any]:
    """An assistant turn: its text, its tool calls, and its thinking as the message's ``reasoning`` (vLLM's
    ``_convert_block``: its thinking blocks joined with nothing, a redacted one left out), which the chat template
    renders or leaves out."""
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "thinking":
            thoughts += [block.thinking] if block.thinking is not None else []
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise OpenAIError(400, f"{where}: a tool_use needs its id and name", param=f"{where}.id")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input or {})}})
        elif block.type not in ("thinking", "redacted_thinking"):
            raise OpenAIError(400, f"{where}: an assistant turn holds text, tool_use and thinking blocks (a "
                                   f"{shown(block.type)} block is not supported)", param=f"{where}.type")
    return {"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {}),
            **({"reasoning": "".join(thoughts)} if thoughts else {})}


def stop_of(finish_reason: str | None, stop_reason: str | int | None,
            calls: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a chat answer's end (vLLM's ``_to_anthropic_stop_reason``):
    max_tokens wins, then whole tool calls, then the stop string that matched, else the end of the turn. A call cut
    short (its arguments do not parse: vLLM's test of a call a stop string may have cut) must not run, whatever cut
    it: a stop string, a stop token id (a number) or the end-of-sequence token, where vLLM's stream says tool_use."""
    if finish_reason == "length":
        return "max_tokens", None
    if calls and all(is_json(c["function"].get("arguments") or "") for c in calls):  # none cut short, none broken
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return ("tool_use" if finish_reason == "tool_calls" and not calls else "end_turn"), None


def usage_of(prompt_tokens: int | None, completion_tokens: int | None, cached_tokens: int | None,
             cache_write_tokens: int | None = None) -> dict[str, Any]:
    """Anthropic's usage (docs.anthropic.com/en/docs/build-with-claude/prompt-caching: the prompt is input_tokens
    + cache_read_input_tokens + cache_creation_input_tokens), as vLLM writes it: ``input_tokens`` leave out those
    read from the prefix cache and those written to it, each counted apart where the engine said."""
    read, written = cached_tokens or 0, cache_write_tokens or 0
    out: dict[str, Any] = {"input_tokens": max(0, int(prompt_tokens or 0) - read - written),
                           "output_tokens": int(completion_tokens or 0)}
    if cache_write_tokens is not None:
        out["cache_creation_input_tokens"] = int(cache_write_tokens)
    if cached_tokens is not None:
        out["cache_read_input_tokens"] = int(cached_tokens)
    return out


def thinking_signature(job_id: str, index: int) -> str:
    """The signature of the job's thinking block at ``index``: opaque, as vLLM's (a random ``uuid4().hex``, which
    nothing checks when a client sends the block back), but the job's own, so a stored message (a batch's result)
    reads the same each time and a stream's is the plain answer's."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{message_id(job_id)}/{index}").hex


def content_blocks(job_id: str, answer: Answer) -> list[dict[str, Any]]:
    """The answer's thinking (signed, as vLLM signs it), text and tool calls as content blocks, in that order; an
    answer of none of them is one empty text block, as vLLM answers it (clients read ``content[0]``; a stream opens
    no block for it)."""
    blocks: list[dict[str, Any]] = []
    if answer.reasoning:
        blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": thinking_signature(job_id, 0)})
    if answer.content:
        blocks.append({"type": "text", "text": answer.content})
    for call in answer.tool_calls or ():
        blocks.append(tool_use_block(call, call["function"]["arguments"]))
    return blocks or [{"type": "text", "text": ""}]


def tool_use_block(call: dict[str, Any], arguments: str | None) -> dict[str, Any]:
    """A chat tool call as a ``tool_use`` block: its input as the ``anthropic`` SDK reads its stream (``{}`` as the
    block opens; of a call cut short or broken, what came before: ``app.tool_input``)."""
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": tool_input(arguments)}


def message_of(job_id: str, model: str, answer: Answer, stop_reason: str | int | None, prompt_tokens: int | None,
               completion_tokens: int | None, cached_tokens: int | None,
               cache_write_tokens: int | None) -> dict[str, Any]:
    """A finished chat job's answer as a Message: what ``POST /v1/messages`` answers, and a message batch's
    succeeded result (one converter for both)."""
    stop = stop_of(answer.finish_reason, stop_reason, answer.tool_calls)
    usage = usage_of(prompt_tokens, completion_tokens, cached_tokens, cache_write_tokens)
    return message_body(job_id, model, content=content_blocks(job_id, answer), stop=stop, usage=usage)


def stored_message(job: Any) -> dict[str, Any]:
    """A succeeded job's Message from what the job stored (a message batch's output line)."""
    answer = read_answer(job.id, job.sampling, job.output_text or "", job.finish_reason)
    return message_of(job.id, job.model, answer, job.stop_reason, job.prompt_tokens, job.completion_tokens,
                      job.cached_tokens, job.cache_write_tokens)


def message_body(job_id: str, model: str, *, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                 usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": message_id(job_id), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def error_body(status_code: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
