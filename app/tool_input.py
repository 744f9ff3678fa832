"""A Messages ``tool_use`` block's ``input`` as the ``anthropic`` SDK reads it from a stream, and as the plain answer
gives it, the same.

The SDK's stream adds each ``input_json_delta`` to the block's JSON so far and reads that at once with ``jiter``'s
partial parser (``anthropic/lib/streaming/_messages.py``, ``accumulate_event``): JSON cut anywhere reads (a call's
input shows while it streams), JSON that no more text could complete (``{"a": 1,}``, a bare word) raises ``Unable
to parse tool parameter JSON from model`` and ends the client's stream. So a call's arguments stream while they are
the beginning of an object a JSON parser can still complete, and stop at the first character that cannot be (JSON
has no NaN or Infinity, nor a number past a float's range, which the SDK reads but no answer can write back): the
input is what the SDK reads of that beginning, streamed or not (a call a broken character or max_tokens cut keeps
what came before; its answer never ends in ``tool_use``: ``anthropic_schemas.stop_of``).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

from jiter import from_json

from app.wire import STRICT_JSON, holds_non_finite


def _sdk_reads(text: str) -> bool:
    """Whether ``text`` may be a call's arguments streamed so far: nothing but whitespace yet, or the beginning of
    an object the SDK's partial parser reads, with nothing but whitespace after the object where it is whole."""
    head = text.lstrip()
    if not head:
        return True
    if not head.startswith("{"):  # the SDK would read a list or a string: no input a tool takes
        return False
    try:
        read = from_json(text.encode(), partial_mode=True, allow_inf_nan=False)
    except ValueError:
        return False
    return not holds_non_finite(read) and not _past_its_end(head)


def _past_its_end(head: str) -> bool:
    """Whether text follows the whole object ``head`` begins with: the SDK's parser reads past it (and gives the
    object), where no JSON parser could go on."""
    try:
        _, end = STRICT_JSON.raw_decode(head)
    except (ValueError, RecursionError):  # the object is not whole yet
        return False
    return bool(head[end:].strip())


def readable_length(arguments: str, known: int = 0) -> int:
    """The length of the longest beginning of ``arguments`` the SDK reads (``_sdk_reads``), knowing the first
    ``known`` characters are read: once a character makes them unreadable, no more text makes them readable again,
    so a binary search finds it."""
    if _sdk_reads(arguments):
        return len(arguments)
    return bisect_left(range(len(arguments) + 1), True, lo=known, key=lambda n: not _sdk_reads(arguments[:n])) - 1


def tool_input(arguments: str | None) -> dict[str, Any]:
    """A call's ``input``: what the SDK reads of the arguments' readable beginning (``{}`` of none)."""
    readable = (arguments or "")[:readable_length(arguments or "")]
    return from_json(readable.encode(), partial_mode=True, allow_inf_nan=False) if readable.strip() else {}


@dataclass
class StreamedInput:
    """One call's arguments as a Messages stream sends them: each piece as it comes while the SDK reads them,
    whitespace before the object held until it begins (the SDK reads no whitespace alone), nothing from the first
    character on that no JSON parser could go on from."""

    arguments: str = ""  # what came of the call's arguments
    sent: int = 0  # of which the stream sent so many characters
    broken: bool = False  # a character came that no JSON parser could go on from: the stream sends no more

    def more(self, piece: str) -> str:
        """The ``partial_json`` to send of ``piece``, the arguments' next part ("" for none)."""
        if self.broken:
            return ""
        self.arguments += piece
        readable = readable_length(self.arguments, self.sent)
        self.broken = readable < len(self.arguments)
        if not self.arguments[:readable].strip():
            return ""
        out, self.sent = self.arguments[self.sent:readable], readable
        return out
