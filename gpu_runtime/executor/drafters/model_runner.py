"""Draft model runner: a second (small) model with its own paged KV cache.

Each draft call catches the draft's cache up on the request's tokens (prompt, outputs
and the pending token), then grows a candidate tree by beam search: the top-w children
of the root, then at every further depth the top-w of all w*V expansions ranked by
cumulative path probability (AdaServe section 4: f(v) = product of the draft's
conditionals along the path). Tree nodes go to scratch slots that are dropped after; a call reserves every
request's catch-up and scratch before its first depth runs, and a request the pool cannot hold drafts a shallower
tree, or none (``num_pool_short``), never failing the step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from gpu_runtime.executor.base import DraftEntry, KeepDrafting
from gpu_runtime.executor.drafters.base import Drafter
from gpu_runtime.executor.kv_blocks import BlockManager
from gpu_runtime.executor.torch.batch import Segment, build_forward_batch, request_slots
from gpu_runtime.executor.torch.model import PagedDecoder, kv_bytes_per_block
from gpu_runtime.speculation.token_tree import TokenTree

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from gpu_runtime.executor.torch.executor import TorchExecutor

log = logging.getLogger(__name__)
_CPU = torch.device("cpu")


class DraftModelRunner(Drafter):
    holds_device_memory = True  # weights and a KV pool: Nightjar may offload them
    def __init__(self, hf_model: PreTrainedModel, num_blocks: int | None = None, block_size: int = 16) -> None:
        self.hf_model = hf_model.eval()
        self.device = next(hf_model.parameters()).device
        self.block_size = block_size
        self._num_blocks = num_blocks
        self._mirrors_target = num_blocks is None  # pool sized as the target's block count at bind()
        self.decoder: PagedDecoder | None = None
        self.blocks: BlockManager | None = None
        self._offloaded: dict[str, torch.Tensor] | None = None
        # requests whose tree the draft KV pool could not hold (drafted shallower, or not at all): the pool mirrors
        # the target's block count, which KV admission counts, but not the beams' scratch slots of a draft call
        self.num_pool_short = 0

    @classmethod
    def from_pretrained(cls, spec: str, device: str = "cpu", dtype: torch.dtype | None = None,
                        **kwargs: Any) -> DraftModelRunner:
        from gpu_runtime.executor.torch.executor import load_hf

        hf, _ = load_hf(spec, device, dtype, tokenizer=False)  # it drafts on its target's token ids
        return cls(hf, **kwargs)

    def bind(self, executor: TorchExecutor) -> None:
        super().bind(executor)
        if self._num_blocks is None:  # as many blocks as the target: the draft never limits admission
            self._num_blocks = executor.blocks.total_blocks
        self._build()

    def memory_plan(self) -> tuple[int, int]:
        """Device bytes ``bind`` will still allocate, beyond the loaded weights, for the executor's
        pool sizing: (fixed bytes, bytes per target KV block). The KV pool is per target block when
        it mirrors the target's block count; stacking gate/up needs one layer's MLP as a transient
        (each layer's originals are freed as it is stacked)."""
        cfg = self.hf_model.config
        dtype = next(self.hf_model.parameters()).dtype
        elem = torch.empty((), dtype=dtype).element_size()
        stack = 2 * cfg.intermediate_size * cfg.hidden_size * elem
        per_block = kv_bytes_per_block(cfg, dtype, self.block_size)
        if self._mirrors_target:
            return stack, per_block
        return stack + (self._num_blocks or 0) * per_block, 0

    def _build(self) -> None:
        assert self._num_blocks is not None
        self.decoder = PagedDecoder(self.hf_model, 0, self.block_size)
        self.decoder.resize_cache(self._num_blocks)
        self.blocks = BlockManager(self._num_blocks, self.block_size)

    def free(self, request_id: str) -> None:
        if self.blocks is not None:
            self.blocks.free(request_id)

    # ---- drafting ----
    @torch.inference_mode()
    def draft(self, entries: list[DraftEntry], keep_drafting: KeepDrafting | None = None) -> dict[str, TokenTree]:
        if self.decoder is None or self.blocks is None:
            return {}
        entries = [e for e in entries if e.depth > 0 and e.width > 0]
        trees: dict[str, TokenTree] = {}
        history: dict[str, int] = {}
        segments: list[Segment] = []
        live: list[DraftEntry] = []
        for e in entries:  # the draft cache keeps only what the request still holds (no scratch, no cut outputs)
            self.blocks.truncate(e.request_id, min(self.blocks.num_tokens(e.request_id),
                                                   len(self.executor.token_ids(e.request_id)) - 1))
        # blocks not yet promised: every live request's catch-up and beam scratch is reserved before any depth runs
        unpromised = self.blocks.num_free
        short: list[str] = []
        for e in entries:  # 1) catch up on every token not yet in the draft cache (the pending one at least)
            tokens = self.executor.token_ids(e.request_id)
            cached = self.blocks.num_tokens(e.request_id)
            depth = self._depth_that_fits(e, len(tokens) - cached, unpromised)
            if depth < e.depth:
                short.append(e.request_id)
            if not depth:
                continue  # draft pool full: this request decodes without a tree this step
            e = DraftEntry(e.request_id, depth, e.width)
            unpromised -= self.blocks.blocks_needed(e.request_id, len(tokens) - cached + e.width * (depth - 1))
            self.blocks.allocate(e.request_id, len(tokens) - cached)
            slots = request_slots(self.blocks, e.request_id, len(tokens), _CPU)
            segments.append(Segment(tokens[cached:], torch.arange(cached, len(tokens)), slots[cached:], slots,
                                    logits_from=len(tokens) - cached - 1, logits_count=1))
            history[e.request_id] = len(tokens)
            trees[e.request_id] = TokenTree()
            live.append(e)
        if short:
            self.num_pool_short += len(short)
            log.info("draft KV pool short (%d of %d blocks free): %d of %d trees drafted shallower or not at all",
                     self.blocks.num_free, self.blocks.total_blocks, len(short), len(entries))
        if not live:
            return trees
        logits = self._run(segments)
        frontier: dict[str, list[int]] = {}
        for i, e in enumerate(live):  # depth 1: top-w children of the root
            probs = torch.softmax(logits[i], -1)
            top = probs.topk(min(e.width, probs.shape[-1]))
            tree = trees[e.request_id]
            frontier[e.request_id] = self._add(tree, top.indices.tolist(), [-1] * len(top.indices),
                                               top.values.tolist())
        fed: dict[str, list[int]] = {e.request_id: [] for e in live}
        for depth in range(2, max(e.depth for e in live) + 1):  # 2) one pass per further depth
            step = [e for e in live if e.depth >= depth and frontier[e.request_id]]
            if not step or (keep_drafting is not None and not keep_drafting(
                    depth - 1, {e.request_id: max(trees[e.request_id].path_probs[n] for n in frontier[e.request_id])
                                for e in step})):
                break
            segments = [self._frontier_segment(e.request_id, trees[e.request_id], frontier[e.request_id],
                                               fed[e.request_id], history[e.request_id]) for e in step]
            logits = self._run(segments)
            row = 0
            for e in step:
                rid, tree, nodes = e.request_id, trees[e.request_id], frontier[e.request_id]
                probs = torch.softmax(logits[row:row + len(nodes)], -1)
                row += len(nodes)
                paths = torch.tensor([tree.path_probs[n] for n in nodes], dtype=probs.dtype,
                                     device=probs.device)[:, None] * probs  # on the draft model's device
                top = paths.reshape(-1).topk(min(e.width, paths.numel()))  # top-w of all w*V expansions
                vocab = probs.shape[-1]
                parents = [nodes[i // vocab] for i in top.indices.tolist()]
                frontier[rid] = self._add(tree, [i % vocab for i in top.indices.tolist()], parents,
                                          top.values.tolist())
        for rid, n in history.items():
            self.blocks.truncate(rid, n)  # drop the scratch slots of the beams
        return trees

    def _depth_that_fits(self, entry: DraftEntry, catch_up: int, free_blocks: int) -> int:
        """Deepest tree, up to ``entry.depth``, whose catch-up and beam scratch (``width`` slots per depth past the
        first) fit ``free_blocks`` draft blocks; 0 where not even the catch-up fits."""
        assert self.blocks is not None
        depth = entry.depth
        while depth and self.blocks.blocks_needed(entry.request_id, catch_up + entry.width * (depth - 1)) > free_blocks:
            depth -= 1
        return depth

    @staticmethod
    def _add(tree: TokenTree, tokens: list[int], parents: list[int], path_probs: list[float]) -> list[int]:
        first = len(tree.token_ids)
        tree.token_ids.extend(tokens)
        tree.parents.extend(parents)
        tree.path_probs.extend(path_probs)
        return list(range(first, len(tree.token_ids)))

    def _frontier_segment(self, rid: str, tree: TokenTree, nodes: list[int], fed: list[int], hist: int) -> Segment:
        """The frontier's tokens at scratch slots after the history; each sees the history and its ancestors."""
        assert self.blocks is not None
        self.blocks.allocate(rid, len(nodes))
        first_new = hist + len(fed)
        fed.extend(nodes)
        slots = request_slots(self.blocks, rid, hist + len(fed), _CPU)
        where = {node: hist + k for k, node in enumerate(fed)}
        mask = torch.zeros(len(nodes), hist + len(fed), dtype=torch.bool)
        mask[:, :hist] = True
        depths = tree.depths()
        for r, node in enumerate(nodes):
            for a in tree.ancestors(node):
                mask[r, where[a]] = True
        positions = torch.tensor([hist - 1 + depths[n] for n in nodes])
        return Segment([tree.token_ids[n] for n in nodes], positions, slots[first_new:], slots, mask=mask,
                       logits_from=0, logits_count=len(nodes))

    def _run(self, segments: list[Segment]) -> torch.Tensor:
        assert self.decoder is not None
        fb, _ = build_forward_batch(segments, self.device)
        return self.decoder.forward(fb)

    # ---- elastic memory (Nightjar) ----
    @property
    def on_device(self) -> bool:
        return self.decoder is not None

    def device_bytes(self) -> int:
        """Weights (the stacked MLP replaces the model's gate/up storage) plus the draft KV pool."""
        if self.decoder is not None:
            return self.decoder.device_bytes()
        if not self._offloaded:
            return 0
        params = sum(p.numel() * p.element_size() for p in self._offloaded.values())
        dtype = next(iter(self._offloaded.values())).dtype
        kv = (self._num_blocks or 0) * kv_bytes_per_block(self.hf_model.config, dtype, self.block_size)
        return params + kv  # what load() will bring back

    def offload(self) -> int:
        """Weights go to host memory (fresh storage even when the device is the CPU); KV is dropped."""
        if self.decoder is None:
            return 0
        freed = self.decoder.device_bytes()
        self._offloaded = {}
        for name, p in self.hf_model.named_parameters():
            self._offloaded[name] = p.detach().to("cpu", copy=True)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.decoder = None
        self.blocks = None  # the draft KV is gone: requests catch up again after load()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def load(self) -> None:
        if self.decoder is not None or self._offloaded is None:
            return
        for name, p in self.hf_model.named_parameters():
            p.data = self._offloaded[name].to(self.device, copy=True)
        self._offloaded = None
        self._build()
