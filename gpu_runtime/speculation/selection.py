"""AdaServe token-tree selection (Algorithm 2, lines 3-23).

Given each request's candidate tree (beam search on the draft) and a verification
budget B, pick the sub-tree each request verifies: first enough nodes to meet every
request's SLO requirement A(r) (most demanding request first), then the globally most
probable remaining nodes until B is spent. Pure Python; no torch.

``likely_beyond_slack`` is the same co-serving rule for chains (AdaSpec, Nightjar): the tokens
the pass's spare time pays for, then only likely ones.

``select_for_rate`` is what AdaServe falls back to when the selection above leaves a requirement
unmet: every requirement the candidates can meet, then the most expected accepted tokens per second
of iteration. ``iteration_rate`` and ``requirements_met`` score any selection (a static shape's too).
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


def iteration_rate(trees: dict[str, TokenTree], num_requests: int, pass_time: Callable[[int], float],
                   fixed_s: float = 0.0) -> float:
    """Expected accepted tokens per second of one iteration: (roots + sum of the verified f(v)) over
    ``fixed_s`` (drafting) + ``pass_time(tree tokens)`` (the verification pass with that many tree tokens)."""
    tokens = sum(len(t) for t in trees.values())
    gained = num_requests + sum(t.expected_accepted() for t in trees.values())
    return gained / (fixed_s + pass_time(tokens))


def requirements_met(inputs: list[SelectionInput], trees: dict[str, TokenTree]) -> int:
    """How many requests' A(r) the selection meets in expectation (root + the verified f(v))."""
    return sum(1 for x in inputs
               if 1.0 + (trees[x.request_id].expected_accepted() if x.request_id in trees else 0.0) + 1e-9
               >= x.requirement)


def select_for_rate(inputs: list[SelectionInput], candidates: dict[str, TokenTree],
                    pass_time: Callable[[int], float], fixed_s: float = 0.0) -> SelectionResult:
    """Meet every requirement the candidates can meet, then maximize ``iteration_rate``.

    A request's A(r) can be met when its whole candidate tree would meet it; its most probable
    nodes, as few as do, are taken first. Then nodes are added in descending f(v) across all trees
    and the count with the best rate is kept (ties: fewer tokens). No budget B, n_max or likelihood
    rule: the rate prices every token by the time it adds to the pass.

    This is the best selection for (requirements met, then rate). No selection meets a requirement
    the whole tree cannot, so none meets more. Among those that meet as many, any with k tokens
    takes as long as ours with k, and holds at most our expected tokens: within a tree any j
    connected nodes hold at most its j most probable (f(v) never grows down a path), the prefix
    sums of a tree's nodes in that order are concave, and adding the best next node across trees,
    from the counts the requirements force, maximizes a sum of concave functions. So no static
    shape drawn from the same candidates (a chain of n, a static tree of 23 nodes) does better.
    """
    frontiers = {x.request_id: _Frontier(candidates[x.request_id])
                 for x in inputs if x.request_id in candidates and len(candidates[x.request_id])}
    gained = float(len(inputs))  # the roots (bonus tokens)
    required = 0
    for x in inputs:
        fr = frontiers.get(x.request_id)
        if fr is None or 1.0 + fr.tree.expected_accepted() + 1e-9 < x.requirement:
            continue  # not even the whole tree meets it: left to the rate
        have = 1.0
        while have + 1e-9 < x.requirement and fr.peek() is not None:
            f = fr.take()
            have += f
            gained += f
            required += 1
    pool = [(-p, rid) for rid, fr in frontiers.items() if (p := _peek_prob(fr)) is not None]
    heapq.heapify(pool)
    order: list[tuple[str, float]] = []  # (request, f(v)) taken after the required nodes, in order
    while pool:
        _, rid = heapq.heappop(pool)
        fr = frontiers[rid]
        order.append((rid, fr.take()))
        nxt = _peek_prob(fr)
        if nxt is not None:
            heapq.heappush(pool, (-nxt, rid))
    best_k, best_rate = 0, gained / (fixed_s + pass_time(required))
    for k, (_, f) in enumerate(order, start=1):
        gained += f
        rate = gained / (fixed_s + pass_time(required + k))
        if rate > best_rate:
            best_k, best_rate = k, rate
    # Each frontier recorded its nodes in the order taken: the required ones, then its part of ``order``.
    dropped: dict[str, int] = {}
    for rid, _ in order[best_k:]:
        dropped[rid] = dropped.get(rid, 0) + 1
    result = SelectionResult()
    for x in inputs:
        n_acc = 1.0
        fr = frontiers.get(x.request_id)
        if fr is not None:
            nodes = fr.chosen[:len(fr.chosen) - dropped.get(x.request_id, 0)]
            if nodes:
                result.trees[x.request_id] = fr.tree.subtree(nodes)
                n_acc += sum(fr.tree.path_probs[i] for i in nodes)
        result.expected[x.request_id] = n_acc
        if n_acc + 1e-9 < x.requirement:
            result.infeasible.add(x.request_id)
    return result
