"""Token-aware splitting with overlap: chunks of at most ``max_tokens`` tokens, cut at
sentence boundaries where possible; consecutive chunks share about ``overlap`` tokens."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from app.services.model_info import token_counts

log = logging.getLogger(__name__)

COUNT_BATCH = 512  # sentences a tokenizer call measures (a lease renewal may come between two)
SENTENCE = re.compile(r"(?<=[.!?])\s+|\n{2,}")


def sentences(text: str) -> list[str]:
    return [s for s in (p.strip() for p in SENTENCE.split(text)) if s]


def split_text(text: str, count: Callable[[str], int], max_tokens: int, overlap: int = 0,
               hard_split: Callable[[str, int], list[str]] | None = None,
               count_many: Callable[[list[str]], list[int]] | None = None) -> list[str]:
    """Greedy packing of sentences into chunks of <= ``max_tokens`` (as measured by ``count``, or
    ``count_many`` for all the sentences at once: a tokenizer's batch call).

    A sentence longer than a chunk is cut by ``hard_split`` (token windows). Each new chunk
    starts with the previous chunk's last sentences, up to ``overlap`` tokens.
    """
    if max_tokens <= 0 or overlap < 0 or overlap >= max_tokens:
        raise ValueError("need 0 <= overlap < max_tokens")
    count_many = count_many or (lambda texts: [count(t) for t in texts])
    parts = sentences(text)
    counts = count_many(parts)
    # the whole text is measured only where its sentences say it may fit (a text measures about as its sentences
    # do; a factor of two to spare): measuring a long document whole cost as much as measuring all its sentences
    if sum(counts) + len(parts) - 1 <= 2 * max_tokens and count(text) <= max_tokens:
        return [text.strip()] if text.strip() else []
    units: list[tuple[str, int]] = []
    for s, n in zip(parts, counts):
        if n > max_tokens and hard_split is not None:
            pieces = hard_split(s, max_tokens - overlap)
            units += zip(pieces, count_many(pieces))
        else:
            units.append((s, n))
    chunks: list[str] = []
    cur: list[tuple[str, int]] = []
    size = 0
    for s, n in units:
        if cur and size + n + 1 > max_tokens:
            chunks.append(" ".join(u for u, _ in cur))
            carry: list[tuple[str, int]] = []  # the overlap: trailing sentences of this chunk
            total = 0
            for u, m in reversed(cur):
                if total + m > overlap or total + m + n + 1 > max_tokens:
                    break
                carry.insert(0, (u, m))
                total += m + 1
            cur, size = carry, total
        cur.append((s, n))
        size += n + 1
    if cur:
        chunks.append(" ".join(u for u, _ in cur))
    return chunks


class TokenSplitter:
    """``split_text`` measured with a Hugging Face tokenizer. ``tick``, where given, is called before each text is
    measured (a long split renews its step's lease there, and stops by raising)."""

    def __init__(self, tokenizer, max_tokens: int, overlap: int, tick: Callable[[], None] | None = None) -> None:
        self.tok, self.max_tokens, self.overlap = tokenizer, max_tokens, overlap
        self.tick = tick or (lambda: None)

    def count(self, text: str) -> int:
        self.tick()
        return token_counts(self.tok, [text])[0]

    def count_many(self, texts: list[str]) -> list[int]:
        """``count`` of each text, ``COUNT_BATCH`` texts a call of the tokenizer (a fast tokenizer encodes a batch
        on all cores, and the Python call is paid once a batch, not once a sentence;
        ``token_counts``: no offsets)."""
        counts: list[int] = []
        for i in range(0, len(texts), COUNT_BATCH):
            self.tick()
            counts += token_counts(self.tok, texts[i:i + COUNT_BATCH])
        return counts

    def hard_split(self, text: str, size: int) -> list[str]:
        """Windows of ``size`` tokens, cut in the text where a window's first token starts: a character that spans
        two byte-level tokens (CJK, emoji) stays whole, where decoding each window alone would garble it."""
        starts = [a for a, _b in self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
                  ["offset_mapping"]]
        cuts = sorted({0, len(text), *starts[max(1, size)::max(1, size)]})
        return [piece for a, b in zip(cuts, cuts[1:]) if (piece := text[a:b].strip())]

    def __call__(self, text: str) -> list[str]:
        return split_text(text, self.count, self.max_tokens, self.overlap, self.hard_split, self.count_many)
