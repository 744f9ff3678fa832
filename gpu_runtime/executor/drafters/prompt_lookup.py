"""Model-free drafter: match the last n tokens against the prompt + output (prompt lookup).

Several earlier matches of the suffix become branches. Path probabilities come from
match counts: a child's conditional is (matches through the child) / (matches through
its parent), times a per-depth decay, multiplied along the path.

Matches come from an incremental n-gram index per request (``NgramIndex``): each new
token adds one entry per n-gram length, so a step costs O(matches) instead of a scan of
the whole context (the scan, ``scan_matches``, stays as the reference the index is
tested against).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from gpu_runtime.executor.base import DraftEntry, KeepDrafting
from gpu_runtime.executor.drafters.base import Drafter
from gpu_runtime.speculation.token_tree import TokenTree

log = logging.getLogger(__name__)


@dataclass
class _Trie:
    count: int = 0
    children: dict[int, _Trie] = field(default_factory=dict)


class NgramIndex:
    """End positions of every n-gram (n in 1..max_ngram) of one token sequence, oldest first.

    It keeps its own copy of the tokens it indexed and syncs with the live sequence on each
    query: appended tokens are indexed, and if the sequence was cut or rewritten (preemption
    recompute, outputs cut at a stop string) the entries past the first changed position are
    dropped before re-indexing, so answers always match a scan of the current sequence."""

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> end indices, ascending

    def sync(self, tokens: list[int]) -> None:
        n_old = len(self.tokens)
        # common case: ``tokens`` extends what was indexed (one C-level slice compare)
        keep = n_old if len(tokens) >= n_old and tokens[:n_old] == self.tokens else _common_prefix(self.tokens, tokens)
        if keep < n_old:
            self._truncate(keep)
        for end in range(keep, len(tokens)):
            self.tokens.append(tokens[end])
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.ends.setdefault(tuple(self.tokens[end - n + 1:end + 1]), []).append(end)

    def _truncate(self, keep: int) -> None:
        for end in range(len(self.tokens) - 1, keep - 1, -1):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                key = tuple(self.tokens[end - n + 1:end + 1])
                lst = self.ends[key]
                lst.pop()  # ``end`` is the largest entry left: removed newest first
                if not lst:
                    del self.ends[key]
        del self.tokens[keep:]

    def matches(self, n: int, limit: int) -> list[int]:
        """End indices of earlier occurrences of the last ``n`` tokens, newest first (the suffix
        itself excluded), at most ``limit``."""
        n_tok = len(self.tokens)
        if n < 1 or n > min(self.max_ngram, n_tok - 1):
            return []
        ends = self.ends.get(tuple(self.tokens[n_tok - n:]), [])
        out: list[int] = []
        for i in range(len(ends) - 1, -1, -1):
            end = ends[i]
            if end < n_tok - 1:
                out.append(end)
                if len(out) >= limit:
                    break
        return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    i, n = 0, min(len(a), len(b))
    while i < n and a[i] == b[i]:
        i += 1
    return i


def scan_matches(tokens: list[int], depth: int, max_ngram: int, min_ngram: int, max_matches: int) -> list[list[int]]:
    """Continuations of the newest matches of the longest matching suffix, by scanning (reference)."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n:]
        last = suffix[-1]
        found: list[list[int]] = []
        for end in range(n_tok - 2, n - 2, -1):  # end = index of the match's last token, newest first
            if tokens[end] == last and tokens[end - n + 1:end + 1] == suffix:
                found.append(tokens[end + 1:end + 1 + depth])
                if len(found) >= max_matches:
                    break
        if found:
            return found
    return []


class PromptLookupDrafter(Drafter):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 16, decay: float = 0.8) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches  # most recent matches kept (bounds the per-step cost)
        self.decay = decay  # confidence lost per extra depth step
        self._indexes: dict[str, NgramIndex] = {}

    def draft(self, entries: list[DraftEntry], keep_drafting: KeepDrafting | None = None) -> dict[str, TokenTree]:
        out = {}
        for e in entries:
            index = self._indexes.get(e.request_id)
            if index is None:
                index = self._indexes[e.request_id] = NgramIndex(self.max_ngram)
            index.sync(self.executor.token_ids(e.request_id))
            out[e.request_id] = self._tree(self._indexed_matches(index, e.depth), e.width)
        return out

    def free(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def propose(self, tokens: list[int], depth: int, width: int) -> TokenTree:
        """The tree for a bare token list (no request state: scans)."""
        return self._tree(scan_matches(tokens, depth, self.max_ngram, self.min_ngram, self.max_matches), width)

    def _indexed_matches(self, index: NgramIndex, depth: int) -> list[list[int]]:
        tokens = index.tokens
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            ends = index.matches(n, self.max_matches)
            if ends:
                return [tokens[end + 1:end + 1 + depth] for end in ends]
        return []

    def _tree(self, continuations: list[list[int]], width: int) -> TokenTree:
        if not continuations:
            return TokenTree()
        root = _Trie(count=len(continuations))
        for cont in continuations:
            node = root
            for tok in cont:
                node = node.children.setdefault(tok, _Trie())
                node.count += 1
        tree = TokenTree()
        self._emit(root, -1, 1.0, 1, width, tree)
        return tree

    def _emit(self, node: _Trie, parent: int, path_prob: float, depth: int, width: int, tree: TokenTree) -> None:
        ranked = sorted(node.children.items(), key=lambda kv: -kv[1].count)[:width]
        for tok, child in ranked:
            prob = path_prob * child.count / node.count * self.decay
            tree.token_ids.append(tok)
            tree.parents.append(parent)
            tree.path_probs.append(prob)
            self._emit(child, len(tree.token_ids) - 1, prob, depth + 1, width, tree)
