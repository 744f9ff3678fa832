"""Turns per-request segments of new tokens into one flattened ``ForwardBatch``.

A segment is one request's new tokens in this pass (a prefill chunk, a pending decode
token, a token tree, or a draft beam frontier) and the cache slots it may read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_runtime.executor.kv_blocks import BlockManager
from gpu_runtime.executor.torch.model import ForwardBatch


@dataclass
class Segment:
    token_ids: list[int]
    positions: torch.Tensor  # [n] long
    write_slots: torch.Tensor  # [n] long, flat cache slots for the new tokens
    key_slots: torch.Tensor  # [L] long, every slot the new tokens read (cached prefix first, new last)
    mask: torch.Tensor | None = None  # [n, L] bool; None = causal: new token j sees keys <= L - n + j
    logits_from: int = 0  # first new token (index within the segment) whose logits are needed
    logits_count: int = 0  # how many consecutive tokens from ``logits_from`` need logits


def request_slots(blocks: BlockManager, request_id: str, stop: int, device: torch.device) -> torch.Tensor:
    """Flat slots of positions ``0..stop-1`` of a request, as a tensor (no per-token Python loop)."""
    table = blocks.tables[request_id].blocks
    bs = blocks.block_size
    nb = -(-stop // bs)
    base = torch.tensor(table[:nb], dtype=torch.long, device=device)
    return (base[:, None] * bs + torch.arange(bs, device=device)[None, :]).reshape(-1)[:stop]


def contiguous_run(slots: torch.Tensor) -> slice | None:
    """``slots`` as a slice when they are one ascending run (read as a view of the cache)."""
    n = int(slots.shape[0])
    if n == 0:
        return None
    first, last = int(slots[0]), int(slots[-1])
    if last - first != n - 1 or (n > 2 and not bool((slots[1:] - slots[:-1] == 1).all())):
        return None
    return slice(first, last + 1)


def tree_mask(parents: list[int], prefix_len: int) -> torch.Tensor:
    """[1 + n, prefix_len + 1 + n] mask: the root token then n tree nodes, each sees the prefix,
    the root and its ancestors (SpecInfer / AdaServe tree attention)."""
    n = len(parents)
    mask = torch.zeros(1 + n, prefix_len + 1 + n, dtype=torch.bool)
    mask[:, : prefix_len + 1] = True
    for i, p in enumerate(parents):
        row = 1 + i
        if p >= 0:
            mask[row, prefix_len:] = mask[1 + p, prefix_len:]
        mask[row, prefix_len + row] = True
    return mask


# "auto" keeps the single padded call while it does at most this many times the attention work
# of the unpadded requests. Measured on CPU (SmolLM2-135M shapes, 1 thread, contexts 200-1000,
# median of 5): 256-token chunk + 16 decodes padded 6.1 s vs per-request 1.0 s; 32 decodes 1.0 s
# vs 0.59 s; 16 decodes 0.47 s vs 0.30 s. A CPU pass costs its work (gathered keys), not its
# call count, so any padding loses there. On a GPU a decode batch is launch-bound: one padded
# call per layer beats one per request, so it stays padded up to 2x waste (longest / mean
# context) and splits only batches like a prefill chunk padding every decode to 256 queries.
AUTO_MAX_PAD_WASTE = {"cpu": 1.0, "cuda": 2.0}


def choose_layout(segments: list[Segment], max_waste: float = AUTO_MAX_PAD_WASTE["cuda"]) -> str:
    """"padded" unless padding every request to the longest segment and key list costs more than
    ``max_waste`` x the real query-key pairs (mixed prefill + decode batches, uneven contexts)."""
    lens = [len(s.token_ids) for s in segments]
    keys = [int(s.key_slots.shape[0]) for s in segments]
    padded = len(segments) * max(lens) * max(keys)
    exact = sum(n * k for n, k in zip(lens, keys))
    return "padded" if padded <= max_waste * exact else "per-request"


def build_forward_batch(segments: list[Segment], device: torch.device,
                        layout: str = "auto") -> tuple[ForwardBatch, list[int]]:
    """Flattens segments; returns the batch and, per segment, the index of its first logits row.

    ``layout``: "padded" (one SDPA call over [R, Q, L] with a mask), "per-request" (one SDPA
    call per request, no padding) or "auto" (``choose_layout`` per batch)."""
    if layout == "auto":
        layout = choose_layout(segments, AUTO_MAX_PAD_WASTE.get(device.type, AUTO_MAX_PAD_WASTE["cuda"]))
    if layout == "per-request":
        return _per_request_batch(segments, device)
    lens = [len(s.token_ids) for s in segments]
    R, Q = len(segments), max(lens)
    L = max(int(s.key_slots.shape[0]) for s in segments)
    ids = torch.tensor([t for s in segments for t in s.token_ids], dtype=torch.long)
    positions = torch.cat([s.positions for s in segments])
    write = torch.cat([s.write_slots for s in segments])
    offsets = torch.tensor([0] + lens[:-1]).cumsum(0)
    ar_q = torch.arange(Q)
    n_t = torch.tensor(lens)
    valid_q = ar_q[None, :] < n_t[:, None]  # [R, Q]
    query_index = torch.where(valid_q, offsets[:, None] + ar_q[None, :], torch.zeros((), dtype=torch.long))
    unpad_index = (torch.arange(R)[:, None] * Q + ar_q[None, :])[valid_q]
    key_slots = torch.zeros(R, L, dtype=torch.long)
    uniform = all(n == 1 for n in lens) and all(s.mask is None for s in segments)
    needs_mask = not (uniform and all(int(s.key_slots.shape[0]) == L for s in segments))
    mask = torch.zeros(R, 1, Q, L, dtype=torch.bool) if needs_mask else None
    ar_l = torch.arange(L)
    for r, s in enumerate(segments):
        n, ln = lens[r], int(s.key_slots.shape[0])
        key_slots[r, :ln] = s.key_slots
        if mask is None:
            continue
        if s.mask is None:
            mask[r, 0, :n, :ln] = ar_l[None, :ln] <= (ln - n + torch.arange(n))[:, None]
        else:
            mask[r, 0, :n, :ln] = s.mask
        mask[r, 0, n:, 0] = True  # padded query rows attend one key (no NaN); their output is dropped
    rows, first = [], []
    for r, s in enumerate(segments):
        first.append(len(rows))
        base = int(offsets[r])
        rows.extend(range(base + s.logits_from, base + s.logits_from + s.logits_count))
    fb = ForwardBatch(
        input_ids=ids.to(device), positions=positions.to(device), write_slots=write.to(device),
        query_index=query_index.to(device), unpad_index=unpad_index.to(device), key_slots=key_slots.to(device),
        attn_mask=mask.to(device) if mask is not None else None,
        logit_rows=torch.tensor(rows, dtype=torch.long, device=device),
        key_range=contiguous_run(segments[0].key_slots) if R == 1 else None)
    return fb, first


def _per_request_batch(segments: list[Segment], device: torch.device) -> tuple[ForwardBatch, list[int]]:
    meta = []
    rows: list[int] = []
    first: list[int] = []
    t0 = 0
    for s in segments:
        n, ln = len(s.token_ids), int(s.key_slots.shape[0])
        if s.mask is not None:
            mask = s.mask
        elif n > 1:
            mask = torch.arange(ln)[None, :] <= (ln - n + torch.arange(n))[:, None]
        else:
            mask = None
        run = contiguous_run(s.key_slots)
        meta.append((t0, t0 + n, run if run is not None else s.key_slots.to(device),
                     mask.to(device) if mask is not None else None))
        first.append(len(rows))
        rows.extend(range(t0 + s.logits_from, t0 + s.logits_from + s.logits_count))
        t0 += n
    empty = torch.zeros(1, 1, dtype=torch.long, device=device)
    fb = ForwardBatch(
        input_ids=torch.tensor([t for s in segments for t in s.token_ids], dtype=torch.long, device=device),
        positions=torch.cat([s.positions for s in segments]).to(device),
        write_slots=torch.cat([s.write_slots for s in segments]).to(device),
        query_index=empty, unpad_index=empty[0], key_slots=empty, attn_mask=None,
        logit_rows=torch.tensor(rows, dtype=torch.long, device=device), per_request=meta)
    return fb, first
