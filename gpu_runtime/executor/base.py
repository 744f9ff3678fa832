"""The Executor protocol: what the engine asks of a real model or of the simulator.

Executors run what they are told and decide nothing (DESIGN.md, the one rule). The
same plan types go to ``TorchExecutor`` and ``SimExecutor``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from gpu_runtime.sampling import SamplingParams
from gpu_runtime.speculation.token_tree import TokenTree


@dataclass
class PrefillChunk:
    request_id: str
    start: int  # prompt position of token_ids[0] (= prompt tokens already cached)
    token_ids: list[int]  # the chunk's prompt tokens
    sample: bool  # this chunk finishes the prompt: sample the first output token
    # the chunk ends a recompute's prefill (prompt + outputs but the last): that last output, the pending token the
    # next decode feeds, so that the executor's view of the request's tokens (what drafts follow) ends with it
    pending_token_id: int | None = None


@dataclass
class DecodeEntry:
    request_id: str
    position: int  # position of token_id (= tokens already cached)
    token_id: int  # the pending token: last output, not yet in the KV cache
    tree: TokenTree | None = None  # draft nodes to verify after token_id (None = plain decode)


@dataclass
class BatchPlan:
    """One forward pass: prefill chunks, decodes and token trees together."""

    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[DecodeEntry] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.prefills)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens fed for decodes: the pending token plus every tree node."""
        return sum(1 + (len(d.tree) if d.tree else 0) for d in self.decodes)

    @property
    def num_tree_tokens(self) -> int:
        return sum(len(d.tree) for d in self.decodes if d.tree)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


@dataclass
class StepResult:
    # New output tokens per request: the first token of a finished prompt, or for a
    # decode the accepted tree tokens followed by the bonus token from the target.
    tokens: dict[str, list[int]] = field(default_factory=dict)
    # For decodes with a tree: indices of accepted tree nodes, root to leaf.
    accepted_nodes: dict[str, list[int]] = field(default_factory=dict)
    latency_s: float = 0.0  # measured (torch) or predicted (sim) wall time of the pass
    # prompts whose first chunk found this many of their tokens in the prefix cache (computed earlier in the same
    # pass: vLLM caches a block when it allocates it), so the pass computed only the rest (simulator)
    cached_tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class DraftEntry:
    request_id: str
    depth: int  # beam-search depth d
    width: int  # beam width w (top-w children kept per step)


def tree_depth_limit(context: int, outputs: int, max_tokens: int, max_model_len: int) -> int:
    """Deepest token tree worth verifying for a request whose ``context`` tokens (prompt and outputs, the pending
    one included, at position ``context - 1``) hold ``outputs`` output tokens. A depth-d tree yields at most d + 1
    tokens (accepted path + bonus), so deeper than the remaining max_tokens - 1 only burns compute on tokens that are
    cut; and its nodes sit at positions up to the pending one's + d, which must stay inside the model's context with
    room for the bonus token. It bounds a decode's KV too: a chain of drafts never takes a slot past prompt +
    max_tokens - 1, which the KV footprint of admission holds (``footprint_blocks``)."""
    return max(0, min(max_tokens - outputs - 1, max_model_len - context - 1))


# Asked by a drafter after each drafted depth d with every request's best path probability so far:
# whether to draft depth d + 1 (AdaSpec Alg. 1 on the real confidences); None: draft to each entry's depth.
KeepDrafting = Callable[[int, dict[str, float]], bool]


@dataclass
class DraftResult:
    trees: dict[str, TokenTree] = field(default_factory=dict)  # candidate tree per request
    latency_s: float = 0.0


@dataclass(frozen=True)
class KVCapacity:
    total_blocks: int
    free_blocks: int
    block_size: int  # tokens per block

    @property
    def usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0


@runtime_checkable
class Executor(Protocol):
    """Runs batches; owns the KV cache and the draft. Time comes from ``now()``."""

    max_model_len: int  # longest prompt + output the executor can hold
    eos_token_id: int | None

    def now(self) -> float:
        """Clock used for every QoS decision (monotonic, or simulated time)."""

    def capacity(self) -> KVCapacity:
        """Free-block accounting for the scheduler."""

    def blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        """Extra KV blocks ``request_id`` needs to cache ``num_new_tokens`` more tokens."""

    def add_request(self, request_id: str, sampling: SamplingParams, category: str | None = None,
                    cache_salt: str | None = None) -> None:
        """Register a request before its first prefill chunk; ``category`` is its application
        (the simulator draws acceptance per category; a real model ignores it); ``cache_salt``: the prefix-cache
        scope it shares blocks within (an executor with a prefix cache reads it)."""

    def free(self, request_id: str) -> None:
        """Release every KV block (target and draft) held by the request."""

    def release_kv(self, request_id: str) -> None:
        """Release the request's KV blocks (target and draft) but keep it registered (its sampling state):
        under memory pressure its prefill is recomputed from position 0 (recompute preemption)."""

    def step(self, plan: BatchPlan) -> StepResult:
        """Run one mixed forward pass and commit accepted tokens to the KV cache."""

    def draft(self, entries: list[DraftEntry], keep_drafting: KeepDrafting | None = None) -> DraftResult:
        """Expand candidate token trees for decoding requests (beam search / lookup); a drafter whose
        steps cost time asks ``keep_drafting`` before each further depth."""

    @property
    def has_draft(self) -> bool:
        """A drafter is configured (model or prompt lookup)."""

    @property
    def draft_on_device(self) -> bool:
        """The draft model's weights are in device memory (Nightjar elastic memory)."""

    @property
    def draft_offloadable(self) -> bool:
        """The drafter holds device memory (a draft model); a model-free drafter is never moved."""

    def offload_draft(self) -> int:
        """Move draft weights off the device; returns KV blocks gained (0 if none)."""

    def load_draft(self) -> bool:
        """Bring the draft back if memory allows; returns whether it is on device."""
