"""Token trees: the draft tokens a request proposes for one verification step.

Node i holds a draft token whose parent is another node (``parents[i] >= 0``) or the
root (``-1``), the request's pending token that is verified in the same forward pass.
Nodes are stored in topological order (a parent always precedes its children).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenTree:
    token_ids: list[int] = field(default_factory=list)  # draft token of each node
    parents: list[int] = field(default_factory=list)  # parent node index, -1 = the root
    path_probs: list[float] = field(default_factory=list)  # f(v): product of draft probs root->v (AdaServe)

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.parents) == len(self.path_probs)):
            raise ValueError("token_ids, parents and path_probs must have equal length")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: nodes must be in topological order")

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def chain(cls, token_ids: list[int], probs: list[float] | None = None) -> TokenTree:
        """A single path (vLLM-Spec / AdaSpec chain draft); probs are per-step conditionals."""
        probs = probs if probs is not None else [1.0] * len(token_ids)
        path, acc = [], 1.0
        for p in probs:
            acc *= p
            path.append(acc)
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)), path)

    @property
    def is_chain(self) -> bool:
        """Each node's parent is the node before it (a plain sequence under the root)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node (children of the root have depth 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def up_to_depth(self, depth: int) -> TokenTree:
        """The tree without nodes deeper than ``depth`` (a node's ancestors are never deeper: still a tree)."""
        depths = self.depths()
        if not depths or max(depths) <= depth:
            return self
        return self.subtree([i for i, d in enumerate(depths) if d <= depth])

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (-1 for the root), in stored order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestors(self, node: int) -> list[int]:
        """Path from the first-level node down to ``node`` inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def expected_accepted(self) -> float:
        """E[acc(T)] = sum of path probabilities (AdaServe section 4)."""
        return sum(self.path_probs)

    def subtree(self, nodes: list[int] | set[int]) -> TokenTree:
        """The tree restricted to ``nodes``; every kept node's parent must be kept too."""
        keep = sorted(set(nodes))
        index = {old: new for new, old in enumerate(keep)}
        parents = []
        for old in keep:
            p = self.parents[old]
            if p >= 0 and p not in index:
                raise ValueError(f"node {old} kept without its parent {p}")
            parents.append(index[p] if p >= 0 else -1)
        return TokenTree([self.token_ids[i] for i in keep], parents, [self.path_probs[i] for i in keep])
