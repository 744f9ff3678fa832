"""Tool (function) calling: the tools a chat job offers, how a forced choice constrains its text, and the
calls read back out of that text.

A job whose ``tool_choice`` names a function, or is ``"required"``, generates under a JSON schema (vLLM's
structured outputs), so its text always parses: a named function's arguments object, or a list of
``{"name", "parameters"}`` calls to any of the tools. This needs no parser for the model's own tool-call
syntax, which is why it works with every model (vLLM serves the forced choices the same way). ``"auto"``,
where the model decides in its own syntax, needs such a parser and is not offered.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from app.wire import Text

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name
MAX_TOOLS = 128
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function declared without parameters takes none


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=NAME_PATTERN, description="the function's name (letters, digits, _ and -; 1-64)")
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionName(BaseModel):
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(BaseModel):
    """Call this function (OpenAI's ``{"type": "function", "function": {"name": ...}}``)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionName


CHOICES = """tool_choice must be "none", "required" or {"type": "function", "function": {"name": ...}}"""


def _choice(value: Any) -> Any:
    """One error naming tool_choice, instead of one per member of the union."""
    if isinstance(value, str):
        if value not in ("none", "required"):
            raise ValueError(f"{CHOICES}, not {value!r}" + (
                " (the model's own call syntax is not parsed here)" if value == "auto" else ""))
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError as exc:
            raise ValueError(f"{CHOICES}: {exc.errors()[0]['msg']}") from None
    return value


ToolChoice = Annotated[Literal["none", "required"] | NamedToolChoice, BeforeValidator(_choice)]


class FunctionCall(BaseModel):
    name: Text
    arguments: Text = Field(description="the arguments object as JSON text")


class ToolCall(BaseModel):
    """A call an assistant message made (sent back in a conversation's history)."""

    model_config = ConfigDict(extra="ignore")

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


def forced_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    """What a job keeps of its choice: ``"required"``, the named choice as OpenAI writes it, or None where the
    text is free (no choice, or ``"none"``)."""
    if choice is None or choice == "none":
        return None
    return choice if isinstance(choice, str) else choice.model_dump()


def forced_schema(tools: list[ToolSpec], choice: str | dict[str, Any], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema the text of a forced ``choice`` is generated under: the named function's parameters, or
    for ``"required"`` a list of one call or more (one at most unless ``parallel``), each naming a tool and giving
    its parameters."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        function = next(t.function for t in tools if t.function.name == name)
        return function.parameters or EMPTY_PARAMETERS
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                "parameters": t.function.parameters or EMPTY_PARAMETERS},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def call_id(job_id: str, index: int) -> str:
    """A call's id, the same whenever the job's answer is read (a stream, the plain answer, a batch line)."""
    return f"call_{job_id.removeprefix('job_')}_{index}"


def calls_in(job_id: str, choice: str | dict[str, Any] | None, text: str) -> list[dict[str, Any]] | None:
    """The tool calls in the text of a job with a forced ``choice``, in OpenAI's shape; None where the choice
    was free or the text is not whole (cut by max_tokens: the answer then carries the text)."""
    if choice is None:
        return None
    if isinstance(choice, dict):  # the text is the named function's arguments
        calls = [(choice["function"]["name"], text)]
    else:
        try:
            parsed = json.loads(text)
        except ValueError:
            return None
        if not isinstance(parsed, list) or not all(isinstance(c, dict) and "name" in c for c in parsed):
            return None
        calls = [(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in parsed]
    return [{"id": call_id(job_id, i), "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(calls)]


def tool_finish_reason(choice: str | dict[str, Any] | None, calls: list[dict[str, Any]] | None,
                  engine_reason: str | None) -> str | None:
    """OpenAI's finish reason: ``tool_calls`` where ``"required"`` made calls and the text ended by itself; a
    named call ends with ``stop``, as OpenAI answers it."""
    if choice == "required" and calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: a call's arguments as an object, not JSON text (templates write
    them with ``tojson``)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _object(
                c["function"]["arguments"])}} for c in m["tool_calls"]]}
        out.append(m)
    return out


def _object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
