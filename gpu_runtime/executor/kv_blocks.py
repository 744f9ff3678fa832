"""Paged KV cache bookkeeping: block tables per request and free-block accounting.

Pure Python (no torch) so the simulator can use the same accounting as the real
executor. A request's tokens live in fixed-size blocks; slot ``i`` of a request is
``table[i // block_size] * block_size + i % block_size`` in the flat physical cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from gpu_runtime.executor.base import KVCapacity

log = logging.getLogger(__name__)


def context_that_fits(max_model_len: int, num_blocks: int, block_size: int) -> int:
    """The longest context (prompt + output tokens) one request can have: ``max_model_len``, or what the whole KV
    cache holds where that is less, so that a request admitted can always finish (vLLM refuses to start where its
    max_model_len does not fit the KV cache, ``check_enough_kv_cache_memory``; the own engine fits it instead)."""
    return min(max_model_len, num_blocks * block_size)


def capped_context_note(wanted: int, num_blocks: int, block_size: int) -> str:
    """Why the context is shorter than ``wanted``: the figures, and what to change."""
    return (f"max_model_len {wanted} does not fit the KV cache ({num_blocks} blocks of {block_size} tokens = "
            f"{num_blocks * block_size} tokens): serving requests of up to {num_blocks * block_size} tokens "
            "(prompt + max_tokens); give the engine more KV blocks (COSERVE_KV_BLOCKS on a CPU, free device memory "
            "on a GPU) to serve longer ones")


def lifetime_slots(tokens: int, block_size: int) -> int:
    """The most KV slots the own engine's executors (torch and simulated) give a request of ``tokens`` (prompt +
    max_tokens) at once over its life: its tokens in whole blocks, and one block more for the draft tree a decode
    verifies (its nodes' slots are taken for the pass; the engine cuts a tree that would pass the block,
    ``Engine._trees_in_footprints``). KV admission reserves it (the executors' ``footprint_slots``)."""
    return (-(-tokens // block_size) + 1) * block_size


@dataclass(frozen=True)
class Allocation:
    """What one ``allocate`` call handed out."""

    request_id: str
    new_blocks: tuple[int, ...]  # physical block ids appended to the request's table
    num_tokens: int  # tokens the request can now hold


@dataclass
class BlockTable:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose slots are reserved (cached or scratch)
    # leading blocks held elsewhere (a prefix-cache hit, simulated: ``BlockManager.share``), not in ``blocks``
    shared_blocks: int = 0


class BlockManager:
    """Free list of physical blocks plus one block table per request."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.total_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[str, BlockTable] = {}

    # ---- accounting ----
    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_tokens(self, request_id: str) -> int:
        table = self.tables.get(request_id)
        return table.num_tokens if table else 0

    def blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        """Extra blocks to reserve ``num_new_tokens`` more slots for ``request_id``."""
        table = self.tables.get(request_id)
        if table is None:
            return self.blocks_for(num_new_tokens)
        return max(0, self.blocks_for(table.num_tokens + num_new_tokens) - len(table.blocks) - table.shared_blocks)

    def can_allocate(self, request_id: str, num_new_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_new_tokens) <= self.num_free

    # ---- allocation ----
    def allocate(self, request_id: str, num_new_tokens: int) -> Allocation | None:
        """Reserve slots for ``num_new_tokens`` more tokens; None (nothing changed) if blocks run out."""
        need = self.blocks_needed(request_id, num_new_tokens)
        if need > self.num_free:
            return None
        table = self.tables.setdefault(request_id, BlockTable())
        new = tuple(self._free.pop() for _ in range(need))
        table.blocks.extend(new)
        table.num_tokens += num_new_tokens
        return Allocation(request_id, new, table.num_tokens)

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Keep only the first ``num_tokens`` slots (rejected tree branches, scratch); returns blocks freed."""
        table = self.tables.get(request_id)
        if table is None or num_tokens >= table.num_tokens:
            return 0
        keep = max(0, self.blocks_for(num_tokens) - table.shared_blocks)
        dropped = table.blocks[keep:]
        del table.blocks[keep:]
        table.num_tokens = num_tokens
        self._release(dropped)
        return len(dropped)

    def free(self, request_id: str) -> int:
        """Release every block of the request; returns how many."""
        table = self.tables.pop(request_id, None)
        if table is None:
            return 0
        self._release(table.blocks)
        return len(table.blocks)

    def share(self, request_id: str, num_tokens: int) -> None:
        """``request_id``, holding no block of its own yet, starts with its first ``num_tokens`` (whole blocks) in
        blocks held elsewhere: the simulator's prefix-cache hit, counted once for every request that shares it (a
        second call grows it). Slots of shared blocks are not in the table (no real executor shares blocks)."""
        table = self.tables.get(request_id)
        if (table is not None and table.blocks) or num_tokens % self.block_size:
            raise ValueError(f"share {num_tokens} tokens: {request_id} holds KV, or that is not whole blocks")
        self.tables[request_id] = BlockTable(num_tokens=num_tokens, shared_blocks=num_tokens // self.block_size)

    def slot(self, request_id: str, position: int) -> int:
        table = self.tables[request_id]
        return table.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, request_id: str, start: int, stop: int) -> list[int]:
        """Flat physical slots of positions ``start..stop-1``."""
        blocks, bs = self.tables[request_id].blocks, self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, stop)]

    # ---- elastic pool (Nightjar: memory freed by offloading the draft) ----
    def grow(self, n_blocks: int) -> list[int]:
        """Add ``n_blocks`` new physical ids (the caller grew the tensors); returns them."""
        new = list(range(self.total_blocks, self.total_blocks + n_blocks))
        self.total_blocks += n_blocks
        self._free.extend(reversed(new))
        return new

    def shrink(self, n_blocks: int) -> int:
        """Remove up to ``n_blocks`` of the highest free ids; returns how many were removed.

        Only blocks at the top of the id range are removed so physical tensors can be
        cut from the end; a top block still held by a request stops the shrink."""
        removed = 0
        free = set(self._free)
        while removed < n_blocks and self.total_blocks - 1 in free:
            free.discard(self.total_blocks - 1)
            self.total_blocks -= 1
            removed += 1
        if removed:
            self._free = sorted(free, reverse=True)
        return removed

    def _release(self, blocks: list[int]) -> None:
        # reversed: the next allocation pops them back in ascending order, so a request's
        # table tends to stay one contiguous run (the forward reads such keys as a view)
        self._free.extend(reversed(blocks))


class PagedKV:
    """The executor protocol's KV queries over a ``BlockManager`` in ``self.blocks`` (the simulator's and the own
    engine's executors share them)."""

    blocks: BlockManager

    def capacity(self) -> KVCapacity:
        return KVCapacity(self.blocks.total_blocks, self.blocks.num_free, self.blocks.block_size)

    def blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        return self.blocks.blocks_needed(request_id, num_new_tokens)

    def footprint_slots(self, tokens: int) -> int:
        """The most KV slots a request of ``tokens`` holds over its life (``lifetime_slots``): admission reserves
        them."""
        return lifetime_slots(tokens, self.blocks.block_size)
