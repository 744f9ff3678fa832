"""Token sampling and token-tree verification (greedy and lossless multi-branch rejection)."""

from __future__ import annotations

import logging

import torch

from gpu_runtime.sampling import SamplingParams
from gpu_runtime.speculation.token_tree import TokenTree

log = logging.getLogger(__name__)


def make_generator(sampling: SamplingParams, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if sampling.seed is not None:
        gen.manual_seed(sampling.seed)
    else:
        gen.seed()
    return gen


def target_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Softmax at the request's temperature, then (in vLLM's order) tokens below min_p of the most likely one
    dropped, the top_k kept, the top-p nucleus of what is left kept; renormalized."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.min_p > 0:
        probs = probs.masked_fill(probs < sampling.min_p * probs.amax(-1, keepdim=True), 0.0)
    if 0 < sampling.top_k < probs.shape[-1]:
        kth = probs.topk(sampling.top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if sampling.min_p > 0 or sampling.top_k:
        probs = probs / probs.sum(-1, keepdim=True)
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= sampling.top_p, 0.0)  # keep the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=gen).item())


def verify_greedy(tree: TokenTree, argmax: list[int]) -> tuple[list[int], int]:
    """Walk from the root accepting the child that equals the target argmax at its parent.

    ``argmax[0]`` is the target's choice after the root, ``argmax[1 + i]`` after node i.
    Returns accepted node indices (root to leaf) and the bonus token."""
    children = _children(tree)
    accepted: list[int] = []
    cur = -1
    while True:
        want = argmax[cur + 1]
        nxt = next((c for c in children[cur] if tree.token_ids[c] == want), None)
        if nxt is None:
            return accepted, want
        accepted.append(nxt)
        cur = nxt


def verify_sampled(tree: TokenTree, probs: torch.Tensor, gen: torch.Generator) -> tuple[list[int], int]:
    """Multi-branch rejection sampling with point-mass draft proposals (SpecInfer Alg. 2).

    ``probs[0]`` is the target distribution after the root, ``probs[1 + i]`` after node i.
    At a node, try each child x in order: accept with probability p(x); on rejection set
    p(x) = 0 and renormalize. With no child accepted the bonus is drawn from the residual,
    so every output token is distributed exactly as the target's.

    One device round trip per visited node: its uniforms (one per child plus one for the
    bonus) come from a single ``torch.rand`` on the generator's device and its probability
    row is copied to the host once; the accept/reject walk then runs on host floats."""
    children = _children(tree)
    accepted: list[int] = []
    cur = -1
    while True:
        kids = children[cur]
        u = torch.rand(len(kids) + 1, generator=gen, device=probs.device).tolist()
        target = probs[cur + 1].to("cpu", torch.float64)
        p = target.clone()
        total = float(p.sum())  # p is kept unnormalized; ``total`` is its mass
        nxt = None
        for k, c in enumerate(kids):
            x = tree.token_ids[c]
            if u[k] * total < float(p[x]):  # u < p(x) / total
                nxt = c
                break
            p[x] = 0.0
            total = float(p.sum())  # re-summed, not decremented: an exhausted residual must read exactly 0
            if total <= 0.0:  # only with duplicate sibling tokens: the bonus comes from the target itself
                p, total = target, float(target.sum())
                break
        if nxt is None:
            return accepted, _inverse_cdf(p, u[-1])
        accepted.append(nxt)
        cur = nxt


def _inverse_cdf(p: torch.Tensor, u: float) -> int:
    """Token drawn from the (unnormalized, host) weights ``p`` with the uniform ``u``."""
    cdf = p.cumsum(0)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True)[0])
    return min(idx, p.shape[0] - 1)


def _children(tree: TokenTree) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {-1: []}
    for i, par in enumerate(tree.parents):
        out.setdefault(i, [])
        out[par].append(i)
    return out
