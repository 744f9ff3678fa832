"""OpenAI's Responses API (``POST /v1/responses``) in coserve's terms.

A Responses request is a chat request written differently: its ``input`` (a string, or items: messages,
function calls and their outputs) and ``instructions`` become chat messages, ``max_output_tokens``,
``text.format`` and its flat function tools become chat's fields, and coserve's QoS fields and vLLM's sampling
extensions are taken as chat takes them. ``ResponsesRequest.chat_request`` makes that chat request (so one
set of checks runs), naming the Responses field in any error. ``response_body`` writes a job as a Response.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.context_overflow import LOWER_MAX_TOKENS
from app.openai_schemas import (ChatCompletionRequest, OpenAIError, VllmUnsupported, chat_job, chat_logprobs,
                                parse_window, refuse_qos, service_tier, usage)
from app.schemas import INSTRUCTION_ROLES, JobCreate
from app.settings import DEFAULT_TIERS
from app.tool_calls import NAMED_CHOICE as CHAT_NAMED_CHOICE
from app.tool_calls import Answer, FunctionSpec, in_choice_terms, is_json, read_answer, text_parts
from app.wire import Metadata, Text, as_given, as_utc, shown
from gpu_runtime.logprobs import MAX_TOP_LOGPROBS

# what a Responses request takes as chat does (coserve's QoS, vLLM's sampling extensions, OpenAI's own)
SHARED_FIELDS = ("model", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
                 "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "user", "stream",
                 "safety_identifier",
                 "service_tier", "parallel_tool_calls", "ttft_ms", "tbt_ms", "tbt_anchor", "deadline", "tier",
                 "app_id", "ignore_eos", "chat_template_kwargs", "structured_outputs", "include_reasoning",
                 "prompt_cache_key", "include_stop_str_in_output", "allowed_token_ids", "bad_words",
                 "truncate_prompt_tokens", "cache_salt", "thinking_token_budget", "moderation",
                 *VllmUnsupported.unsupported)  # vLLM's fields coserve refuses, refused here as on chat
# a chat field named in an error -> the Responses field the client wrote
RESPONSES_PARAM = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
                   "structured_outputs": "text.format", "logprobs": "include", "reasoning_effort": "reasoning.effort",
                   "verbosity": "text.verbosity"}
NAMED_CHOICE = '{"type": "function", "name": ...}'  # the Responses API's form of a named tool_choice
# what the stored job keeps of the request, to write it back in the Response and to continue the conversation
LOGPROBS_INCLUDE = "message.output_text.logprobs"
KEPT = ("instructions", "previous_response_id", "metadata", "store", "max_output_tokens", "tools", "tool_choice",
        "text", "background", "truncation", "reasoning", "user", "top_logprobs", "max_tool_calls",
        "safety_identifier", "prompt_cache_key")


# OpenAI's background completion windows: "soonest" (the default) runs as the route's interactive requests do; the
# others are its discounted background execution, here a batch job due that window after it arrives
DISCOUNTED_WINDOWS = ("2h", "8h")
STANDARD_SERVICE_TIERS = (None, "auto", "default")  # OpenAI's standard processing, which those windows require


class BackgroundOptions(BaseModel):
    """OpenAI's ``background_options``: kept as sent and echoed in the Response."""

    model_config = ConfigDict(extra="forbid")

    completion_window: Literal["soonest", "2h", "8h"] | None = None  # (DISCOUNTED_WINDOWS and "soonest")
    # OpenAI's id to prioritize related background requests: kept and echoed; it orders nothing here (its jobs are
    # ordered by tier and deadline, and routed by prompt_cache_key or their opening messages)
    continuation_id: Text | None = None


def response_id(job_id: str) -> str:
    return "resp_" + job_id.removeprefix("job_")


def job_id_of(resp_id: str) -> str | None:
    """The job of a response id, or None when it is not one."""
    return "job_" + resp_id.removeprefix("resp_") if resp_id.startswith("resp_") else None


class ResponsesRequest(BaseModel):
    """The Responses-only fields; the rest of the body is read as chat reads it (``chat_request``)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    input: str | list[dict[str, Any]] | None = None  # none: the conversation or previous response alone is answered
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    previous_response_id: Text | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    metadata: Metadata | None = None
    user: Text | None = None  # (chat reads it too)
    safety_identifier: Text | None = None  # (chat reads it too: the job's end user)
    prompt_cache_key: Text | None = None  # (chat reads and checks it too: it routes the job), echoed as OpenAI does
    store: bool = True
    background: bool | None = None  # answered at once (queued); GET polls it, POST .../cancel stops it
    background_options: BackgroundOptions | None = None  # a completion_window of 2h or 8h: a batch job due then
    stream: bool | None = None  # (chat reads it too)
    include: list[str] | None = None  # "message.output_text.logprobs": each output token's logprob
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token, with the above
    truncation: Literal["auto", "disabled"] | None = None  # auto: the oldest turns go where the context is short
    conversation: Text | dict[str, Any] | None = None  # an id, or {"id": ...}: its items come first, its turn after
    # OpenAI's Responses API: a cap on calls to built-in tools in one response. Only function tools run here, and
    # a response ends at its function calls (the client runs them), so there is nothing to cap: kept and echoed
    max_tool_calls: int | None = Field(None, ge=0)
    # not implemented: accepted only where they ask for nothing (server-side compaction: truncation is the choice)
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None

    def check(self) -> None:
        """Refuses what this server does not implement (a 400 naming the field)."""
        if self.input is None and self.conversation is None and self.previous_response_id is None:
            raise OpenAIError(400, "give input, or a conversation or previous_response_id to continue", param="input")
        if self.background and not self.store:
            raise OpenAIError(400, "a background response is polled, so it must be stored: leave store true",
                              param="store")
        self._check_completion_window()
        refuse_unsupported_include(self.include)
        if isinstance(self.conversation, dict) and not isinstance(self.conversation.get("id"), str):
            raise OpenAIError(400, "conversation must be a conversation id or an object with its id",
                              param="conversation")
        if self.conversation is not None and self.previous_response_id is not None:
            raise OpenAIError(400, "give conversation or previous_response_id, not both", param="conversation")
        if self.tool_choice is None and "tool_choice" in self.model_fields_set:
            # vLLM's ResponsesRequest takes no null (chat's keeps one: text, with the tools in the template)
            raise OpenAIError(400, f'tool_choice is "none", "auto", "required" or {NAMED_CHOICE}, not null: leave it '
                                   'out for "auto"', param="tool_choice")
        for name, ok in (("prompt", self.prompt is None), ("reasoning", not (self.reasoning or {}).get("summary"))):
            if not ok:
                raise OpenAIError(400, f"{as_given(name, getattr(self, name))} is not supported by this server; leave "
                                       f"{name} unset", param=name, code="unsupported_value")
        if self.context_management:  # a long conversation would go on uncompacted, unlike at OpenAI
            raise OpenAIError(400, "context_management (server-side compaction) is not supported by this server: "
                                   'leave it unset or [], and use truncation: "auto" to drop the oldest turns where '
                                   "a conversation outgrows the context", param="context_management",
                              code="unsupported_value")

    @property
    def completion_window(self) -> str | None:
        """``background_options.completion_window`` where it asks for a discounted window, else None."""
        window = (self.background_options or BackgroundOptions()).completion_window
        return window if window in DISCOUNTED_WINDOWS else None

    def _check_completion_window(self) -> None:
        """A discounted window runs in the background and is polled, as OpenAI requires."""
        if (window := self.completion_window) is None:
            return
        if not self.background:
            raise OpenAIError(400, f"background_options.completion_window {window!r} is background execution: set "
                                   "background: true, or leave completion_window unset or 'soonest'",
                              param="background_options.completion_window")
        if self.stream:
            raise OpenAIError(400, f"background_options.completion_window {window!r} is not streamed: leave stream "
                                   "unset and poll GET /v1/responses/{id}, or leave completion_window unset or "
                                   "'soonest'", param="background_options.completion_window")

    def window_s(self, raw: dict[str, Any]) -> float | None:
        """The deadline window of a discounted background response (its job a batch job due that long after it
        arrives), or None (the route's interactive QoS). The window is the job's deadline and standard processing:
        the body's QoS fields and a service_tier of other processing are refused."""
        if (window := self.completion_window) is None:
            return None
        if raw.get("service_tier") not in STANDARD_SERVICE_TIERS:
            raise OpenAIError(400, f"background_options.completion_window {window!r} is standard processing: leave "
                                   f"service_tier {shown(raw['service_tier'])} unset, 'auto' or 'default' (coserve's "
                                   "tier orders batch jobs too)", param="background_options.completion_window")
        refuse_qos(raw, f"responses with background_options.completion_window {window!r}", "that window ends")
        return parse_window(window)

    @property
    def conversation_id(self) -> str | None:
        return self.conversation["id"] if isinstance(self.conversation, dict) else self.conversation

    def kept(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """What the job keeps of the request; ``input_from``: where its input starts among the job's messages
        (after the instructions and the continued conversation); ``instructions_at``: where its instructions are
        (first; a response stored without it has them just before its input)."""
        conversation = {"conversation": {"id": self.conversation_id}} if self.conversation is not None else {}
        own = listed_messages(self.input) if self.input is not None else []
        # the job's messages are what the model reads (an item's text parts joined, an assistant's turn one
        # message): its input as given is kept beside where it reads back otherwise
        read = input_messages(self.input) if self.input is not None else []
        parted = {"own_input": own} if own != read or any(isinstance(m.get("content"), list) for m in own) else {}
        options = ({"background_options": self.background_options.model_dump(exclude_unset=True)}
                   if self.background_options is not None else {})  # as sent, to echo
        return {**{k: v for k in KEPT if (v := getattr(self, k)) is not None}, **conversation, **parted, **options,
                **system_input(read), **({"instructions_at": 0} if self.instructions is not None else {}),
                "input_from": len(history) + (self.instructions is not None)}

    def chat_request(self, raw: dict[str, Any], history: list[dict[str, Any]],
                     tiers: tuple[str, ...] = DEFAULT_TIERS,
                     batch_window_s: float | None = None) -> tuple[ChatCompletionRequest, JobCreate]:
        """The chat request this one is, and its job: the instructions first, then ``history`` (the previous
        response's conversation), then the input, as vLLM's ``construct_input_messages`` orders them (a template
        that takes a system message only first renders it); ``tiers``: the configured ones (what ``service_tier``
        names); ``batch_window_s``: a batch's window, the job's deadline (else the request's own discounted
        ``background_options.completion_window``, ``window_s``)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += history
        messages += input_messages(self.input) if self.input is not None else []
        continued = "conversation" if self.conversation is not None else "previous_response_id"
        _check_call_outputs(messages, len(history) + (self.instructions is not None), continued)
        if raw.get("return_token_ids"):
            raise OpenAIError(400, "return_token_ids is chat's and completions' (vLLM's): a Response carries no token "
                                   "ids; leave it unset", param="return_token_ids", code="unsupported_value")
        if raw.get("prompt_logprobs") is not None:  # chat takes it (vLLM's): asked here, it would go unanswered
            raise OpenAIError(400, "prompt_logprobs is chat's and completions' (vLLM's): a Response carries no "
                                   "prompt logprobs; leave it unset", param="prompt_logprobs", code="unsupported_value")
        if (self.text or {}).get("format") is not None and raw.get("structured_outputs") is not None:
            # vLLM's ResponsesRequest.extract_structured_outputs refuses the pair, a text format too
            raise OpenAIError(400, "give text.format or structured_outputs, not both", param="structured_outputs")
        body: dict[str, Any] = {k: raw[k] for k in SHARED_FIELDS if k in raw}
        body["messages"] = messages
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None and (self.tools or self.tool_choice not in ("auto", "none")):
            # without tools, vLLM's ResponsesRequest makes "auto" (its default) "none": free text, not chat's 400
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        if (fmt := (self.text or {}).get("format")) is not None:
            body["response_format"] = chat_response_format(fmt)
        if (verbosity := (self.text or {}).get("verbosity")) is not None:
            body["verbosity"] = verbosity  # checked as chat's (text.verbosity in the error)
        if (effort := (self.reasoning or {}).get("effort")) is not None:
            body["reasoning_effort"] = effort  # checked as chat's (reasoning.effort in the error)
        if LOGPROBS_INCLUDE in (self.include or ()):
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        window_s = batch_window_s if batch_window_s is not None else self.window_s(raw)
        return chat_job(body, tiers, partial(in_responses_terms, raw=raw), window_s)


class InputTokensRequest(ResponsesRequest):
    """A Responses request to count the input tokens of (``POST /v1/responses/input_tokens``)."""


def in_responses_terms(exc: OpenAIError, raw: Any = None) -> OpenAIError:
    """The error with the chat field it names written as the Responses field; a field the request body ``raw``
    wrote in chat's terms (vLLM's ``structured_outputs``, which Responses takes too) keeps its name."""
    param = exc.param or ""
    new = responses_param(param, written_as_chat(raw))
    # a Responses body has no max_tokens nor max_completion_tokens of its own: a hint naming them names its field
    message = in_choice_terms(exc.message, {CHAT_NAMED_CHOICE: NAMED_CHOICE}).replace(
        LOWER_MAX_TOKENS, "lower " + RESPONSES_PARAM["max_tokens"]).replace(
        "max_completion_tokens", RESPONSES_PARAM["max_tokens"])
    if new == param:
        return exc if message == exc.message else OpenAIError(exc.status_code, message, param=exc.param,
                                                               code=exc.code, type=exc.type, headers=exc.headers)
    return OpenAIError(exc.status_code, message.replace(param, new), param=new, code=exc.code, type=exc.type,
                       headers=exc.headers)


def written_as_chat(raw: Any) -> frozenset[str]:
    """The fields of ``RESPONSES_PARAM`` a Responses body ``raw`` wrote under their chat name (taken as chat's)."""
    return frozenset(k for k in RESPONSES_PARAM if k in SHARED_FIELDS and k in raw) if isinstance(raw, dict) \
        else frozenset()


def responses_param(param: str, as_chat: frozenset[str] = frozenset()) -> str:
    """A chat field's path as the Responses request writes it: a field of its own (``RESPONSES_PARAM``; not one
    in ``as_chat``, written in chat's terms), or a function tool's field, which is the tool's own here (chat's
    ``tools.0.function.name`` is ``tools.0.name``)."""
    head, _, rest = param.partition(".")
    if head in RESPONSES_PARAM and head not in as_chat:
        return RESPONSES_PARAM[head] + ("." + rest if rest and head != "messages" else "")
    tool, _, field = rest.partition(".")
    if head == "tools" and tool.isdigit() and field.partition(".")[0] == "function":
        return ".".join(p for p in ("tools", tool, field.partition(".")[2]) if p)
    return param


def _content_of(content: Any, where: str, field: str = "content") -> str | list[dict[str, str]]:
    """A message item's content (a call output's ``output``: ``field``) as chat's: a string, or its
    input_text/output_text parts as chat's text parts (each kept apart, so that the item reads back as it was given;
    chat joins them for the model, as vLLM does)."""
    if isinstance(content, str):
        return content
    at = f"{where}.{field}"
    if not isinstance(content, list):
        raise OpenAIError(400, f"{at} must be a string or a list of text parts", param=at)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise OpenAIError(400, f"{at}.{j}: only input_text and output_text parts with a text are "
                                   f"supported (not {shown(kind)})", param=f"{at}.{j}")
        texts.append(part["text"])
    return texts[0] if len(texts) == 1 else text_parts(texts)


def _reasoning_of(item: dict[str, Any], where: str) -> str:
    """A reasoning item's thinking as vLLM reads it: its first content part's text, else its first summary's (a
    model's own summary), else nothing; encrypted content it cannot read is refused."""
    if item.get("encrypted_content") is not None:
        raise OpenAIError(400, f"{where}: encrypted reasoning content is not supported by this server; give the "
                               "reasoning as content parts (reasoning_text)", param=f"{where}.encrypted_content",
                          code="unsupported_value")
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == kind
                                                  and isinstance(p.get("text"), str) for p in parts):
            raise OpenAIError(400, f"{where}.{key} must be a list of {kind} parts with a text", param=f"{where}.{key}")
        if parts:
            return parts[0]["text"]
    return ""


def _item_message(item: Any, where: str) -> dict[str, Any]:
    """One input item as a chat message: an assistant's call, reasoning or message with ``content`` None where the
    item gives none (what a later item of the same turn may fill, as vLLM fills it)."""
    if not isinstance(item, dict):
        raise OpenAIError(400, f"{where} must be an object", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in ("user", "system", "developer", "assistant"):
            raise OpenAIError(400, f"{where}.role must be user, system, developer or assistant", param=f"{where}.role")
        return {"role": item["role"], "content": _content_of(item.get("content"), where)}
    if kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise OpenAIError(400, f"{where}: a function_call has call_id, name and arguments (strings)", param=where)
        return {"role": "assistant", "content": None, "tool_calls": [chat_call(item)]}
    if kind == "reasoning":  # a reasoning model's earlier thinking, given back
        return {"role": "assistant", "content": None, "reasoning": _reasoning_of(item, where)}
    if kind == "function_call_output":  # its output a string or text parts, which vLLM's tool message joins
        if not isinstance(item.get("call_id"), str):
            raise OpenAIError(400, f"{where}: a function_call_output has a call_id (a string)", param=where)
        return {"role": "tool", "tool_call_id": item["call_id"], "content": _content_of(item.get("output"), where,
                                                                                          "output")}
    raise OpenAIError(400, f"{where}.type {shown(kind)} is not supported; use message, function_call, "
                           "function_call_output or reasoning", param=f"{where}.type", code="unsupported_value")


def _add_calls(turn: dict[str, Any], m: dict[str, Any]) -> bool:
    turn["tool_calls"] = [*(turn.get("tool_calls") or ()), *m["tool_calls"]]
    return True


def _join_turn(turn: dict[str, Any], m: dict[str, Any]) -> bool:
    """Whether ``m`` joins the assistant ``turn`` before it, as vLLM's ``construct_chat_messages_with_tool_call``
    joins them (``turn`` updated): a call always, reasoning where it has none, text where it has none."""
    if turn["role"] != "assistant" or m["role"] != "assistant":
        return False
    if m.get("tool_calls"):
        return _add_calls(turn, m)
    field = "reasoning" if "reasoning" in m else "content"
    if turn.get(field) is not None:
        return False
    turn[field] = m[field]
    return True


def _join_listed(turn: dict[str, Any], m: dict[str, Any]) -> bool:
    """Whether ``m`` joins ``turn`` in the input items read back (``input_items``): parallel calls are one turn."""
    return (turn["role"] == "assistant" and bool(turn.get("tool_calls")) and not turn["content"]
            and bool(m.get("tool_calls")) and _add_calls(turn, m))


def _turns(messages: list[dict[str, Any]], join: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if not (out and join(out[-1], m)):
            out.append(dict(m))
    return [{**m, "content": m["content"] if m["content"] is not None else ""} for m in out]


def _item_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not items:
        raise OpenAIError(400, "input must not be empty", param="input")
    return [_item_message(item, f"input.{i}") for i, item in enumerate(items)]


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as the chat messages the model reads, as vLLM 0.32 builds them: an assistant's turn (its reasoning,
    message and function calls, in the orders a client sends them back) as one assistant message with its reasoning,
    content and tool calls; a call's output as a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    return _turns([_first_part_read(m) for m in _item_messages(items)], _join_turn)


def _first_part_read(m: dict[str, Any]) -> dict[str, Any]:
    """An assistant message item of several text parts as vLLM's ``construct_chat_messages_with_tool_call`` reads
    it: its first part's text alone (the others' the model does not read); any other message as it is."""
    content = m.get("content")
    if m["role"] != "assistant" or not isinstance(content, list) or not content:
        return m
    return {**m, "content": content[0]["text"]}


def listed_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat messages that read back (``input_items``) as the items given: each message, call and
    output in its order (parallel calls one turn); reasoning items are not listed."""
    if isinstance(items, str):
        return input_messages(items)
    return _turns([m for m in _item_messages(items) if "reasoning" not in m], _join_listed)


def _check_call_outputs(messages: list[dict[str, Any]], own_from: int, continued: str) -> None:
    """Refuses a function_call_output whose call_id no function_call before it has (in the input or the turns it
    continues), as OpenAI does: the model would read an answer to a call it never made. One among the first
    ``own_from`` messages comes from the ``continued`` field's turns (a conversation whose call item was deleted)."""
    made: set[str] = set()
    for i, m in enumerate(messages):
        made.update(call["id"] for call in m.get("tool_calls") or ())
        if m["role"] != "tool" or m.get("tool_call_id") in made:
            continue
        call_id = m.get("tool_call_id")
        if i < own_from:
            raise OpenAIError(400, f"the {continued}'s function_call_output with call_id {call_id!r} follows no "
                                   "function_call (was the call's item deleted?): delete the output's item too",
                              param=continued)
        raise OpenAIError(400, f"no function_call with call_id {call_id!r} comes before its function_call_output: "
                               "give the call in input, or continue the response that made it "
                               "(previous_response_id)", param="input")


def chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool (flat) in chat's form: its function's fields, as vLLM's
    ``convert_tool_responses_to_completions_format`` gives them to ``FunctionDefinition`` (chat's ``ToolSpec``
    dumps them for the template)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise OpenAIError(400, f"tools.{i}: only function tools are supported (not {shown(kind)})", param=f"tools.{i}",
                          code="unsupported_value")
    function = {k: tool[k] for k in FunctionSpec.model_fields if tool.get(k) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """A Responses tool_choice in chat's terms (a forced function is ``{"type": "function", "name": ...}`` here)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        if not isinstance(choice.get("name"), str):
            raise OpenAIError(400, 'tool_choice {"type": "function"} needs the "name" of one of the tools',
                              param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict):
        raise OpenAIError(400, "text.format must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return fmt


def system_input(read: list[dict[str, Any]]) -> dict[str, Any]:
    """What a response keeps of its input's roles (``system_input``): the role each instruction message was sent
    with (system or developer), in order, where one was sent as system (a continuing response drops
    those, ``history_of``); nothing else."""
    roles = [m["role"] for m in read if m["role"] in INSTRUCTION_ROLES]
    return {"system_input": roles} if "system" in roles else {}


def history_of(messages: list[dict[str, Any]], kept: dict[str, Any], answer: Answer) -> list[dict[str, Any]]:
    """A finished response's conversation, for one that continues it, as vLLM's ``construct_input_messages`` reads
    the messages it stored: without its instructions (OpenAI does not carry them over; at ``instructions_at``, or
    just before its input in a response stored without it) nor its input's system messages (vLLM drops every
    system message of the previous turn), its developer messages kept (as developer, as vLLM keeps them); each
    with its text parts (``_as_sent``), then its answer as the assistant's turn. The turns it continued were read
    so already; a response stored without ``system_input`` keeps its system input."""
    at = kept.get("input_from", 0)
    carried = messages[:at]
    if kept.get("instructions") is not None:
        where = kept.get("instructions_at", at - 1)
        carried = carried[:where] + carried[where + 1:]
    messages = [_as_sent(m) for m in carried + _carried_input(messages[at:], kept.get("system_input") or [])]
    turn: dict[str, Any] = {"role": "assistant", "content": answer.content or ""}
    if answer.tool_calls:
        turn["tool_calls"] = [{k: c[k] for k in ("id", "type", "function")} for c in answer.tool_calls]
    return [*messages, turn]


def _carried_input(own: list[dict[str, Any]], sent_roles: list[str]) -> list[dict[str, Any]]:
    """A response's own input messages less those sent as system (``sent_roles``: ``system_input``'s, one for each
    system or developer message in order, a row stored before jobs kept the developer role having read each as
    system; truncation never drops one, so they stay in step)."""
    roles = iter(sent_roles)
    return [m for m in own if m["role"] not in INSTRUCTION_ROLES or next(roles, "developer") != "system"]


def _as_sent(message: dict[str, Any]) -> dict[str, Any]:
    """A job's stored chat message as chat takes it again: its content as the text parts it came as, where it
    kept them (``parts``). vLLM keeps a stored response's input messages as built (a message's parts apart), and a
    template that loops over a message's parts ("openai" content format) reads them so in a later turn too."""
    parts = message.get("parts")
    rest = {k: v for k, v in message.items() if k != "parts"}
    return rest if parts is None else {**rest, "content": text_parts(parts)}


def text_part(role: str, text: str) -> dict[str, Any]:
    """A message item's text part: an assistant's is output text, with the (empty) annotations the SDK's
    ``ResponseOutputText`` requires; the others' are input text."""
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def input_items(job_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as the Responses API's input items (``input_messages`` read back), each with an id."""
    hexid, out = job_id.removeprefix("job_"), []
    for i, m in enumerate(messages):
        if m["role"] == "tool":  # its output as given: a string, or its text parts
            output = ([text_part("user", p["text"]) for p in m["content"]] if isinstance(m["content"], list)
                      else m["content"])
            out.append({"id": f"fco_{hexid}_{i}", "type": "function_call_output", "status": "completed",
                        "call_id": m.get("tool_call_id"), "output": output})
            continue
        if m["content"] or not m.get("tool_calls"):
            texts = [p["text"] for p in m["content"]] if isinstance(m["content"], list) else [m["content"]]
            out.append({"id": f"msg_{hexid}_{i}", "type": "message", "status": "completed", "role": m["role"],
                        "content": [text_part(m["role"], text) for text in texts]})
        for k, call in enumerate(m.get("tool_calls") or ()):
            out.append({"id": f"fc_{hexid}_{i}_{k}", "type": "function_call", "status": "completed",
                        "call_id": call["id"], "name": call["function"]["name"],
                        "arguments": call["function"]["arguments"]})
    return out


def own_input(messages: list[dict[str, Any]], kept: dict[str, Any]) -> list[dict[str, Any]]:
    """A response job's own input as chat messages (not the conversation it continued, nor its instructions): all of
    it, also where ``truncation: "auto"`` left part of it out of the job's ``messages`` (``fit_response``)."""
    return kept["own_input"] if "own_input" in kept else messages[kept.get("input_from", 0):]


def own_input_items(job: Any) -> list[dict[str, Any]]:
    return input_items(job.id, own_input(job.messages or [], job.response or {}))


def stored_answer(job: Any) -> Answer:
    """A finished response job's answer, read from its stored text."""
    return read_answer(job.id, job.sampling, job.output_text or "", job.finish_reason)


def refuse_unsupported_include(include: list[str] | None) -> None:
    """A 400 naming ``include`` for a value this server cannot give: it includes only token logprobs."""
    if unknown := [i for i in include or () if i != LOGPROBS_INCLUDE]:
        raise OpenAIError(400, f"include {shown(unknown[0])} is not supported by this server; it includes only "
                               f"{LOGPROBS_INCLUDE!r}", param="include", code="unsupported_value")


def answer_status(answer: Answer) -> str:
    """A finished response's status and its output items': ``incomplete`` where ``max_output_tokens`` cut it."""
    return "incomplete" if answer.finish_reason == "length" else "completed"


def item_page(items: list[dict[str, Any]], limit: int, order: str, after: str | None, missing: str) -> dict[str, Any]:
    """A page of ``items`` (oldest first) as OpenAI lists them: newest first unless ``order`` is asc, past the item
    ``after`` (a 400 saying ``missing`` where there is none)."""
    if order == "desc":
        items = items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise OpenAIError(400, missing, param="after")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


# ---------------------------------------------------------------- the Response
def token_logprobs(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A job's stored token logprobs as an output_text part's (chat's entries: token, logprob, bytes, top)."""
    return (chat_logprobs(entries) or {}).get("content") or []


def message_item(job_id: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``logprobs``: the job's stored token logprobs (None: not asked for)."""
    return {"id": "msg_" + job_id.removeprefix("job_"), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": token_logprobs(logprobs)}]
            if text or status != "in_progress" else []}


def reasoning_item(job_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A reasoning model's thinking as a Responses reasoning item (its text as a ``reasoning_text`` part)."""
    return {"id": "rs_" + job_id.removeprefix("job_"), "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text or status != "in_progress" else [],
            "encrypted_content": None}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A chat tool call as a Responses function_call item (its id is chat's call id, as is its call_id)."""
    arguments = call["function"]["arguments"]
    return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call",
            "status": call_status(arguments, status), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": arguments}


def call_status(arguments: str, status: str) -> str:
    """A function_call item's ``status``, but ``incomplete`` for a call ended whose arguments do not parse: a stop
    string or stop token id cut it short (the response ended at a stop, completed), as OpenAI marks an item that
    did not finish; not to run."""
    return "incomplete" if status == "completed" and not is_json(arguments) else status


def chat_call(item: dict[str, Any]) -> dict[str, Any]:
    """A function_call item (its call_id, name and arguments) as a chat tool call: ``call_item``'s inverse."""
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def output_items(job_id: str, answer: Answer, logprobs: list[dict[str, Any]] | None = None,
                 status: str = "completed") -> list[dict[str, Any]]:
    """``status``: the items' (``incomplete``: a cancelled response's, cut where it stopped)."""
    shown = answer.content or not answer.tool_calls
    thought = [reasoning_item(job_id, answer.reasoning, status)] if answer.reasoning is not None else []
    items = [message_item(job_id, answer.content or "", status, logprobs)] if shown else []
    return thought + items + [call_item(c, status) for c in answer.tool_calls or ()]


STATUSES = {"queued": "queued", "running": "in_progress", "relegated": "in_progress", "succeeded": "completed",
            "cancelled": "cancelled", "failed": "failed", "expired": "failed"}


def response_body(job: Any, kept: dict[str, Any], tiers: tuple[str, ...], *, status: str | None = None,
                  answer: Answer | None = None, prompt_tokens: int | None = None,
                  completion_tokens: int | None = None, error: dict[str, Any] | None = None,
                  logprobs: list[dict[str, Any]] | None = None, cached_tokens: int | None = None,
                  reasoning_tokens: int | None = None, cache_write_tokens: int | None = None) -> dict[str, Any]:
    """The job as a Response: ``answer`` once it has one (``status`` the job's status, coserve's names; a cancelled
    job's answer is what it produced before the cancel), with its token ``logprobs`` where they were asked for."""
    state = STATUSES.get(status or job.status, "in_progress")
    incomplete = None
    if state == "completed" and answer is not None and answer_status(answer) == "incomplete":
        state, incomplete = "incomplete", {"reason": "max_output_tokens"}
    sampling = job.sampling or {}
    fmt = (kept.get("text") or {}).get("format") or {"type": "text"}
    body = {
        "id": response_id(job.id), "object": "response", "created_at": int(as_utc(job.created_at).timestamp()),
        "status": state, "background": bool(kept.get("background")), "error": error,
        "incomplete_details": incomplete,
        "instructions": kept.get("instructions"), "max_output_tokens": kept.get("max_output_tokens"),
        "model": job.model, "output": [] if answer is None else output_items(
            job.id, answer, logprobs, "completed" if state == "completed" else "incomplete"),
        "parallel_tool_calls": sampling.get("parallel_tool_calls", True),
        "previous_response_id": kept.get("previous_response_id"), "conversation": kept.get("conversation"),
        "reasoning": {"effort": effort, "summary": None} if (effort := (kept.get("reasoning") or {}).get("effort"))
        else None,
        "service_tier": service_tier(job.tier, tiers), "store": kept.get("store", True),
        "temperature": sampling.get("temperature"), "text": {"format": fmt},
        # the choice as asked, else OpenAI's default "auto", tools or not (vLLM echoes "none" where none are given)
        "tool_choice": kept.get("tool_choice", "auto"),
        "tools": kept.get("tools") or [], "top_p": sampling.get("top_p"),
        "truncation": kept.get("truncation") or "disabled",
        "usage": None, "metadata": kept.get("metadata") or {}, "user": kept.get("user"),
        "safety_identifier": kept.get("safety_identifier"), "prompt_cache_key": kept.get("prompt_cache_key"),
        "top_logprobs": kept.get("top_logprobs"), "max_tool_calls": kept.get("max_tool_calls"), "completed_at": None,
        **({"background_options": kept["background_options"]} if "background_options" in kept else {})}
    if state == "completed":  # (a stream's last event is written before the job's end is stored)
        body["completed_at"] = int(as_utc(job.finished_at).timestamp()) if job.finished_at else int(time.time())
    if answer is not None:
        counts = usage(prompt_tokens, completion_tokens)
        body["usage"] = {"input_tokens": counts["prompt_tokens"],
                         "input_tokens_details": {"cached_tokens": cached_tokens or 0,
                                                  "cache_write_tokens": cache_write_tokens or 0},
                         "output_tokens": counts["completion_tokens"],
                         "output_tokens_details": {"reasoning_tokens": reasoning_tokens or 0},
                         "total_tokens": counts["total_tokens"]}
    return body
