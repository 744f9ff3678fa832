"""The engine's speculative decoding totals since it started, as vLLM's scheduler counts them
(``vllm/v1/spec_decode/metrics.py`` SpecDecodingStats): the worker exports them under vLLM's counter names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class SpecDecodeCounts:
    num_drafts: int = 0  # requests a step verified draft tokens for, once a step each
    num_draft_tokens: int = 0  # the draft tokens (tree nodes) those steps verified
    num_accepted_tokens: int = 0  # those the target accepted
    # [i]: drafts whose accepted path reached depth i + 1 (vLLM's accepted tokens per draft position)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, verified: Mapping[str, int], accepted: Mapping[str, Sequence[int]]) -> None:
        """One step: each request's verified draft tokens, and the nodes it accepted (root to leaf)."""
        for request_id, drafted in verified.items():
            if drafted <= 0:
                continue
            depth = len(accepted.get(request_id, ()))
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += depth
            if depth > len(self.num_accepted_tokens_per_pos):
                self.num_accepted_tokens_per_pos += [0] * (depth - len(self.num_accepted_tokens_per_pos))
            for pos in range(depth):
                self.num_accepted_tokens_per_pos[pos] += 1
