"""Call objects ``{"name": ..., "arguments" or "parameters": {...}}`` found in a JSON text as it grows.

A stream sends a call once its name is known and then its arguments' text as it comes (the arguments
object is one contiguous span of the text, so every character of it read so far is final); the whole
answer takes the same spans, so a streamed call's arguments add up to the answer's. Where a call's
arguments are not an object (a JSON string, say), they are read whole from the parsed text instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ScannedCall:
    name: str | None = None
    arguments_start: int | None = None  # where its arguments' text begins
    arguments_end: int | None = None  # past its end, once it closed
    streamable: bool = True  # False where the arguments are not an object

    def arguments(self, text: str) -> str | None:
        """Its arguments' text read so far (None before they begin or where they are not an object)."""
        if self.arguments_start is None or not self.streamable:
            return None
        return text[self.arguments_start:self.arguments_end if self.arguments_end is not None else len(text)]


class CallScanner:
    """Reads a text's call objects as the text grows, each character once. ``call_depth``: how many containers
    enclose a call's keys (1: calls are top-level objects; 2: objects in a top-level list). Characters outside
    any container (tags, separators) are passed over."""

    def __init__(self, call_depth: int) -> None:
        self.call_depth, self.text, self.calls = call_depth, "", []
        self._depth, self._in_string, self._escape = 0, False, False
        self._string_start = 0
        self._expect = "key"  # inside a call at its own depth: key, colon, value or comma
        self._key: str | None = None

    def feed(self, delta: str) -> None:
        start = len(self.text)
        self.text += delta
        for i in range(start, len(self.text)):
            self._read(i, self.text[i])

    def _read(self, i: int, c: str) -> None:
        at_call = self._depth == self.call_depth and bool(self.calls)
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if at_call:
                    self._string_ended(i)
            return
        if c == '"':
            self._in_string, self._string_start = True, i
            if at_call and self._expect == "value" and self._key in ARGUMENT_KEYS:
                self.calls[-1].streamable = False  # arguments as a JSON string: read whole from the answer
        elif c in "{[":
            if self._depth == self.call_depth - 1 and c == "{":
                self.calls.append(ScannedCall())
                self._expect, self._key = "key", None
            elif at_call and self._expect == "value" and self._key in ARGUMENT_KEYS:
                self.calls[-1].arguments_start, self.calls[-1].streamable = i, c == "{"
            self._depth += 1
        elif c in "}]":
            self._depth = max(0, self._depth - 1)
            if self._depth == self.call_depth and self.calls and self._expect == "value":
                call = self.calls[-1]
                if self._key in ARGUMENT_KEYS and call.arguments_start is not None and call.arguments_end is None:
                    call.arguments_end = i + 1
                self._expect = "comma"
        elif at_call:
            if c == ":" and self._expect == "colon":
                self._expect = "value"
            elif c == ",":
                self._expect = "key"
            elif not c.isspace() and self._expect == "value" and self._key in ARGUMENT_KEYS:
                self.calls[-1].streamable = False  # a number or literal: read whole from the answer

    def _string_ended(self, i: int) -> None:
        try:
            value = json.loads(self.text[self._string_start:i + 1])
        except ValueError:
            value = None
        if self._expect == "key":
            self._key, self._expect = value, "colon"
        elif self._expect == "value":
            if self._key == "name" and isinstance(value, str):
                self.calls[-1].name = value
            self._expect = "comma"


def begun_calls(text: str, call_depth: int) -> tuple[list[tuple[str, str]], bool]:
    """The calls of a text that is no whole JSON (cut short, or broken): each one named whose arguments began as an
    object, with their text as far as it goes, which is what a stream sent of them; and whether the text ended inside
    the last one's arguments."""
    scanner = CallScanner(call_depth)
    scanner.feed(text)
    calls = [(call.name, arguments) for call in scanner.calls
             if call.name is not None and (arguments := call.arguments(scanner.text)) is not None]
    last = scanner.calls[-1] if scanner.calls else None
    return calls, last is not None and last.arguments_start is not None and last.arguments_end is None


def raw_arguments(text: str, call_depth: int) -> list[str | None]:
    """Each call's arguments as written in a whole text (None where they are not an object, or not closed)."""
    scanner = CallScanner(call_depth)
    scanner.feed(text)
    return [c.arguments(text) if c.arguments_end is not None else None for c in scanner.calls]
