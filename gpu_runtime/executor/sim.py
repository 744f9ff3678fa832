"""SimExecutor: the Executor protocol on a virtual clock advanced by a cost model.

Every pass "takes" the cost model's predicted latency (optionally with noise); the KV
cache is the same pure-Python block manager as the real executor's; drafts are
synthetic trees whose acceptance comes from an ``AcceptanceModel``. Output tokens are
placeholders (never EOS), so requests finish at ``max_tokens``.

The simulated draft occupies ``draft_blocks`` KV blocks' worth of device memory: offloading
it grows the pool by that much and reloading shrinks it back (Nightjar section 5), like
TorchExecutor. A request the draft skipped for some steps (speculation off) pays a
catch-up prefill on its next draft: ``draft_switch_cost``, Nightjar's c_prefill(L_max, B).

With ``prefix_caching`` it keeps vLLM's automatic prefix cache (``prefix_cache.py``): every full block a request
computed is named by its content, a prompt not started yet finds the blocks of its prefix that are resident
(``cached_prefix``) and starts with them shared (``share_prefix``: no compute, no new memory), and a freed block
stays cached until the pool needs its memory. Off by default: trace requests have placeholder prompts, all alike.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

from gpu_runtime.costmodel.base import batch_time, decode_step_time
from gpu_runtime.costmodel.features import BatchFeatures
from gpu_runtime.executor.base import (
    BatchPlan,
    DraftEntry,
    DraftResult,
    KeepDrafting,
    PrefillChunk,
    StepResult,
    tree_depth_limit,
)
from gpu_runtime.executor.kv_blocks import BlockManager, PagedKV, context_that_fits
from gpu_runtime.executor.prefix_cache import PrefixCache, block_hashes, salt_root
from gpu_runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from gpu_runtime.costmodel.calibration import InPlaceCalibration
    from gpu_runtime.costmodel.base import CostModel
    from gpu_runtime.sim.acceptance import AcceptanceModel
    from gpu_runtime.speculation.token_tree import TokenTree

log = logging.getLogger(__name__)

SIM_TOKEN = 7  # placeholder id of every generated token


class SimExecutor(PagedKV):
    def __init__(self, cost_model: CostModel, kv_blocks: int = 1 << 20, block_size: int = 16,
                 max_model_len: int = 1 << 20, acceptance: AcceptanceModel | None = None,
                 draft_cost_s: float = 0.0, noise: float = 0.0, seed: int = 0, draft_blocks: int = 0,
                 draft_cpu_s_per_request: float = 0.0, draft_cpu_s_per_context_token: float = 0.0,
                 prefix_caching: bool = False) -> None:
        self.cost_model = cost_model
        self.blocks = BlockManager(kv_blocks, block_size)
        # a request longer than the whole cache could never finish: refused at admission, never left waiting
        self.max_model_len = context_that_fits(max_model_len, kv_blocks, block_size)
        self.eos_token_id: int | None = None
        self.acceptance = acceptance
        self.draft_cost_s = draft_cost_s  # seconds per draft pass (one per tree level): a draft model
        # A model-free drafter (prompt lookup) costs host time per request instead: a fixed part
        # plus a scan of the request's context, serial over the drafted requests.
        self.draft_cpu_s_per_request = draft_cpu_s_per_request
        self.draft_cpu_s_per_context_token = draft_cpu_s_per_context_token
        self.noise = noise  # relative std of the latency around the prediction
        self.rng = random.Random(seed)
        self.clock = 0.0
        self.categories: dict[str, str | None] = {}  # request -> acceptance category
        self.num_steps = 0
        self._draft_on_device = acceptance is not None
        self.draft_blocks = draft_blocks  # device memory of the draft (weights + its KV), in KV blocks
        self._draft_synced: dict[str, tuple[int, int]] = {}  # request -> (step, tokens) when last drafted
        self.calibration: InPlaceCalibration | None = None  # fed every step's cost, as vLLM's scheduler feeds it
        self.prefix_cache = PrefixCache() if prefix_caching else None
        self._prompt_blocks: dict[str, list[int]] = {}  # request -> names of its prompt's cacheable blocks
        self._held: dict[str, list[int]] = {}  # request -> names of the full blocks its KV has, in order
        self._tail: dict[str, list[int]] = {}  # request -> tokens of its KV after its last full block
        self._roots: dict[str, int] = {}  # request -> what its first block's name is chained to (its cache salt)
        self._max_tokens: dict[str, int] = {}  # request -> its max_tokens (``add_request``)
        self._prompt_lens: dict[str, int] = {}  # request -> its prompt's length, once its last chunk ran

    # ---- clock ----
    def now(self) -> float:
        return self.clock

    def advance_to(self, t: float) -> None:
        self.clock = max(self.clock, t)

    # ---- KV ----
    def add_request(self, request_id: str, sampling: SamplingParams, category: str | None = None,
                    cache_salt: str | None = None) -> None:
        self.categories[request_id] = category
        self._max_tokens[request_id] = sampling.max_tokens
        if cache_salt is not None:  # vLLM's cache_salt: only prompts with the same salt share blocks
            self._roots[request_id] = salt_root(cache_salt)

    def free(self, request_id: str) -> None:
        self.blocks.free(request_id)
        self._prompt_blocks.pop(request_id, None)
        self._uncache(request_id)
        self._roots.pop(request_id, None)
        self.categories.pop(request_id, None)
        self._draft_synced.pop(request_id, None)
        self._max_tokens.pop(request_id, None)
        self._prompt_lens.pop(request_id, None)

    def release_kv(self, request_id: str) -> None:
        self.blocks.free(request_id)
        self._draft_synced.pop(request_id, None)
        self._uncache(request_id)

    # ---- prefix cache ----
    @property
    def prefix_caching(self) -> bool:
        return self.prefix_cache is not None

    def cached_prefix(self, request_id: str, prompt_token_ids: list[int], known: int = 0) -> int:
        """Tokens of the prompt's prefix the cache holds, in whole blocks and at most all but its last token (vLLM
        computes the last to sample from it). ``known``: a hit found before; only the block after it is probed
        unless that one is resident too (one lookup a step for a prompt that waits)."""
        names = self._prompt_blocks.get(request_id)
        if names is None:
            names = self._prompt_blocks[request_id] = block_hashes(prompt_token_ids[:-1], self.blocks.block_size,
                                                                   self._root(request_id))
        k = known // self.blocks.block_size
        if self.prefix_cache is None or k >= len(names) or names[k] not in self.prefix_cache:
            return known
        return self.prefix_cache.leading_hits(names, k) * self.blocks.block_size

    def _root(self, request_id: str) -> int:
        """What the request's first block is chained to: its cache salt's root, else 0 (the salt-less scope)."""
        return self._roots.get(request_id, 0)

    def prompt_blocks(self, request_id: str) -> list[int]:
        """Names of the prompt's cacheable blocks (``cached_prefix`` computed them; none before)."""
        return self._prompt_blocks.get(request_id, [])

    def share_prefix(self, request_id: str, num_tokens: int) -> None:
        """The request, not started, starts with the first ``num_tokens`` of its prompt (``cached_prefix``'s) in
        the cached blocks: it holds them, and computes and pays memory for the rest only."""
        self._share(request_id, self._prompt_blocks[request_id][:num_tokens // self.blocks.block_size])

    def _share(self, request_id: str, names: list[int]) -> None:
        """The request starts with the blocks ``names`` (its prompt's first, cached): it holds those it did not yet,
        in place of blocks of its own."""
        held = self._held.setdefault(request_id, [])
        more = names[len(held):]
        self.prefix_cache.hold(more)
        held += more
        self.blocks.share(request_id, len(names) * self.blocks.block_size)

    def _past_cached_prefix(self, chunk: PrefillChunk, result: StepResult) -> PrefillChunk:
        """A prompt's first chunk starts past the blocks of it the cache holds, those an earlier chunk of the same
        pass put there included (vLLM names a block when it allocates it, and the pass writes a layer's KV before
        its attention reads it); at most all but the prompt's last token, and never past the chunk (vLLM's hit may
        reach past the tokens the policy planned for the prompt; the plan's end bounds it here)."""
        bs = self.blocks.block_size
        names = block_hashes(chunk.token_ids[:-1] if chunk.sample else chunk.token_ids, bs,
                             self._root(chunk.request_id))
        hit = self.prefix_cache.leading_hits(names)
        if not hit:
            return chunk
        self._share(chunk.request_id, names[:hit])
        result.cached_tokens[chunk.request_id] = hit * bs
        return PrefillChunk(chunk.request_id, hit * bs, chunk.token_ids[hit * bs:], chunk.sample)

    def _cache_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Tokens written to the request's KV: each block they fill is named and held (cached)."""
        held = self._held.setdefault(request_id, [])
        tail = self._tail.setdefault(request_id, [])
        tail += token_ids
        bs = self.blocks.block_size
        if len(tail) >= bs:
            full = len(tail) // bs * bs
            names = block_hashes(tail[:full], bs, held[-1] if held else self._root(request_id))
            self.prefix_cache.hold(names)
            held += names
            del tail[:full]

    def _uncache(self, request_id: str) -> None:
        """The request's KV is gone: its blocks stay cached, idle, as long as the pool's free memory holds them."""
        if self.prefix_cache is None:
            return
        self.prefix_cache.release(self._held.pop(request_id, []))
        self._tail.pop(request_id, None)
        self.prefix_cache.evict_to(self.blocks.num_free)

    # ---- passes ----
    def step(self, plan: BatchPlan) -> StepResult:
        result = StepResult()
        priced = []
        for c in plan.prefills:
            if self.prefix_cache is not None and c.request_id not in self.blocks.tables:
                if c.start:  # the policy planned it past blocks a prompt before it in this pass caches
                    self.share_prefix(c.request_id, c.start)
                    result.cached_tokens[c.request_id] = c.start
                else:
                    c = self._past_cached_prefix(c, result)
            priced.append(c)
            if self.blocks.allocate(c.request_id, len(c.token_ids)) is None:
                raise RuntimeError(f"KV exhausted for prefill of {c.request_id}")
            if self.prefix_cache is not None:
                self._cache_tokens(c.request_id, c.token_ids)
            if c.sample:
                result.tokens[c.request_id] = [SIM_TOKEN]
                self._prompt_lens.setdefault(c.request_id, c.start + len(c.token_ids))  # a recompute samples none
        tables, bs = self.blocks.tables, self.blocks.block_size
        for d in plan.decodes:
            tree = d.tree
            n = 1 + (len(tree) if tree else 0)
            table = tables.get(d.request_id)
            if table is not None and table.num_tokens + n <= len(table.blocks) * bs:
                table.num_tokens += n  # fast path: the last block has room (no new block)
            elif self.blocks.allocate(d.request_id, n) is None:
                raise RuntimeError(f"KV exhausted for decode of {d.request_id}")
            accepted: list[int] = []
            if tree and self.acceptance is not None:
                accepted = self.acceptance.sample_accepted(tree, self.categories.get(d.request_id), self.rng)
                result.accepted_nodes[d.request_id] = accepted
                # Rejected tree slots are scratch: keep pending token + accepted path.
                self.blocks.truncate(d.request_id, d.position + 1 + len(accepted))
            result.tokens[d.request_id] = [SIM_TOKEN] * (len(accepted) + 1)
            if self.prefix_cache is not None:  # the step wrote the fed token's KV and the accepted path's
                self._cache_tokens(d.request_id, [d.token_id] + [SIM_TOKEN] * len(accepted))
        if self.prefix_cache is not None:
            self.prefix_cache.evict_to(self.blocks.num_free)  # the step's new blocks took idle ones' memory
        features = BatchFeatures.from_plan(BatchPlan([c for c in priced if c.token_ids], plan.decodes)
                                           if self.prefix_cache is not None else plan)
        latency = self.cost_model.predict(features)
        if self.noise:
            latency *= max(0.5, 1.0 + self.rng.gauss(0.0, self.noise))
        if self.calibration is not None:
            self.calibration.observe(features, latency)
        result.latency_s = latency
        self.clock += latency
        self.num_steps += 1
        return result

    def draft(self, entries: list[DraftEntry], keep_drafting: KeepDrafting | None = None) -> DraftResult:
        out = DraftResult()
        if self.acceptance is None:
            return out
        depth = lag_max = lagging = 0
        cpu_s = 0.0
        tables = self.blocks.tables
        entries = [e for e in map(self._within_depth_limit, entries) if e.depth > 0]
        for e in entries:
            out.trees[e.request_id] = self.acceptance.draft_tree(self.categories.get(e.request_id), e.depth, e.width,
                                                                 self.rng)
            depth = max(depth, e.depth)
            table = tables.get(e.request_id)
            tokens = table.num_tokens if table is not None else 0
            cpu_s += self.draft_cpu_s_per_request + self.draft_cpu_s_per_context_token * tokens
            synced = self._draft_synced.get(e.request_id)
            if synced is not None and self.num_steps - synced[0] > 1:  # skipped steps: the draft lags
                lag_max, lagging = max(lag_max, tokens - synced[1]), lagging + 1
            self._draft_synced[e.request_id] = (self.num_steps, tokens)
        if keep_drafting is not None and self.draft_cost_s > 0:  # a draft model asks before each further depth
            depth = _depth_reached(out.trees, {e.request_id: e.depth for e in entries}, keep_drafting)
            out.trees = {rid: t.up_to_depth(depth) for rid, t in out.trees.items()}
        out.latency_s = (self.draft_cost_s * depth + cpu_s
                         + (self.draft_switch_cost(lag_max, lagging) if lagging else 0.0))
        self.clock += out.latency_s
        return out

    def _within_depth_limit(self, entry: DraftEntry) -> DraftEntry:
        """The entry no deeper than the request's tree may be (``tree_depth_limit``, as the own engine's executor
        cuts it): a decode near its max_tokens verifies a shorter tree, and its drafts' KV stays inside the
        prompt + max_tokens admission reserves. A request the engine did not add (no max_tokens) is not cut."""
        max_tokens, prompt_len = self._max_tokens.get(entry.request_id), self._prompt_lens.get(entry.request_id)
        if max_tokens is None or prompt_len is None:
            return entry
        context = self.blocks.num_tokens(entry.request_id) + 1  # its KV, and the pending token
        limit = tree_depth_limit(context, context - prompt_len, max_tokens, self.max_model_len)
        return DraftEntry(entry.request_id, min(entry.depth, limit), entry.width) if entry.depth > limit else entry

    def draft_switch_cost(self, l_max: int, batch: int) -> float:
        """c_prefill(L_max, B): a draft prefill of ``l_max`` tokens for ``batch`` requests, the
        target's prefill/decode latency ratio from the cost model applied to the draft's step."""
        if l_max <= 0 or batch <= 0 or self.draft_cost_s <= 0:
            return 0.0
        ratio = batch_time(self.cost_model, l_max * batch) / max(1e-9, decode_step_time(self.cost_model, batch))
        return self.draft_cost_s * ratio

    @property
    def has_draft(self) -> bool:
        return self.acceptance is not None and self._draft_on_device

    @property
    def draft_on_device(self) -> bool:
        return self._draft_on_device

    @property
    def draft_offloadable(self) -> bool:
        """A simulated draft model with memory to give back (draft_blocks > 0)."""
        return self.acceptance is not None and self.draft_blocks > 0

    def offload_draft(self) -> int:
        """The draft leaves the device: its blocks join the KV pool; it must catch up after reload."""
        if not self.draft_offloadable or not self._draft_on_device:
            return 0
        self._draft_on_device = False
        self.blocks.grow(self.draft_blocks)
        # The draft's KV is gone: after the reload each request catches up on its whole context.
        self._draft_synced = {rid: (-2, 0) for rid in self._draft_synced}
        return self.draft_blocks

    def load_draft(self) -> bool:
        """Back on the device if the blocks it gave (top of the id range) are free again."""
        if self.acceptance is None:
            return False
        if self._draft_on_device or not self.draft_offloadable:
            self._draft_on_device = True
            return True
        removed = self.blocks.shrink(self.draft_blocks)
        if removed < self.draft_blocks:  # live requests hold some of them: stay offloaded
            self.blocks.grow(removed)
            return False
        self._draft_on_device = True
        return True


def _depth_reached(trees: dict[str, TokenTree], depths: dict[str, int], keep_drafting: KeepDrafting) -> int:
    """The depth a drafter that asks ``keep_drafting`` after each depth stops at, for trees drawn whole:
    at depth d it passes the best path probability at d of each request drafted deeper than d."""
    node_depth = {rid: t.depths() for rid, t in trees.items()}
    deepest = max(depths.values(), default=0)
    for d in range(1, deepest):
        best = {rid: max(p for p, x in zip(t.path_probs, node_depth[rid]) if x == d)
                for rid, t in trees.items() if depths[rid] > d and d in node_depth[rid]}
        if not best or not keep_drafting(d, best):
            return d
    return deepest

