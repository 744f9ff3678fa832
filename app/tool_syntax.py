"""The syntax a model writes its own tool calls in (``tool_choice`` "auto"), read back out of its text.

One reader per syntax, chosen by ``COSERVE_TOOL_CALL_PARSER`` (vLLM's ``--tool-call-parser`` names the same
formats). A reader splits a finished text into the content before the calls and the calls, and says how much
of a text still being generated is surely content (a stream shows that much and holds back the rest).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from app.tool_call_scan import begun_calls, raw_arguments
from app.wire import STRICT_JSON, strict_json

RawCall = tuple[str, str]  # (function name, arguments as JSON text)


def read_call(call: Any, written: str | None = None) -> RawCall:
    """A call object ``{"name": ..., "arguments" or "parameters": ...}`` (raises ValueError where it is not one);
    its arguments as ``written`` where the text's object is known (a stream sent them so), else as JSON text."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError("not a call")
    arguments = call.get("arguments", call.get("parameters", {}))
    if written is not None and isinstance(arguments, dict):
        return call["name"], written
    return call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _held_tag_prefix(text: str, tag: str, known: int) -> int:
    """How much of a text still being generated is surely before ``tag``: up to it, or short of a tail that may
    become it (``known``: characters already found to be before it, not searched again)."""
    at = text.find(tag, max(0, known - len(tag)))
    if at >= 0:
        return at
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return len(text) - k
    return len(text)


@dataclass(frozen=True)
class TaggedJsonSyntax:
    """Calls as JSON objects ``{"name": ..., "arguments": {...}}`` between a start and an end tag (Hermes and
    Qwen 2.5/3 write ``<tool_call>...</tool_call>``); the text before the first tag is the content."""

    start: str
    end: str
    call_depth: int = 1  # a call's keys lie in a top-level object

    def split(self, text: str) -> tuple[str | None, list[RawCall] | None]:
        """(content, calls); calls None where the text holds none, or ends in one that does not parse (cut short:
        then the whole text is the content, as vLLM answers it). A closed block that is no call stays content,
        after the text before the first tag, and the calls around it are read (vLLM's reader drops them all,
        though its stream sends those before it); one that names a call but does not parse is a call
        (``block_calls``)."""
        at = text.find(self.start)
        if at < 0:
            return text, None
        calls, kept = [], []  # kept: the closed blocks that are no call
        pattern = re.escape(self.start) + r"(.*?)(?:" + re.escape(self.end) + r"|\Z)"
        for block in re.finditer(pattern, text[at:], flags=re.DOTALL):  # the last one may be cut short
            if not block[0].endswith(self.end):  # cut short: a call only where it parses
                try:
                    calls.append(read_call(strict_json(block[1]), next(iter(raw_arguments(block[1], 1)), None)))
                except ValueError:
                    return text, None
                continue
            found = self.block_calls(block[1])
            calls.extend(found)
            if not found:
                kept.append(block[0])
        if not calls:
            return text, None
        content = text[:at] + "".join(kept)
        return (content if content.strip() else None), calls

    def block_calls(self, body: str) -> list[RawCall]:
        """The calls of a closed block's ``body``: the call its JSON is, or where that does not parse (a brace lost,
        a trailing comma), each call it names whose arguments begin, as written, as a stream sends them (vLLM's
        hermes stream sends every block that names a function, its reader of a whole text none); none where it
        names none (it is content)."""
        try:
            return [read_call(strict_json(body), next(iter(raw_arguments(body, self.call_depth)), None))]
        except ValueError:
            return begun_calls(body, self.call_depth)[0]

    def calls_start(self, text: str) -> int | None:
        """Where the calls begin in a text still being generated (None: none yet)."""
        at = text.find(self.start)
        return at if at >= 0 else None

    def call_body(self, text: str, at: int = 0) -> int | None:
        """Where the next block's body begins in a text still being generated, from ``at`` (None: none yet)."""
        found = text.find(self.start, at)
        return found + len(self.start) if found >= 0 else None

    def body_end(self, text: str, body: int, known: int) -> tuple[int, int | None]:
        """How far the block whose body begins at ``body`` surely reaches in a text still being generated: to its end
        tag, or short of a tail that may become it (``known``: where it was found to reach before); and where the
        text goes on past that end tag (None while there is none)."""
        end = max(body, _held_tag_prefix(text, self.end, max(body, known)))
        return end, (end + len(self.end) if text.startswith(self.end, end) else None)

    def content_so_far(self, text: str, known: int = 0) -> int:
        """How many leading characters of a text still being generated are content whatever comes next: up
        to the start tag, or short of a tail that may become one (``known``: characters already found to be
        content, not searched again)."""
        return _held_tag_prefix(text, self.start, known)


class OneBody:
    """A syntax whose calls are one body from where they begin to the text's end (no tag closes it)."""

    def calls_start(self, text: str) -> int | None:
        raise NotImplementedError

    def call_body(self, text: str, at: int = 0) -> int | None:
        """Where the calls begin (``at`` 0; there is no second body)."""
        return self.calls_start(text) if at == 0 else None

    def body_end(self, text: str, body: int, known: int) -> tuple[int, int | None]:
        """The calls' body reaches the end of the text, never closed."""
        return len(text), None

    def block_calls(self, body: str) -> list[RawCall]:
        """No body closes (``body_end``): never asked."""
        raise NotImplementedError


@dataclass(frozen=True)
class LeadingJsonSyntax(OneBody):
    """Calls as the whole answer: JSON objects ``{"name": ..., "parameters": {...}}`` separated by ``;``, perhaps
    after a tag (Llama 3.1-3.3 write ``<|python_tag|>`` or nothing before them); an answer that does not start
    with one is content, all of it. Words between or after the calls are dropped (no ``{`` in them), as vLLM's
    ``llama3_json`` reader and stream drop them."""

    tag: str
    call_depth: int = 1

    def split(self, text: str) -> tuple[str | None, list[RawCall] | None]:
        body = text.lstrip().removeprefix(self.tag).lstrip()
        if not body.startswith("{"):
            return text, None
        decoder, calls, at, written = STRICT_JSON, [], 0, raw_arguments(body, 1)
        while at < len(body):
            try:
                parsed, at = decoder.raw_decode(body, at)
                calls.append(read_call(parsed, written[len(calls)] if len(calls) < len(written) else None))
            except ValueError:  # cut short, or not a call after all: the text is the content
                return text, None
            # the next call begins at the next "{": what lies between (a "; ", words) is dropped, and so are words
            # after the last call, as vLLM's reader (each object from a "{" on) and its stream drop them
            found = body.find("{", at)
            at = found if found >= 0 else len(body)
        return None, calls

    def calls_start(self, text: str) -> int | None:
        """Where the calls begin in a text still being generated: its start, once that shows a call."""
        start = text.lstrip()
        return 0 if start.startswith(("{", self.tag)) else None

    def content_so_far(self, text: str, known: int = 0) -> int:
        """All of the text once its start shows it is no call (calls only come first), none while it may be."""
        if known:
            return len(text)
        start = text.lstrip()
        if not start or start.startswith(("{", self.tag)) or self.tag.startswith(start):
            return 0
        return len(text)


@dataclass(frozen=True)
class MistralSyntax(OneBody):
    """Mistral's calls after the ``[TOOL_CALLS]`` token: a JSON list of ``{"name": ..., "arguments": {...}}``
    objects (tokenizers before v11), or ``name[ARGS]{...}``, each call after its own ``[TOOL_CALLS]`` (v11 on);
    the text before the first tag is the content."""

    tag: str = "[TOOL_CALLS]"
    args_tag: str = "[ARGS]"
    call_depth: int = 2  # the list form: a call's keys lie in objects of a top-level list

    def split(self, text: str) -> tuple[str | None, list[RawCall] | None]:
        at = text.find(self.tag)
        if at < 0:
            return text, None
        content, body = text[:at], text[at + len(self.tag):].strip()
        try:
            calls = self._listed(body) if body.startswith("[") else self._named(body)
        except ValueError:  # cut short, or not calls after all: the text is the content
            return text, None
        return (content if content.strip() else None), calls

    def _listed(self, body: str) -> list[RawCall]:
        parsed, _ = STRICT_JSON.raw_decode(body)
        if not isinstance(parsed, list):
            raise ValueError("not a list of calls")
        written = raw_arguments(body, self.call_depth)
        return [read_call(c, written[i] if i < len(written) else None) for i, c in enumerate(parsed)]

    def _named(self, body: str) -> list[RawCall]:
        calls = []
        for part in body.split(self.tag):
            name, sep, arguments = part.partition(self.args_tag)
            name, arguments = name.strip(), arguments.strip()
            if not sep or not name:
                raise ValueError("not a call")
            parsed, end = STRICT_JSON.raw_decode(arguments)
            calls.append(read_call({"name": name, "arguments": parsed}, arguments[:end]))
        return calls

    def calls_start(self, text: str) -> int | None:
        at = text.find(self.tag)
        return at + len(self.tag) if at >= 0 else None

    def content_so_far(self, text: str, known: int = 0) -> int:
        return _held_tag_prefix(text, self.tag, known)


Syntax = TaggedJsonSyntax | LeadingJsonSyntax | MistralSyntax
SYNTAXES: dict[str, Syntax] = {
    "hermes": TaggedJsonSyntax("<tool_call>", "</tool_call>"),
    "llama3_json": LeadingJsonSyntax("<|python_tag|>"),
    "mistral": MistralSyntax(),
}
