"""Acceptance models: how many draft tokens the target accepts, for the simulator.

The simulator needs two things a real draft + target pair would give it:
``draft_tree`` builds a candidate tree (beam search of depth d and width w) whose
path probabilities play the draft's confidences, and ``sample_accepted`` walks a
verified tree the way tree verification does: from the root, at most one child per
level is the target's token, chosen with that child's conditional probability
(f(child)/f(parent)); the walk stops when no kept child matches.

``GeometricAcceptance`` uses one conditional acceptance rate per depth;
``EmpiricalAcceptance`` loads per-category rates measured on the real default model by
``ops/measure_acceptance.py`` (data under ``gpu_runtime/speculation/data/``).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from gpu_runtime.speculation.token_tree import TokenTree

log = logging.getLogger(__name__)

DATA_FILE = Path(__file__).resolve().parent.parent / "speculation" / "data" / "acceptance.json"


@runtime_checkable
class AcceptanceModel(Protocol):
    def draft_tree(self, category: str | None, depth: int, width: int, rng: random.Random) -> TokenTree:
        """A candidate tree as the drafter would propose it (token ids are placeholders)."""

    def sample_accepted(self, tree: TokenTree, category: str | None, rng: random.Random) -> list[int]:
        """Indices of accepted nodes, root to leaf (the bonus token is not a node)."""


@dataclass
class GeometricAcceptance:
    """Conditional acceptance alpha_k at depth k (last value repeats); draft confidences
    are Beta(mean alpha_k, concentration) per node, so some drafts are sure and some not."""

    alphas: list[float] = field(default_factory=lambda: [0.7])
    concentration: float = 4.0  # Beta a+b: lower = more spread between confident/unsure nodes
    hit_rate: float = 1.0  # share of steps where the drafter proposes anything (prompt lookup < 1)
    sibling_decay: float = 0.5  # rank-j sibling gets this share of the mass left by ranks < j

    def alpha(self, depth: int) -> float:
        return self.alphas[min(depth, len(self.alphas)) - 1]

    def _confidence(self, depth: int, rng: random.Random) -> float:
        m = min(0.999, max(0.001, self.alpha(depth)))
        return rng.betavariate(m * self.concentration, (1 - m) * self.concentration)

    def draft_tree(self, category, depth, width, rng):
        if depth <= 0 or rng.random() >= self.hit_rate:
            return TokenTree()
        tokens, parents, probs = [], [], []
        beam = [(-1, 1.0)]  # (node, path prob)
        next_token = 0
        for level in range(1, depth + 1):
            expanded = []
            for node, f in beam:
                left = 1.0
                for rank in range(width):
                    c = self._confidence(level, rng) * left if rank == 0 else left * self.sibling_decay * rng.random()
                    left -= c
                    expanded.append((node, f * c))
            expanded.sort(key=lambda x: -x[1])
            beam = []
            for parent, f in expanded[:width]:  # AdaServe beam: w nodes per layer
                tokens.append(next_token)
                parents.append(parent)
                probs.append(f)
                beam.append((len(tokens) - 1, f))
                next_token += 1
        # Beam keeps the order parent-before-child, so the tree is topological.
        return TokenTree(tokens, parents, probs)

    def sample_accepted(self, tree, category, rng):
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents):
            kids.setdefault(p, []).append(i)
        accepted: list[int] = []
        node, f_parent = -1, 1.0
        while node in kids:
            u, acc, chosen = rng.random(), 0.0, None
            for c in kids[node]:
                acc += tree.path_probs[c] / f_parent if f_parent > 0 else 0.0
                if u < acc:
                    chosen = c
                    break
            if chosen is None:
                break
            accepted.append(chosen)
            node, f_parent = chosen, tree.path_probs[chosen]
        return accepted


class EmpiricalAcceptance:
    """Per-category GeometricAcceptance built from measured rates (``ops/measure_acceptance.py``)."""

    def __init__(self, stats: dict[str, dict], default: GeometricAcceptance | None = None) -> None:
        self.models = {cat: GeometricAcceptance(alphas=s["cond_accept"] or [0.0], hit_rate=s.get("hit_rate", 1.0),
                                                concentration=s.get("concentration", 4.0))
                       for cat, s in stats.items()}
        self.default = default or _pooled(stats)

    @classmethod
    def load(cls, path: str | Path = DATA_FILE, drafter: str = "prompt_lookup") -> EmpiricalAcceptance:
        data = json.loads(Path(path).read_text())
        return cls(data["drafters"][drafter]["categories"])

    def model(self, category: str | None) -> GeometricAcceptance:
        return self.models.get(category or "", self.default)

    def draft_tree(self, category, depth, width, rng):
        return self.model(category).draft_tree(category, depth, width, rng)

    def sample_accepted(self, tree, category, rng):
        return self.model(category).sample_accepted(tree, category, rng)


def _pooled(stats: dict[str, dict]) -> GeometricAcceptance:
    if not stats:
        return GeometricAcceptance()
    depth = max(len(s["cond_accept"]) for s in stats.values())
    alphas = []
    for k in range(depth):
        vals = [s["cond_accept"][min(k, len(s["cond_accept"]) - 1)] for s in stats.values() if s["cond_accept"]]
        alphas.append(sum(vals) / len(vals) if vals else 0.0)
    hit = sum(s.get("hit_rate", 1.0) for s in stats.values()) / len(stats)
    return GeometricAcceptance(alphas=alphas or [0.0], hit_rate=hit)
