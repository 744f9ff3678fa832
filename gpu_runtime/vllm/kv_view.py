"""vLLM's KV cache as coserve's policies see it: the three executor calls ``KVBudget`` makes.

Admission control and recompute preemption in ``scheduler/base.py`` ask an executor how
many blocks are free, how many a request needs for ``n`` more tokens, and to release a
request's KV. Here the answers come from vLLM's block pool, and a release is vLLM's own
recompute preemption of that request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gpu_runtime.executor.base import KVCapacity

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vllm.v1.core.sched.scheduler import Scheduler as VLLMScheduler
    from vllm.v1.request import Request as VLLMRequest

log = logging.getLogger(__name__)


class VLLMKVView:
    """Read-mostly view of a vLLM scheduler's KV cache (``release_kv`` frees a request's blocks, ``keep_hits``
    reorders the free queue; nothing else changes it)."""

    def __init__(self, scheduler: VLLMScheduler) -> None:
        from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator

        self.scheduler = scheduler
        self.block_size = scheduler.block_size
        self.released: list[str] = []  # preempted on the policy's request, this schedule() call
        manager = scheduler.kv_cache_manager
        # one KV cache group hashed by whole blocks, the hit not cut a block short for EAGLE: a hit grows exactly when
        # the block after it is cached, and shrinks when its last block was evicted (vLLM frees a request's blocks
        # last to first, and a block's prefix is freed no earlier: eviction takes a cached prefix from its end)
        unitary = isinstance(manager.coordinator, UnitaryKVCacheCoordinator)
        exact = unitary and not manager.coordinator.eagle_group_ids and not manager.coordinator.enable_partial_hash_hits
        self._probe_groups = [0] if exact else None

    def capacity(self) -> KVCapacity:
        pool = self.scheduler.kv_cache_manager.block_pool
        # One block of vLLM's pool is its null block and never handed out.
        return KVCapacity(pool.num_gpu_blocks - 1, pool.get_num_free_blocks(), self.block_size)

    def blocks_needed(self, request_id: str, n: int) -> int:
        """Blocks vLLM allocates for the request's next ``n`` tokens (``allocate_slots``): also the slots of its
        lookahead (``_slots``), which vLLM takes for every prompt chunk and decode and preempts for where none is
        left."""
        req = self.scheduler.requests.get(request_id)
        have = req.num_computed_tokens if req is not None else 0
        bs = self.block_size
        if req is not None and not have:
            # a prompt not (re)started: the n tokens after its prefix-cache hit (which the policy counts computed),
            # and the hit's blocks too, which leave the free pool with it unless a running request holds them
            mirror = self.scheduler.mirrors.get(request_id)
            hit = mirror.num_cached_tokens if mirror is not None else 0
            return -(-self._slots(hit + n) // bs)
        # the blocks vLLM holds for it already: those of its computed tokens, and any it allocated ahead of them (the
        # slots of its draft tokens and lookahead), which the next tokens fill before a new block is needed
        held = len(self.scheduler.kv_cache_manager.coordinator.get_blocks(request_id)[0])
        return max(0, -(-self._slots(have + n) // bs) - max(held, -(-have // bs)))

    def footprint_slots(self, tokens: int) -> int:
        """The most KV slots vLLM allocates a request of ``tokens`` (prompt + output) over its life: its last
        decode computes the output's last token but one, with a whole draft step (``num_spec_tokens``: any
        drafter's, the n-gram and suffix ones' too; a prompt's 1-token first step is padded to one) and the
        lookahead (``_slots``). A prompt chunk or a recompute reaches no further. Scheduling asynchronously, vLLM
        schedules a decode while the step before is in flight, its drafts counted computed as if all accepted, and
        stops only once that step surely reached max_tokens: the last decode may start a draft step further. KV
        admission reserves it (``footprint_blocks``)."""
        steps = 2 if self.scheduler.scheduler_config.async_scheduling else 1
        return self._slots(tokens - 1 + steps * self.scheduler.num_spec_tokens)

    def _slots(self, tokens: int) -> int:
        """The KV slots vLLM gives a request whose scheduled tokens reach ``tokens`` (``allocate_slots``'
        num_tokens_need_slot): also its lookahead, the KV a draft model or EAGLE drafter writes past them
        (``num_lookahead_tokens``, 0 for the model-free drafters); none past the model's context."""
        return min(tokens + self.scheduler.num_lookahead_tokens, self.scheduler.max_model_len)

    @property
    def prefix_caching(self) -> bool:
        return bool(self.scheduler.kv_cache_manager.enable_caching)

    def prompt_blocks(self, request_id: str) -> list:
        """vLLM's names (block hashes) of the request's prompt blocks a hit may cover: whole blocks, never the last
        token (none where the request does not look its prefix up)."""
        req = self.scheduler.requests.get(request_id)
        manager = self.scheduler.kv_cache_manager
        if req is None or not manager.prefix_cache_lookup_enabled(req):
            return []
        return req.block_hashes[:(req.num_prompt_tokens - 1) // self.block_size]

    def cached_prefix(self, request: VLLMRequest) -> int:
        """Tokens of a new request's prompt that vLLM's prefix cache holds now: what its first schedule would find
        (whole blocks, never the last token, which is computed again for its logits; 0 with caching off)."""
        return self._cache_hit(request)[1]

    def _cache_hit(self, request: VLLMRequest) -> tuple[Sequence[list], int]:
        """vLLM's lookup of a new request's prompt in its prefix cache: the hit's blocks by KV cache group, and its
        tokens (none where the request does not look its prefix up)."""
        manager = self.scheduler.kv_cache_manager
        if not manager.prefix_cache_lookup_enabled(request) or not request.block_hashes:
            return (), 0
        groups, hit, _ = manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        return groups, hit

    def cached_prefix_since(self, request: VLLMRequest, before: int) -> int:
        """A waiting prompt's hit now, given the hit ``before``: looked up again only when the block after it was
        cached since (another request computed the same prefix) or the hit's last block was evicted since (vLLM
        would find it shorter and compute more than the policy planned), which costs at most two probes per waiting
        prompt and step (a full lookup where probes cannot tell: several KV cache groups, EAGLE's cut)."""
        if self._probe_groups is None:
            return self.cached_prefix(request)
        bs, hashes = self.block_size, request.block_hashes
        pool = self.scheduler.kv_cache_manager.block_pool
        last = before // bs - 1
        if last >= 0 and pool.get_cached_block(hashes[last], self._probe_groups) is None:
            return self.cached_prefix(request)  # shrank
        after = last + 1
        if (after + 1) * bs > request.num_tokens - 1 or after >= len(hashes):
            return before  # no whole block after the hit that the cache could hold
        if pool.get_cached_block(hashes[after], self._probe_groups) is None:
            return before
        return self.cached_prefix(request)

    def keep_hits(self, prompts: list[VLLMRequest]) -> None:
        """The prefix-cache hits of the new prompts the step starts leave the free queue's evicting end for the step.

        vLLM allocates for the running requests and for earlier prompts before it looks a later prompt's hit up,
        taking blocks from the free queue's least recently used end and evicting the prefixes they cached: a hit
        planned whole could be found shorter at its prompt's turn, and the prompt ran more than its chunk (taking the
        tokens of a chunk after it). Each prompt takes its hit's blocks out of the queue at its turn anyway, so they
        go to the most recently used end now (its last block nearest the evicting end, as vLLM frees a request's
        blocks), first prompt's furthest: the policy counted them among the blocks the step takes, so the step's
        allocations evict other free blocks first. One lookup per prompt started (what vLLM's own lookup costs)."""
        if not self.prefix_caching:
            return
        queue = self.scheduler.kv_cache_manager.block_pool.free_block_queue
        for request in reversed(prompts):
            if request.num_computed_tokens:
                continue
            for blocks in self._cache_hit(request)[0]:
                for block in reversed(blocks):
                    if block.ref_cnt == 0 and not block.is_null:  # free (in the queue), not held by a request
                        queue.remove(block)
                        queue.append(block)

    def restartable(self, request_id: str) -> bool:
        """Whether vLLM would restart the request (preempted) in the step being planned: not while output of a step
        in flight is still to come (async scheduling; vLLM delivers it first, ``num_stale_output_tokens``)."""
        req = self.scheduler.requests.get(request_id)
        return req is None or not req.num_stale_output_tokens or req.drop_stale_output

    def release_kv(self, request_id: str) -> None:
        """vLLM recompute preemption of a running request, chosen by the policy (least urgent first)."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req not in self.scheduler.running:
            return
        self.scheduler.running.remove(req)
        self.scheduler.preempt_for_policy(req)
        self.released.append(request_id)
