"""AdaServe token-tree selection (Algorithm 2, lines 3-23).

Given each request's candidate tree (beam search on the draft) and a verification
budget B, pick the sub-tree each request verifies: first enough nodes to meet every
request's SLO requirement A(r) (most demanding request first), then the globally most
probable remaining nodes until B is spent. Pure Python; no torch.

``likely_beyond_slack`` is the same co-serving rule for chains (AdaSpec, Nightjar): the tokens
the pass's spare time pays for, then only likely ones.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_runtime.speculation.cost import slack_tokens
from gpu_runtime.speculation.token_tree import TokenTree

log = logging.getLogger(__name__)


@dataclass
class SelectionInput:
    request_id: str
    requirement: float  # A(r): tokens that must be accepted this iteration (root/bonus token included)
    depth: int  # d of the candidate tree; caps what one iteration can reach (A_cap = min(A, d+1))


@dataclass
class SelectionResult:
    trees: dict[str, TokenTree] = field(default_factory=dict)  # selected sub-tree per request
    expected: dict[str, float] = field(default_factory=dict)  # n_acc: 1 (root) + sum of selected f(v)
    infeasible: set[str] = field(default_factory=set)  # requests whose A(r) this selection cannot meet
    budget_left: int = 0  # verification tokens not spent


class _Frontier:
    """Nodes of one candidate tree whose parent is already selected, best f(v) first."""

    def __init__(self, tree: TokenTree) -> None:
        self.tree = tree
        self.kids: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents):
            self.kids.setdefault(p, []).append(i)
        self.heap: list[tuple[float, int]] = []
        self.chosen: list[int] = []
        self._open(-1)

    def _open(self, node: int) -> None:
        for c in self.kids.get(node, []):
            heapq.heappush(self.heap, (-self.tree.path_probs[c], c))

    def peek(self) -> tuple[float, int] | None:
        if not self.heap:
            return None
        neg, node = self.heap[0]
        return -neg, node

    def take(self) -> float:
        neg, node = heapq.heappop(self.heap)
        self.chosen.append(node)
        self._open(node)
        return -neg


def select_trees(inputs: list[SelectionInput], candidates: dict[str, TokenTree], budget: int,
                 n_max: int | None = None, cheap_tokens: int | None = None,
                 min_prob_beyond: float = 0.0) -> SelectionResult:
    """Alg. 2: SLO-customized then throughput-optimized selection under budget B.

    Every request's root (its pending token) counts against B (Alg. 2 line 7). Node value
    is the cumulative path probability f(v) (DESIGN.md decision); budget loops use B > 0.
    ``cheap_tokens`` (roots included): past that many tokens the throughput phase takes only
    nodes with f(v) >= ``min_prob_beyond`` (tokens that cost more than they are likely to gain).
    """
    result = SelectionResult()
    b = budget - len(inputs)  # line 7: each root costs one verification token
    frontiers = {x.request_id: _Frontier(candidates[x.request_id])
                 for x in inputs if x.request_id in candidates and len(candidates[x.request_id])}
    n_acc = {x.request_id: 1.0 for x in inputs}  # line 6: the root (bonus token) is always accepted
    # lines 9-17: SLO-customized selection, most demanding request first
    for x in sorted(inputs, key=lambda x: x.requirement, reverse=True):
        fr = frontiers.get(x.request_id)
        a_cap = min(x.requirement, x.depth + 1)  # A_cap = min(A, d+1)
        while fr is not None and n_acc[x.request_id] < a_cap and b > 0 and fr.peek() is not None:
            if n_max is not None and len(fr.chosen) >= n_max:
                break
            n_acc[x.request_id] += fr.take()  # line 15
            b -= 1
    # lines 18-23: throughput-optimized selection, global top f(v)
    pool = [(-p, rid) for rid, fr in frontiers.items() if (p := _peek_prob(fr)) is not None]
    heapq.heapify(pool)
    cheap_left = math.inf if cheap_tokens is None else cheap_tokens - (budget - b)  # cheap tokens not yet spent
    while b > 0 and pool:
        if cheap_left <= 0 and -pool[0][0] < min_prob_beyond:
            break  # the best node left is not worth a token beyond the cheap ones
        _, rid = heapq.heappop(pool)
        cheap_left -= 1
        fr = frontiers[rid]
        n_acc[rid] += fr.take()
        b -= 1
        nxt = _peek_prob(fr)
        if nxt is not None:
            heapq.heappush(pool, (-nxt, rid))
    for x in inputs:
        fr = frontiers.get(x.request_id)
        if fr is not None and fr.chosen:
            result.trees[x.request_id] = fr.tree.subtree(fr.chosen)
        result.expected[x.request_id] = n_acc[x.request_id]
        if n_acc[x.request_id] + 1e-9 < x.requirement:
            result.infeasible.add(x.request_id)
    result.budget_left = max(b, 0)
    return result


def _peek_prob(fr: _Frontier) -> float | None:
    top = fr.peek()
    return None if top is None else top[0]


def likely_beyond_slack(chains: dict[str, TokenTree], curve: Callable[[int], float], num_requests: int,
                        prefill_tokens: int, spare_s: float, min_prob: float) -> dict[str, TokenTree]:
    """AdaServe's co-serving rule for chains already chosen (AdaSpec, Nightjar): the tokens whose extra pass
    time fits the scheduler's spare time stay, beyond them only tokens with path probability >= ``min_prob``
    (the throughput phase of ``select_trees`` with no SLO requirement and all drafted tokens as budget)."""
    drafted = sum(len(t) for t in chains.values())
    cheap = slack_tokens(curve, num_requests, prefill_tokens, spare_s, num_requests + drafted) - num_requests
    inputs = [SelectionInput(rid, 0.0, len(t)) for rid, t in chains.items()]
    return select_trees(inputs, chains, len(chains) + drafted, None, len(chains) + cheap, min_prob).trees
