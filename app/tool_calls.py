"""Tool (function) calling: the tools a chat job offers, how a forced choice constrains its text, and the
calls read back out of that text.

A job whose ``tool_choice`` names a function, or is ``"required"``, generates under a JSON schema (vLLM's
structured outputs), so its text always parses: a named function's arguments object, or a list of
``{"name", "parameters"}`` calls to any of the tools. This needs no parser for the model's own tool-call
syntax, which is why it works with every model (vLLM serves the forced choices the same way). ``"auto"``,
where the model decides and writes calls in its own syntax, is read with that syntax's reader
(``app.tool_syntax``), which the server's settings name.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from app.reasoning import ReasoningStream, split_reasoning
from app.tool_call_scan import CallScanner, begun_calls, raw_arguments
from app.tool_syntax import SYNTAXES, RawCall, Syntax, read_call
from app.wire import FieldProblem, Text, holds_non_finite, shown, strict_json

MAX_TOOLS = 128
ALPHANUMERIC = string.ascii_letters + string.digits
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function declared without parameters takes none
DEFINITION_KEYS = ("$defs", "definitions")  # where a schema keeps the definitions its $refs name (from its root)
NAMED_CHOICE = '{"type": "function", "function": {"name": ...}}'  # chat's form of a named tool_choice
REQUIRED_CHOICE = "tool_choice 'required'"  # chat's words for a choice of any tool (another API's words differ)
# chat's name of a choice where an error names it: 'required', 'auto' or 'none' after tool_choice, or the named form
CHAT_CHOICE = re.compile(r"(?<=tool_choice )'\w+'|(?<=tool_choice: )'\w+'|" + re.escape(NAMED_CHOICE))
# the routes whose vLLM counterpart builds a history call itself (its Responses converter: id, function: name then
# arguments, type, and no key of the client's), not validated as OpenAI's chat type as chat's and Messages' are
BUILT_CALL_ENDPOINTS = ("/v1/responses",)
CALL_KEYS, FUNCTION_KEYS = ("id", "function", "type"), ("arguments", "name")  # OpenAI's chat type's, in its order


def forced_choice_unsupported(auto: bool) -> str:
    """Why a forced tool_choice is refused, and the choices left (``auto``: the server reads calls in the model's
    own syntax, COSERVE_TOOL_CALL_PARSER). Each choice follows "tool_choice ", where ``in_choice_terms`` finds it."""
    return (f"a forced tool choice (tool_choice 'required' or {NAMED_CHOICE}) is generated under vLLM's structured "
            "outputs: it needs the vLLM backend (COSERVE_BACKEND=vllm); send tool_choice 'none'" + (
                " or tool_choice 'auto'" if auto else " (this server has no parser for the calls of tool_choice "
                "'auto' either: COSERVE_TOOL_CALL_PARSER)"))


# why "auto" is refused where the server has no parser for the model's own calls, and the choices left (each after
# "tool_choice ", where ``in_choice_terms`` finds it)
AUTO_UNPARSED = ("tool_choice 'auto' (the default where tools are given) lets the model call tools in its own "
                 "syntax, and this server has no parser for it (COSERVE_TOOL_CALL_PARSER); send tool_choice "
                 f"'required', tool_choice {NAMED_CHOICE} or tool_choice 'none'")


def in_choice_terms(message: str, forms: dict[str, str]) -> str:
    """``message`` with the tool choices it names in chat's words (``CHAT_CHOICE``) written as another API writes
    them (``forms``: chat's word -> that API's; one not in it is kept)."""
    return CHAT_CHOICE.sub(lambda word: forms.get(word[0], word[0]), message)


def needs_tools(choice: str | dict[str, Any]) -> str:
    """Why ``choice`` (a kept choice) is refused where no tools are given, naming it in chat's words."""
    named = isinstance(choice, dict)
    return (f"{NAMED_CHOICE if named else repr(choice)} needs tools: give the tools to call, or leave tool_choice "
            "out" + (f" (it names {shown(choice['function']['name'])})" if named else ""))


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # any name, as vLLM's FunctionDefinition takes it (an MCP server's tools are often named server.tool), not
    # OpenAI's letters, digits, _ and - only
    name: Text = Field(min_length=1, description="the function's name")
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    # kept for the chat template, which vLLM gives them to where set
    strict: bool | None = None
    defer_loading: bool | None = None

    def template_dict(self) -> dict[str, Any]:
        """The function as vLLM's ``FunctionDefinition`` dumps it for the chat template: description and
        parameters even where null, strict and defer_loading only where set."""
        return self.model_dump(exclude={k for k in ("strict", "defer_loading") if getattr(self, k) is None})


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionSpec
    defer_loading: bool | None = None

    @model_validator(mode="after")
    def _function_defers_loading(self) -> ToolSpec:
        """The tool's defer_loading is its function's where that sets none (vLLM's ``ChatCompletionToolsParam``)."""
        if self.defer_loading is not None and self.function.defer_loading is None:
            self.function.defer_loading = self.defer_loading
        return self

    def template_dict(self) -> dict[str, Any]:
        """The tool as vLLM's chat serving gives it to the chat template (``tool.model_dump()``): the request's
        fields kept, nulls included, and no others."""
        tool = {"type": self.type, "function": self.function.template_dict()}
        return tool if self.defer_loading is None else {**tool, "defer_loading": self.defer_loading}


def template_tools(tools: list[ToolSpec] | None) -> list[dict[str, Any]] | None:
    """A job's tools as the chat template gets them (None: none offered)."""
    return None if tools is None else [tool.template_dict() for tool in tools]


class FunctionName(BaseModel):
    name: Text = Field(min_length=1)  # vLLM refuses an empty name in a named tool_choice


class NamedToolChoice(BaseModel):
    """Call this function (OpenAI's ``{"type": "function", "function": {"name": ...}}``)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionName


CHOICES = f'tool_choice must be "none", "auto", "required" or {NAMED_CHOICE}'


def _choice(value: Any) -> Any:
    """One error naming tool_choice, instead of one per member of the union."""
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ValueError(f"{CHOICES}, not {value!r}")
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError as exc:
            raise ValueError(f"{CHOICES}: {exc.errors()[0]['msg']}") from None
    return value


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice, BeforeValidator(_choice)]


class OwnKeys(BaseModel):
    """A history call's part that keeps the keys a client adds to it, as vLLM's chat route does (OpenAI's types are
    TypedDicts, which pydantic validates keeping extra keys, and the openai SDK sends a message's dict as given): a
    chat template that dumps the calls writes them."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _json_values(self) -> OwnKeys:
        if holds_non_finite(self.model_extra):  # Python's JSON reader takes them; no JSON column holds them
            raise ValueError("a call's own keys hold JSON values: finite numbers only, no NaN or Infinity")
        return self


class FunctionCall(OwnKeys):
    name: Text
    arguments: Text = Field(description="the arguments object as JSON text")


class ToolCall(OwnKeys):
    """A call an assistant message made (sent back in a conversation's history)."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


def kept_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    """What a job keeps of its choice: ``"auto"``, ``"required"``, the named choice as OpenAI writes it, or None
    where the text is free (no choice, or ``"none"``)."""
    if choice is None or choice == "none":
        return None
    return choice if isinstance(choice, str) else choice.model_dump()


def is_forced(choice: str | dict[str, Any] | None) -> bool:
    """Whether the text is generated as the calls' JSON (``"required"`` or a named function)."""
    return choice == "required" or isinstance(choice, dict)


def forced_schema(tools: list[ToolSpec], choice: str | dict[str, Any], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema the text of a forced ``choice`` is generated under: the named function's parameters, or
    for ``"required"`` a list of one call or more (one at most unless ``parallel``), each naming a tool and giving
    its parameters."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        function = next(t.function for t in tools if t.function.name == name)
        return function.parameters or EMPTY_PARAMETERS
    schema: dict[str, Any] = {"type": "array", "minItems": 1}
    calls, defined_by = [], {}  # the tool whose definition each (key, name) at the root is
    for i, tool in enumerate(tools):
        # a $ref resolves from the root: each tool's definitions move up there, where every tool's refs find them
        parameters = dict(tool.function.parameters or EMPTY_PARAMETERS)
        for key in DEFINITION_KEYS:
            for name, definition in (parameters.pop(key, None) or {}).items():
                if schema.setdefault(key, {}).setdefault(name, definition) != definition:
                    raise FieldProblem(f"tools.{i}.function.parameters", (
                        f"tools.{defined_by[key, name]} defines {key}/{name} differently; with {REQUIRED_CHOICE} "
                        "the tools' definitions share one schema: give them different names"))
                defined_by.setdefault((key, name), i)
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                                        "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema["items"] = {"anyOf": calls}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def call_id(job_id: str, index: int, parser: str | None = None) -> str:
    """A call's id, the same whenever the job's answer is read (a stream, the plain answer, a batch line).
    Mistral's chat templates take only 9 letters and digits (as vLLM writes them for its mistral parser)."""
    if parser == "mistral":
        digest = int.from_bytes(hashlib.sha256(f"{job_id}/{index}".encode()).digest()[:8], "big")
        return "".join(ALPHANUMERIC[(digest // 62**i) % 62] for i in range(9))
    return f"call_{job_id.removeprefix('job_')}_{index}"


def _forced_calls(choice: str | dict[str, Any], text: str) -> tuple[list[RawCall] | None, bool]:
    """The calls of a forced choice's text, and whether a ``"required"`` list was cut short inside its JSON (it does
    not parse); a named function's text is its arguments, as generated, not read here."""
    if isinstance(choice, dict):  # the text is the named function's arguments (as generated, even if cut short)
        return ([(choice["function"]["name"], text)] if text.strip() else None), False
    try:
        parsed = strict_json(text)
    except ValueError:  # cut by max_tokens or a stop string: the calls begun, as far as they came (as streamed)
        return begun_calls(text, 2)[0] or None, True
    if not isinstance(parsed, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in parsed):
        return None, False
    written = raw_arguments(text, 2)  # the arguments as generated, as a stream sent them
    return [read_call({"name": c["name"], "parameters": c.get("parameters", {})},
                      written[i] if i < len(written) else None) for i, c in enumerate(parsed)], False


def _cut_calls(syntax: Syntax, text: str) -> tuple[str | None, list[RawCall] | None]:
    """The content and the calls of an ``"auto"`` text whose calls the syntax's reader of a whole text does not take
    (cut short by max_tokens or a stop string, or a call's JSON broken: vLLM's reader answers such a text as content,
    though its stream sent the calls): as ``AnswerStream`` streamed them, the content before the calls and each call
    begun, block by block (``call_bodies``); the text as content where no call was named yet (nor streamed)."""
    calls = [call for body, closed in call_bodies(syntax, text)
             for call in (syntax.block_calls(body) if closed else begun_calls(body, syntax.call_depth)[0])]
    if not calls:
        return text, None
    content = text[:syntax.content_so_far(text)]
    return (content if content.strip() else None), calls


def call_bodies(syntax: Syntax, text: str) -> list[tuple[str, bool]]:
    """The bodies the calls of a text lie in (each block of a tagged syntax; all after where the calls begin of
    another), each with whether its end tag closed it (the body less a tail that may become that tag if not)."""
    bodies, at = [], 0
    while (body := syntax.call_body(text, at)) is not None:
        end, after = syntax.body_end(text, body, body)
        bodies.append((text[body:end], after is not None))
        if after is None:
            return bodies
        at = after
    return bodies


@dataclass(frozen=True)
class Answer:
    """A chat job's answer in OpenAI's terms: its content, its tool calls and why it ended; a reasoning model's
    thinking (``reasoning``, where the job reads it: ``app.reasoning``)."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str
    reasoning: str | None = None


def read_answer(job_id: str, sampling: dict[str, Any] | None, text: str, engine_reason: str | None) -> Answer:
    """The answer in a chat job's text. A forced choice's text is the calls (no content): a named function's
    arguments as generated (cut short by max_tokens too, as vLLM answers), the list of ``"required"`` (where
    max_tokens cut it: the calls it began, as they were streamed; a text that is no list is the content);
    ``"auto"`` reads the model's own syntax (the job's ``tool_parser``), with the content before the calls (where
    max_tokens cut a call: the calls begun, as they were streamed).
    Calls end in ``tool_calls`` except a named one, which ends in ``stop``, as OpenAI answers them, and calls that
    max_tokens cut, which end in ``length`` (an answer cut short, its calls perhaps incomplete). A reasoning
    model's thinking comes first, out of the content (the job's ``reasoning_parser``); its calls are read from the
    rest."""
    sampling = sampling or {}
    if parser := sampling.get("reasoning_parser"):
        reasoning, content = split_reasoning(parser, text)
        answer = read_answer(job_id, {**sampling, "reasoning_parser": None}, content or "", engine_reason)
        kept = answer.content if content is not None or answer.tool_calls else None  # never stopped thinking
        shown = reasoning if sampling.get("include_reasoning", True) else None  # vLLM's include_reasoning
        return replace(answer, content=kept, reasoning=shown)
    choice, reason = sampling.get("tool_choice"), engine_reason or "stop"
    if choice is None:
        return Answer(text, None, reason)
    if choice == "auto":
        syntax = SYNTAXES[sampling.get("tool_parser") or "hermes"]
        content, raw = syntax.split(text)
        # perhaps cut inside a call, or a call's JSON broken, which the stream has sent as it came
        cut = raw is None or not all(is_json(arguments) for _, arguments in raw)
        if raw is None:
            content, raw = _cut_calls(syntax, text)
    else:
        raw, cut = _forced_calls(choice, text)  # (a named call's cut does not matter: it never ends in tool_calls)
        content = None if raw is not None else text
    if raw is None:
        return Answer(text, None, reason)
    if sampling.get("parallel_tool_calls") is False:
        raw = raw[:1]  # one call at most, as asked ("required" generates only one; "auto" may write more)
    calls = [{"id": call_id(job_id, i, sampling.get("tool_parser")), "type": "function",
              "function": {"name": name, "arguments": arguments}}
             for i, (name, arguments) in enumerate(raw)]
    # a call cut by max_tokens ends in length, streamed or not, as OpenAI's truncated answers do: it tells the client
    # that the answer was cut (vLLM answers tool_calls unstreamed, length streamed); one a stop string cut ends in
    # stop, never in tool_calls, which tells a client to run calls whose arguments would not parse
    ends_in_calls = choice in ("auto", "required") and reason == "stop" and not cut
    return Answer(content, calls, "tool_calls" if ends_in_calls else reason)


def is_json(text: str) -> bool:
    """Whether ``text`` parses as JSON (strictly: ``strict_json``): a call's arguments that do not were cut short (by
    max_tokens, a stop string, a stop token id) or broken, and the call must not run."""
    try:
        strict_json(text)
    except (ValueError, RecursionError):
        return False
    return True


@dataclass
class CallBody:
    """A body of calls in a text being streamed (a block of a tagged syntax, or all the calls of another)."""

    start: int  # where it begins in the text
    first: int  # the answer's index of its first call
    scanner: CallScanner  # its calls read so far
    after: int | None = None  # past its end tag, once closed
    answered: int = 0  # the calls the answer reads of it, once closed


class AnswerStream:
    """What a chat job's stream may show while its text comes: all of a free text as content; of ``"auto"`` the
    content that surely comes before the model's first call; and each call as it comes, as vLLM streams them: a
    first delta that names the call (its id, its name, the arguments so far), then deltas that add to its
    arguments. A delta carries its call's ``index``."""

    def __init__(self, job_id: str, sampling: dict[str, Any] | None) -> None:
        self.job_id, self.sampling = job_id, sampling or {}
        parser = self.sampling.get("reasoning_parser")
        self.thinking = ReasoningStream(parser) if parser else None  # the thinking, read off before the rest
        self.shows_thinking = self.sampling.get("include_reasoning", True)
        self.whole: list[str] = []  # every piece, thinking included: the whole answer is read from it at the end
        self.choice = self.sampling.get("tool_choice")
        self.syntax = SYNTAXES[self.sampling.get("tool_parser") or "hermes"] if self.choice == "auto" else None
        self.most = 1 if self.sampling.get("parallel_tool_calls") is False else None  # calls sent at most
        self.text = ""  # the answer's text so far, where calls are read from it (free text: only in ``whole``)
        self.shown = 0  # characters of it sent as content (a named call: as its arguments)
        self.bodies: list[CallBody] = []  # "required" and "auto": where the calls lie, and those read so far
        self.sent: dict[int, int] = {}  # characters of each call's arguments sent, by its index (opened calls)

    def feed(self, delta: str) -> tuple[str, str, list[dict[str, Any]] | None]:
        """The reasoning, the content and the tool-call deltas to send now, given the text's next ``delta``."""
        self.whole.append(delta)
        reasoning = ""
        if self.thinking is not None:
            reasoning, delta = self.thinking.feed(delta)
            reasoning = reasoning if self.shows_thinking else ""
        return (reasoning, *self._content(delta)) if delta else (reasoning, "", None)

    def _content(self, delta: str) -> tuple[str, list[dict[str, Any]] | None]:
        """The content and the tool-call deltas of the answer's (not thinking) text's next ``delta``."""
        if self.choice is None:
            return delta, None
        self.text += delta
        if isinstance(self.choice, dict):
            return "", self._named_call_delta()
        content = ""
        if self.syntax is not None:
            # the text up to what was shown is content: look for a call from there on (less a tag's length)
            safe = self.syntax.content_so_far(self.text, self.shown)
            content = self.text[self.shown:safe] if safe > self.shown else ""
            self.shown += len(content)
        self._scan()
        return content, self._call_deltas()

    def _scan(self) -> None:
        """Feeds the text's new characters to the scanner of the body they lie in, a new one for each block begun."""
        while True:
            body = self.bodies[-1] if self.bodies else None
            if body is None or body.after is not None:
                body = self._next_body(body)
                if body is None:
                    return
            fed = body.start + len(body.scanner.text)
            end, body.after = (len(self.text), None) if self.syntax is None else self.syntax.body_end(
                self.text, body.start, fed)
            body.scanner.feed(self.text[fed:end])
            if body.after is None:
                return
            body.answered = len(self.syntax.block_calls(body.scanner.text))  # the calls the answer reads of it

    def _next_body(self, last: CallBody | None) -> CallBody | None:
        """The next body of calls, once the text shows it ("required": the whole text, a list of calls)."""
        if self.syntax is None:
            start = None if last else 0
        else:
            start = self.syntax.call_body(self.text, last.after if last and last.after is not None else 0)
        if start is None:
            return None
        first = last.first + last.answered if last else 0
        self.bodies.append(CallBody(start, first, CallScanner(2 if self.syntax is None else self.syntax.call_depth)))
        return self.bodies[-1]

    def _call_deltas(self) -> list[dict[str, Any]] | None:
        out = []
        for body in self.bodies:
            for j, call in enumerate(body.scanner.calls):
                k = body.first + j  # its index in the answer: the calls of the blocks before it come first
                arguments = call.arguments(body.scanner.text)
                if call.name is None or arguments is None or (self.most is not None and k >= self.most):
                    continue  # not yet named, arguments that are sent whole at the end, or a call past the most
                if k not in self.sent:
                    out.append({"index": k, "id": call_id(self.job_id, k, self.sampling.get("tool_parser")),
                                "type": "function", "function": {"name": call.name, "arguments": arguments}})
                elif len(arguments) > self.sent[k]:
                    out.append({"index": k, "function": {"arguments": arguments[self.sent[k]:]}})
                self.sent[k] = len(arguments)
        return out or None

    def _named_call_delta(self) -> list[dict[str, Any]] | None:
        if not self.shown and not self.text.strip():
            return None  # blank so far: perhaps no call at all (read_answer's rule)
        opened, arguments, self.shown = self.shown > 0, self.text[self.shown:], len(self.text)
        if opened:
            return [{"index": 0, "function": {"arguments": arguments}}] if arguments else None
        name = self.choice["function"]["name"]
        return [{"index": 0, "id": call_id(self.job_id, 0, self.sampling.get("tool_parser")), "type": "function",
                 "function": {"name": name, "arguments": arguments}}]

    def end(self, engine_reason: str | None) -> tuple[str, str, list[dict[str, Any]] | None, Answer]:
        """The reasoning, the content and the tool-call deltas still to send, and the whole answer, once the text
        is whole."""
        reasoning, held = self.thinking.end() if self.thinking is not None else ("", "")
        reasoning = reasoning if self.shows_thinking else ""
        content, calls = self._content(held) if held else ("", None)
        rest, more, answer = self._rest(engine_reason)
        return reasoning, content + rest, (calls or []) + (more or []) or None, answer

    def _rest(self, engine_reason: str | None) -> tuple[str, list[dict[str, Any]] | None, Answer]:
        answer = read_answer(self.job_id, self.sampling, "".join(self.whole), engine_reason)
        if self.choice is None or (isinstance(self.choice, dict) and self.shown):
            return "", None, answer  # all shown already (a named call went out as it came)
        rest = []
        for k, call in enumerate(answer.tool_calls or ()):
            if k not in self.sent:  # not streamed (arguments not an object): whole
                rest.append({"index": k, **call})
            elif len(arguments := call["function"]["arguments"]) > self.sent[k]:
                rest.append({"index": k, "function": {"arguments": arguments[self.sent[k]:]}})
        return (answer.content or "")[self.shown:], rest or None, answer


# the first line of a system text Claude Code sends, naming its version and a hash of the request; vLLM drops it
BILLING_HEADER = "x-anthropic-billing-header"


def template_messages(messages: list[dict[str, Any]], content_format: str = "string",
                      developer_as: str = "developer", endpoint: str | None = None) -> list[dict[str, Any]]:
    """Messages as chat templates read them: a call as vLLM's route ``endpoint`` (the job's; None: chat) gives it,
    its arguments an object, not JSON text (templates write them with ``tojson``; ``history_call``), an empty list of
    calls as none, an
    assistant's thinking as ``reasoning_content`` too, as vLLM's chat parser gives it (the older name, which Qwen3's
    template reads), and a developer message with ``tools`` (its own, None where it has none, as vLLM's parser gives
    them), its role ``developer_as``: system for a template that does not know the role
    (``model_info.developer_role``), without tools, as vLLM converts it (OpenAI's developer message has none; a
    system message has none to give a template); the content as
    one text, or (``content_format`` "openai", a template that loops over it) as its text parts, a tool's result a
    text all the same (``content_parts``); a system message less Claude Code's billing header
    (``without_billing_header``)."""
    out = []
    for m in messages:
        m = without_billing_header(m) if m["role"] == "system" else m
        m = content_parts(m) if content_format == "openai" else m
        m = {k: v for k, v in m.items() if k != "parts"}
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [history_call(c, endpoint) for c in m["tool_calls"]]}
        elif "tool_calls" in m:  # [] or None: vLLM's chat parser drops the key, so the template takes its plain path
            m = {k: v for k, v in m.items() if k != "tool_calls"}
        if m.get("reasoning") is not None:
            m = {**m, "reasoning_content": m["reasoning"]}
        if m["role"] == "developer":
            m = {**m, "role": developer_as, "tools": m.get("tools")} if developer_as == "developer" else {
                **{k: v for k, v in m.items() if k != "tools"}, "role": developer_as}
        out.append(m)
    return out


def history_call(call: dict[str, Any], endpoint: str | None = None) -> dict[str, Any]:
    """A history call as vLLM's route ``endpoint`` gives it to the template (None: chat's), the arguments as an
    object (``arguments_object``); a template that dumps the calls (``tojson``) writes the keys in this order. Chat's
    and Messages' requests validate the call as OpenAI's ``ChatCompletionMessageFunctionToolCallParam``: that type's
    order (id, function: arguments then name, type) whatever order was sent, the keys a client added after its own
    (the function's after name); Responses' converter builds it: id, function: name then arguments, type."""
    function = call["function"]
    arguments = arguments_object(function["arguments"])
    if endpoint in BUILT_CALL_ENDPOINTS:
        return {"id": call["id"], "function": {"name": function["name"], "arguments": arguments}, "type": "function"}
    return {"id": call["id"], "function": {"arguments": arguments, "name": function["name"],
                                           **{k: v for k, v in function.items() if k not in FUNCTION_KEYS}},
            "type": call.get("type", "function"), **{k: v for k, v in call.items() if k not in CALL_KEYS}}


def into_system_prompt(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a chat template that takes a system message only first: each system message after the first
    message is left out, its text added to the leading system prompt's (the first message where it is a system
    message, else a new system message) in order, with nothing between them, as vLLM's Messages converter merges a
    conversation's system messages for such a template (``_convert_messages``); a prompt with no text is left out."""
    lead = messages[:1] if messages and messages[0]["role"] == "system" else []
    rest = messages[len(lead):]
    joined = [m for m in rest if m["role"] == "system"]
    if not joined:
        return messages
    text = "".join(m["content"] for m in lead + joined if m["content"])
    head = {k: v for k, v in lead[0].items() if k != "parts"} if lead else {"role": "system"}
    return ([{**head, "content": text}] if text else []) + [m for m in rest if m["role"] != "system"]


def one_system_message(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A template's ``conversation`` with every system message merged into one first, as vLLM merges them where it
    gives a template that does not know the developer role a developer message as a system one
    (``_consolidate_system_messages``, for any template): the texts in order, a paragraph each (a message of text
    parts their texts a line each), an empty one left out; the merged message has only its role and that text. A
    conversation whose only system message is first is left as it is."""
    systems = [i for i, m in enumerate(conversation) if m["role"] == "system"]
    if not systems or systems == [0]:
        return conversation
    texts = [_as_text(conversation[i]["content"]) for i in systems]
    return [{"role": "system", "content": "\n\n".join(t for t in texts if t)},
            *(m for m in conversation if m["role"] != "system")]


def _as_text(content: str | list[dict[str, str]]) -> str:
    """A template message's content as one text: its text parts' a line each (``content_parts``' form)."""
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


def without_billing_header(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` less Claude Code's billing header, as vLLM's chat parser takes a system message: a text part that
    starts with it loses its first line, and is left out where that was all of it. The header's hash changes every
    request: kept, the prompt would miss the prefix cache from there."""
    texts = [message["content"]] if message.get("parts") is None else message["parts"]
    kept = [text.partition("\n")[2] if text.startswith(BILLING_HEADER) else text for text in texts]
    kept = [text for text, was in zip(kept, texts, strict=True) if text or not was.startswith(BILLING_HEADER)]
    return message if kept == texts else {**message, "content": "\n".join(kept), "parts": kept}


def content_parts(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with its content as vLLM's "openai" content format gives it: each text part as
    ``{"type": "text", "text": ...}`` (a text content one part, no content none), a tool message's joined text
    alone kept a text (vLLM's chat parser joins those back, for templates that read a tool's result as one)."""
    if message["role"] == "tool":
        return message
    texts = message.get("parts")
    return {**message, "content": text_parts([message["content"]] if texts is None else texts)}


def text_parts(texts: list[str]) -> list[dict[str, str]]:
    """``texts`` as chat content parts (``{"type": "text", "text": ...}`` each), as vLLM's chat parser reads them."""
    return [{"type": "text", "text": text} for text in texts]


def arguments_object(arguments: str | dict[str, Any]) -> dict[str, Any]:
    """A call's arguments as a template gets them, as vLLM's chat parser gives them: the JSON object the text
    holds, and {} for any other text (empty, not JSON, or JSON that is no object), which vLLM takes rather than fail
    every later turn of the conversation that holds it."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}
