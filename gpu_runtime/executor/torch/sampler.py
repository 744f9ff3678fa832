"""Token sampling and token-tree verification (greedy, and sampled with one uniform per output token)."""

from __future__ import annotations

import logging
from collections.abc import Callable

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
    """A token drawn from ``probs`` with one uniform of the request's generator (inverse CDF). Every output token
    takes the next uniform, whether or not its step speculated, so a seed gives the same text under any speculation
    policy or tree shape, and with speculation off."""
    u = torch.rand(1, generator=gen, device=probs.device, dtype=torch.float64)
    return _inverse_cdf(probs.to(torch.float64), u)


def verify_greedy(tree: TokenTree, argmax: list[int]) -> tuple[list[int], int]:
    """Walk from the root accepting the child that equals the target argmax at its parent.

    ``argmax[0]`` is the target's choice after the root, ``argmax[1 + i]`` after node i.
    Returns accepted node indices (root to leaf) and the bonus token."""
    return _walk(tree, argmax.__getitem__)


def verify_sampled(tree: TokenTree, probs: torch.Tensor, gen: torch.Generator) -> tuple[list[int], int]:
    """Lossless verification of point-mass drafts with one uniform per output token.

    ``probs[0]`` is the target distribution after the root, ``probs[1 + i]`` after node i. At each visited
    node the target's token is drawn (``sample_token``); the child that carries it is accepted and the walk goes
    on, and where none does that token is the bonus. Each output token is thus a sample of the target, and a
    child's token x is accepted with probability p(x), as under multi-branch rejection with point-mass proposals
    (SpecInfer Alg. 2), whose acceptance it equals."""
    return _walk(tree, lambda row: sample_token(probs[row], gen))


def _walk(tree: TokenTree, target_token: Callable[[int], int]) -> tuple[list[int], int]:
    """Accepted node indices (root to leaf) and the bonus token: from the root, the child carrying the target's
    token at its parent (``target_token(0)`` after the root, ``target_token(1 + i)`` after node i), until none
    does; the target's token there is the bonus."""
    children = _children(tree)
    accepted: list[int] = []
    cur = -1
    while True:
        want = target_token(cur + 1)
        nxt = next((c for c in children[cur] if tree.token_ids[c] == want), None)
        if nxt is None:
            return accepted, want
        accepted.append(nxt)
        cur = nxt


def _inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> int:
    """The token the uniform ``u`` (a one-element tensor) picks from the unnormalized weights ``p``: the first whose
    cumulative weight exceeds ``u`` times the total, so never one of weight 0."""
    cdf = p.cumsum(0)
    idx = int(torch.searchsorted(cdf, u * cdf[-1], right=True)[0])
    return min(idx, p.shape[0] - 1)


def _children(tree: TokenTree) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {-1: []}
    for i, par in enumerate(tree.parents):
        out.setdefault(i, [])
        out[par].append(i)
    return out
