"""Batch features the latency predictor reads (QoServe 3.6.1: requests, tokens, context lengths)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_runtime.executor.base import BatchPlan


@dataclass(frozen=True)
class BatchFeatures:
    num_prefill_tokens: int = 0  # prompt tokens computed this pass (all chunks)
    num_decode_tokens: int = 0  # pending decode tokens (one per decoding request)
    prefill_context_sum: int = 0  # sum over chunks of the context the chunk ends at (start + len)
    decode_context_sum: int = 0  # sum over decodes of the cached tokens they attend to
    tree_tokens: int = 0  # speculative tree nodes verified this pass
    num_requests: int = 0  # chunks + decodes
    prefill_attn: float = 0.0  # sum of len * (start + len/2): query x key pairs of the chunks

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens + self.tree_tokens

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict) -> BatchFeatures:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in names})

    @classmethod
    def from_plan(cls, plan: BatchPlan) -> BatchFeatures:
        p_tok = p_ctx = 0
        p_attn = 0.0
        for c in plan.prefills:
            n = len(c.token_ids)
            p_tok += n
            p_ctx += c.start + n
            p_attn += n * (c.start + n / 2)
        tree = 0
        d_ctx = 0
        for d in plan.decodes:
            d_ctx += d.position
            if d.tree is not None:
                tree += len(d.tree)
        return cls(p_tok, len(plan.decodes), p_ctx, d_ctx, tree, len(plan.prefills) + len(plan.decodes), p_attn)

    @classmethod
    def of_shape(cls, prefill_tokens: int = 0, prefill_start: int = 0, num_decodes: int = 0,
                 decode_context: int = 0, tree_tokens: int = 0, num_chunks: int | None = None) -> BatchFeatures:
        """A batch with one prefill chunk (or none) and ``num_decodes`` decodes of ``decode_context`` tokens each."""
        chunks = (1 if prefill_tokens else 0) if num_chunks is None else num_chunks
        return cls(prefill_tokens, num_decodes, (prefill_start + prefill_tokens) if prefill_tokens else 0,
                   num_decodes * decode_context, tree_tokens, chunks + num_decodes,
                   prefill_tokens * (prefill_start + prefill_tokens / 2))


FEATURE_NAMES = [f.name for f in fields(BatchFeatures)]
