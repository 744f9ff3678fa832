from __future__ import annotations

import random

import pytest

from gpu_runtime.qos import QoSClass, QoSSpec
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.speculation.token_tree import TokenTree


def random_tree(rng: random.Random, size: int, max_kids: int = 3) -> TokenTree:
    """A draft-like tree: siblings' conditionals sum to <= 1, so f(v) shrinks down every path."""
    parents, probs, left = [], [], {-1: 1.0}
    for i in range(size):
        p = rng.choice([-1] + list(range(i)))
        while left.get(p, 1.0) < 0.05 or sum(1 for q in parents if q == p) >= max_kids:
            p = rng.choice([-1] + list(range(i)))
        c = rng.uniform(0.05, left.get(p, 1.0))
        left[p] = left.get(p, 1.0) - c
        left[i] = 1.0
        parents.append(p)
        probs.append((1.0 if p < 0 else probs[p]) * c)
    return TokenTree(list(range(100, 100 + size)), parents, probs)


def make_request(rid: str, tbt: float | None = 0.05, outputs: int = 5, first_token_time: float = 0.0,
                 gap: float = 0.05, ttlt: float | None = None) -> Request:
    qos = (QoSSpec(QoSClass.INTERACTIVE, ttft_s=1.0, tbt_s=tbt) if ttlt is None
           else QoSSpec(QoSClass.BATCH, ttlt_s=ttlt))
    req = Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=64), qos, arrival_time=0.0)
    req.status = RequestStatus.DECODING
    req.output_token_ids = [7] * outputs
    req.token_times = [first_token_time + i * gap for i in range(outputs)]
    req.num_computed_tokens = req.prompt_len + outputs - 1
    return req


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)
