"""A prefix cache of KV blocks by content, as vLLM's automatic prefix caching keeps one (the simulator's model).

A full block is named by a hash of its tokens chained to the hash of the block before it, so two sequences share
a block's name exactly when they share every token up to its end. A block is resident while a live request holds
it or, once none does, until the pool needs its memory: vLLM keeps a freed block's KV (and its name) in the free
queue and drops it only when that block is handed out again, least recently freed first. Pure Python.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = 0, start: int = 0) -> list[int]:
    """Names of the full blocks of ``token_ids[start:]`` (``start`` on a block boundary), the first chained to
    ``parent``, the name of the block before ``start`` (0: none). Hashes of ints only: the same in every process."""
    out = []
    for lo in range(start, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[lo:lo + block_size])))
        out.append(parent)
    return out


def salt_root(cache_salt: str) -> int:
    """What the first block of a prompt with ``cache_salt`` is chained to (vLLM hashes the salt into its first
    block's name): a stable int, the same in every process (str hashes are not)."""
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "big") or 1


class PrefixCache:
    """Which blocks are resident: held by live requests (counted per holder) or idle, least recently freed
    first."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._holders or block in self._idle

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def leading_hits(self, blocks: Sequence[int], start: int = 0) -> int:
        """How many of ``blocks`` from the first are resident, given the first ``start`` are."""
        n = start
        while n < len(blocks) and blocks[n] in self:
            n += 1
        return n

    def hold(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._idle.pop(b, None)
            self._holders[b] = self._holders.get(b, 0) + 1

    def release(self, blocks: Sequence[int]) -> None:
        """The holder of ``blocks`` left; a block no one holds any more stays cached, idle, newest last."""
        for b in reversed(blocks):  # vLLM frees a request's blocks tail first: its prefix is evicted last
            left = self._holders.get(b, 0) - 1
            if left > 0:
                self._holders[b] = left
            elif left == 0:
                del self._holders[b]
                self._idle[b] = None

    def evict_to(self, max_idle: int) -> int:
        """Drops the least recently freed idle blocks until at most ``max_idle`` remain (the free blocks the pool
        has: an idle block's memory is free memory); returns how many went."""
        gone = 0
        while len(self._idle) > max(0, max_idle):
            self._idle.popitem(last=False)
            gone += 1
        return gone
