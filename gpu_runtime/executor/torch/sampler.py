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
    """Softmax at the request's temperature, restricted to the top-p nucleus and renormalized."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
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
    so every output token is distributed exactly as the target's."""
    children = _children(tree)
    accepted: list[int] = []
    cur = -1
    while True:
        p = probs[cur + 1].clone()
        nxt = None
        for c in children[cur]:
            x = tree.token_ids[c]
            u = float(torch.rand((), generator=gen, device=p.device))
            if u < float(p[x]):
                nxt = c
                break
            p[x] = 0.0
            total = float(p.sum())
            if total <= 0.0:  # only with duplicate sibling tokens: the bonus comes from the target itself
                p = probs[cur + 1]
                break
            p = p / total
        if nxt is None:
            return accepted, sample_token(p, gen)
        accepted.append(nxt)
        cur = nxt


def _children(tree: TokenTree) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {-1: []}
    for i, par in enumerate(tree.parents):
        out.setdefault(i, [])
        out[par].append(i)
    return out
