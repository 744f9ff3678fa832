"""Our own forward pass of a Llama/Qwen2-family decoder over a paged KV cache.

Weights and config come from a loaded ``transformers`` model (we keep references to
its parameters; the one tensor we build, the stacked gate/up MLP weight, takes over the
model's own gate/up storage so no weight is held twice); attention reads keys/values from the paged cache so one
pass can mix prefill chunks, decodes and token trees of many requests.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


@dataclass
class ForwardBatch:
    """Flattened tokens of one pass plus the padded per-request attention layout.

    T tokens in total, R requests, at most Q new tokens and L keys per request."""

    input_ids: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T] absolute positions (RoPE)
    write_slots: torch.Tensor  # [T] flat cache slot each token's K/V is written to
    query_index: torch.Tensor  # [R, Q] index into T per padded query row (pads -> 0)
    unpad_index: torch.Tensor  # [T] row of the flattened [R*Q] attention output for each token
    key_slots: torch.Tensor  # [R, L] flat cache slots read as keys (pads -> 0)
    attn_mask: torch.Tensor | None  # [R, 1, Q, L] bool, True = attend; None = all visible
    logit_rows: torch.Tensor  # [N] tokens whose next-token logits are needed
    # layout "per-request": (first token, end token, key slots [L_r] or a slice, mask [n_r, L_r] or None) per
    # request; attention then runs one SDPA call per request instead of one padded call (query_index etc. unused)
    per_request: list[tuple[int, int, torch.Tensor | slice, torch.Tensor | None]] | None = None
    # R == 1 and its key slots form one ascending run: keys are read as a view of the cache, no gather
    key_range: slice | None = None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up projections stacked: one matmul
    down: torch.Tensor
    # oneDNN-prepacked copies of q/k/v/o/gate_up/down (CPU float32, see ``prepack_cpu_weights``);
    # None: the projections run on the dense tensors above through F.linear
    packed: dict[str, torch.Tensor] | None = None

    def linear(self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _linear(x, getattr(self, name), self.packed[name] if self.packed is not None else None, bias)


def _linear(x: torch.Tensor, dense: torch.Tensor, packed: torch.Tensor | None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """One row: MKL's gemv on the dense weight (~10% faster than oneDNN there); more rows: the
    oneDNN-prepacked weight when there is one (MKL's sgemm repacks the weight on every call)."""
    if packed is not None and x.shape[0] > 1:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, dense, bias)


# Batch-size hint oneDNN packs the weights for; verification passes of 2-16 tokens at batch 1
# are the case the packing is for (any token count still runs on the packed weights).
PREPACK_BATCH_HINT = 8


# SDPA kernels on a GPU, cuDNN's left out: it builds an execution plan for every new shape, and a decode's key
# length grows by one every step, so each layer's call paid 1.4-2.7 ms of host time for 8 us of GPU work (H100,
# torch 2.11, Llama-3.1-8B / 3.2-1B shapes at batch 1: 61% / 76% of the host time, 64 / 68 ms steps, 31 / 13-16 ms
# without it; ops/bench_engine.py --gpu --profile). Flash attention takes unmasked calls, the memory-efficient
# kernel masked ones, math the rest.
GPU_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacked fp32 linears exist on this CPU build of torch."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a [out, in] weight (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PREPACK_BATCH_HINT)


def kv_bytes_per_block(config: object, dtype: torch.dtype, block_size: int) -> int:
    """K and V bytes of one block over all layers, from a config alone (sizing pools before building them)."""
    heads = config.num_attention_heads  # type: ignore[attr-defined]
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # type: ignore[attr-defined]
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * kv_heads * head_dim * elem  # type: ignore[attr-defined]


class PagedDecoder:
    """Decoder weights + paged K/V: one tensor [blocks * block_size, kv_heads, head_dim] per layer.

    Per-layer tensors (not one [layers, ...] tensor) so the pool can be resized one layer
    at a time: growing or cutting it then needs one layer of extra memory, not a second pool."""

    def __init__(self, hf_model: PreTrainedModel, num_blocks: int, block_size: int,
                 prepack_cpu_weights: bool = False) -> None:
        cfg = hf_model.config
        inner = hf_model.model
        self.config = cfg
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.eps = cfg.rms_norm_eps
        self.block_size = block_size
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = hf_model.lm_head.weight  # tied models share the embedding tensor
        # the config's RoPE variant (default, llama3, linear, yarn, ...) as transformers computes it
        self.inv_freq = inner.rotary_emb.inv_freq.float()
        self.rope_scale = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))
        self.layers = [self._layer(layer) for layer in inner.layers]
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.k_cache: list[torch.Tensor] = [self._empty_layer(num_blocks) for _ in self.layers]
        self.v_cache: list[torch.Tensor] = [self._empty_layer(num_blocks) for _ in self.layers]
        self.lm_head_packed: torch.Tensor | None = None
        if prepack_cpu_weights and can_prepack(self.device, self.dtype):
            self.prepack_cpu_weights()

    def prepack_cpu_weights(self) -> None:
        """Run every projection and the LM head on oneDNN-prepacked copies of the weights (CPU).

        Why: MKL's sgemm repacks the weight on every call, so on CPU a pass of 2-9 tokens
        (a verification step at batch 1) cost ~1.8-2.2x a one-token pass (gemv) although both
        are bound by reading the weights; on the packed weights 2 tokens cost ~1.15x and 9
        tokens ~1.6x on one thread (ops/profile_spec_step.py --compare-prepack). One-row passes
        (plain decode at batch 1) stay on MKL's gemv, slightly faster there (``_linear``).
        Cost: a second copy of the weights in host memory (the transformers model keeps its
        own, which tests and ``generate`` baselines read)."""
        for w in self.layers:
            w.packed = {name: prepack(getattr(w, name)) for name in ("q", "k", "v", "o", "gate_up", "down")}
        self.lm_head_packed = prepack(self.lm_head)
        log.info("CPU weights prepacked for oneDNN (%d layers + LM head)", len(self.layers))

    @staticmethod
    def _layer(layer: torch.nn.Module) -> LayerWeights:
        att, mlp = layer.self_attn, layer.mlp
        bias = lambda lin: lin.bias.detach() if lin.bias is not None else None  # noqa: E731 (Qwen2 q/k/v bias)
        return LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(),
            q=att.q_proj.weight.detach(), k=att.k_proj.weight.detach(), v=att.v_proj.weight.detach(),
            q_bias=bias(att.q_proj), k_bias=bias(att.k_proj), v_bias=bias(att.v_proj),
            o=att.o_proj.weight.detach(), post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=_stack_gate_up(mlp), down=mlp.down_proj.weight.detach())

    # ---- cache tensors ----
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.config, self.dtype, self.block_size)

    @property
    def num_slots(self) -> int:
        return int(self.k_cache[0].shape[0]) if self.k_cache else 0

    def _empty_layer(self, num_blocks: int) -> torch.Tensor:
        shape = (num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def resize_cache(self, num_blocks: int) -> None:
        """Grow (zero-filled) or cut the pool to ``num_blocks``, keeping the slots that stay.

        One layer's K (then V) at a time, dropping the old tensor before the next: the peak
        extra memory is one layer's tensor, where a whole-pool cat/clone would hold the old
        and the new pool together (Nightjar grows the pool exactly when memory is tight)."""
        if self.k_cache and num_blocks * self.block_size == self.num_slots:
            return
        keep = min(num_blocks * self.block_size, self.num_slots)
        for cache in (self.k_cache, self.v_cache):
            for li in range(len(cache)):
                new = self._empty_layer(num_blocks)
                new[:keep] = cache[li][:keep]
                cache[li] = new  # the old layer tensor is released here

    def device_bytes(self) -> int:
        """Device memory held: weights (each storage once, incl. the stacked MLP) and the KV pool."""
        tensors: list[torch.Tensor | None] = [self.embed, self.final_norm, self.lm_head, *self.k_cache, *self.v_cache]
        packed: list[torch.Tensor] = [self.lm_head_packed] if self.lm_head_packed is not None else []
        for w in self.layers:
            tensors += [w.input_norm, w.q, w.k, w.v, w.q_bias, w.k_bias, w.v_bias, w.o, w.post_norm, w.gate_up,
                        w.down]
            packed += list(w.packed.values()) if w.packed else []
        # opaque mkldnn tensors have no storage to share: counted by their element count
        return _unique_bytes(tensors) + sum(t.numel() * t.element_size() for t in packed)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move K/V of accepted tree nodes from their scratch slots into place (all layers)."""
        for cache in (self.k_cache, self.v_cache):
            for layer in cache:
                layer[dst] = layer[src]

    # ---- the pass ----
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], -1)
        return ((emb.cos() * self.rope_scale).to(self.dtype)[:, None, :],
                (emb.sin() * self.rope_scale).to(self.dtype)[:, None, :])

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def _attend_per_request(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                            meta: list[tuple[int, int, torch.Tensor | slice, torch.Tensor | None]],
                            scale: float) -> torch.Tensor:
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        gqa = self.num_kv_heads != self.num_heads
        for t0, t1, slots, mask in meta:
            qs = q[t0:t1].transpose(0, 1)[None]  # [1, H, n, D]
            if isinstance(slots, slice):  # one contiguous run of slots: a view, no copy
                keys, vals = kc[slots].transpose(0, 1)[None], vc[slots].transpose(0, 1)[None]
            else:  # index_select: ~3x cheaper than kc[slots] on CPU
                keys = kc.index_select(0, slots).transpose(0, 1)[None]
                vals = vc.index_select(0, slots).transpose(0, 1)[None]
            att = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[t0:t1] = att[0].transpose(0, 1).reshape(t1 - t0, -1)
        return out

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Runs every layer, writes the new tokens' K/V, returns logits [N, vocab] (float32)."""
        with sdpa_kernel(GPU_ATTENTION_BACKENDS) if self.device.type == "cuda" else nullcontext():
            return self._forward(fb)

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        n_tok = fb.input_ids.shape[0]
        R, Q = fb.query_index.shape
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(fb.input_ids, self.embed)
        cos, sin = self._rope(fb.positions)
        scale = D ** -0.5
        for li, w in enumerate(self.layers):
            h = self._rms(x, w.input_norm)
            q = w.linear("q", h, w.q_bias).view(n_tok, H, D)
            k = w.linear("k", h, w.k_bias).view(n_tok, KVH, D)
            v = w.linear("v", h, w.v_bias).view(n_tok, KVH, D)
            q = self._rotate(q, cos, sin)
            k = self._rotate(k, cos, sin)
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc.index_copy_(0, fb.write_slots, k)
            vc.index_copy_(0, fb.write_slots, v)
            if fb.per_request is not None:
                att = self._attend_per_request(q, kc, vc, fb.per_request, scale)
            else:
                if fb.key_range is not None:
                    keys = kc[fb.key_range].view(1, -1, KVH, D).transpose(1, 2)  # [1, KVH, L, D], a view
                    vals = vc[fb.key_range].view(1, -1, KVH, D).transpose(1, 2)
                else:
                    flat = fb.key_slots.view(-1)
                    keys = kc.index_select(0, flat).view(R, -1, KVH, D).transpose(1, 2)  # [R, KVH, L, D]
                    vals = vc.index_select(0, flat).view(R, -1, KVH, D).transpose(1, 2)
                qs = q[fb.query_index].transpose(1, 2)  # [R, H, Q, D]
                att = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=fb.attn_mask, scale=scale,
                                                     enable_gqa=KVH != H)
                att = att.transpose(1, 2).reshape(R * Q, H * D)[fb.unpad_index]
            x = x + w.linear("o", att)
            h = self._rms(x, w.post_norm)
            gate, up = w.linear("gate_up", h).chunk(2, -1)
            x = x + w.linear("down", F.silu(gate) * up)
        out = self._rms(x[fb.logit_rows], self.final_norm)
        return _linear(out, self.lm_head, self.lm_head_packed).float()


def _stack_gate_up(mlp: torch.nn.Module) -> torch.Tensor:
    """[2I, hidden] gate-then-up weight for one matmul; the module's own gate/up parameters become
    views into it, so their old storage is freed and the weights are held once (not doubled)."""
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    if gate.is_contiguous() and up.is_contiguous() and \
            gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr() and \
            gate.data_ptr() + gate.numel() * gate.element_size() == up.data_ptr():
        # already stacked by an earlier PagedDecoder over the same model: reuse, build nothing
        return gate.detach().as_strided((gate.shape[0] + up.shape[0], gate.shape[1]), gate.stride())
    stacked = torch.cat([gate.detach(), up.detach()], 0)
    with torch.no_grad():
        gate.data = stacked[: gate.shape[0]]
        up.data = stacked[gate.shape[0]:]
    return stacked


def _unique_bytes(tensors: list[torch.Tensor | None]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total
