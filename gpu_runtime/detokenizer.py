"""Incremental detokenization and stop-string detection for streaming."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_runtime.request import Request


class Detokenizer:
    """Turns each request's output ids into text deltas; finds stop strings.

    Decodes the whole output each call (O(n) per token), which keeps multi-byte
    characters split across tokens correct; a held-back tail avoids emitting a
    replacement character or a partial stop string.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._emitted: dict[str, int] = {}  # characters already sent per request

    def text(self, request: Request) -> str:
        return self._decode(request, request.output_token_ids)

    def _decode(self, request: Request, ids: list[int]) -> str:
        # special tokens stay where a parser reads them (a tool call's or a thinking tag may be one)
        return self.tokenizer.decode(ids, skip_special_tokens=request.sampling.skip_special_tokens)

    def update(self, request: Request, finished: bool) -> tuple[str, str | None]:
        """Returns (new text, the stop string it hit or None). On a hit the text ends before the stop string
        (after it, with ``include_stop_str_in_output``); of several, the one that comes first."""
        text = self.text(request)
        sent = self._emitted.get(request.request_id, 0)
        hit = None
        for stop in request.sampling.stop:
            pos = text.find(stop, max(0, sent - len(stop)))
            if pos >= 0:
                text, hit = text[:pos + len(stop) * request.sampling.include_stop_str_in_output], stop
        if not (finished or hit is not None):
            # hold back an incomplete character and anything that could start a stop string
            cut = len(text)
            if text.endswith("\ufffd"):
                cut = len(text.rstrip("\ufffd"))
            hold = max((len(s) - 1 for s in request.sampling.stop), default=0)
            cut = max(sent, min(cut, len(text) - hold))
            text = text[:cut]
        delta = text[sent:] if len(text) > sent else ""
        self._emitted[request.request_id] = max(sent, len(text))
        if finished or hit is not None:
            self._emitted.pop(request.request_id, None)
        return delta, hit

    def tokens_past_stop(self, request: Request, new: int) -> int:
        """How many of the request's last ``new`` output tokens follow the one that completed a stop string (a
        speculative step accepts several at once; generation ends at that token, as it does one token a step)."""
        ids = request.output_token_ids
        for k in range(1, new):
            text = self._decode(request, ids[:len(ids) - new + k])
            if any(stop in text for stop in request.sampling.stop):
                return new - k
        return 0

    def forget(self, request_id: str) -> None:
        self._emitted.pop(request_id, None)
