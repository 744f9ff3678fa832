"""Static speculation baselines: vLLM-Spec(n) chains and a SpecInfer-like static tree.

Both draft the same shape every iteration whatever the load or the SLOs, which is what
AdaServe, AdaSpec and Nightjar are compared against.
"""

from __future__ import annotations

import logging

from gpu_runtime.executor.base import DraftEntry
from gpu_runtime.speculation.base import SpeculationPolicy
from gpu_runtime.speculation.selection import SelectionInput, select_trees
from gpu_runtime.speculation.token_tree import TokenTree

log = logging.getLogger(__name__)


class StaticChain(SpeculationPolicy):
    """vLLM-Spec(n): a chain of n draft tokens for every decode, every step."""

    def __init__(self, length: int = 4) -> None:
        if length < 1:
            raise ValueError("chain length must be >= 1 (use 'none' for no speculation)")
        self.length = length
        self.name = f"chain-{length}"

    def most_kept(self, decodes: int) -> int | None:
        return self.length  # the chain's first ``length`` tokens, whatever the pass

    def draft_plan(self, decodes, now):
        return [DraftEntry(r.request_id, self.length, 1) for r in decodes]

    def select(self, decodes, candidates, now):
        out = {}
        for r in decodes:
            tree = candidates.get(r.request_id)
            if tree is not None and len(tree):
                out[r.request_id] = tree.subtree(_first_path(tree, self.length))
        return out

    def state(self):
        return {"policy": self.name, "length": self.length}


class StaticTree(SpeculationPolicy):
    """SpecInfer-like static tree: the same 23-node tree budget per request every step.

    The draft expands a depth x width beam-search candidate; each request keeps its
    ``num_nodes`` most probable connected nodes regardless of load or SLO.
    """

    name = "static-tree"

    def __init__(self, num_nodes: int = 23, depth: int = 8, width: int = 3) -> None:
        self.num_nodes, self.depth, self.width = num_nodes, depth, width

    def most_kept(self, decodes: int) -> int | None:
        return self.depth  # a chain (vLLM's drafts) no deeper than the tree: its first ``depth``

    def draft_plan(self, decodes, now):
        return [DraftEntry(r.request_id, self.depth, self.width) for r in decodes]

    def select(self, decodes, candidates, now):
        out: dict[str, TokenTree] = {}
        for r in decodes:
            tree = candidates.get(r.request_id)
            if tree is None or not len(tree):
                continue
            picked = select_trees([SelectionInput(r.request_id, 0.0, self.depth)], {r.request_id: tree},
                                  budget=self.num_nodes + 1)
            if r.request_id in picked.trees:
                out[r.request_id] = picked.trees[r.request_id]
        return out

    def state(self):
        return {"policy": self.name, "nodes": self.num_nodes, "depth": self.depth, "width": self.width}


def _first_path(tree: TokenTree, length: int) -> list[int]:
    """Nodes of the most probable root-to-leaf chain, at most ``length`` long."""
    path, node = [], -1
    while len(path) < length:
        kids = tree.children(node)
        if not kids:
            break
        node = max(kids, key=lambda k: tree.path_probs[k])
        path.append(node)
    return path
