"""Test-only speculation pieces: verify-everything policy and a noisy random-tree drafter."""

from __future__ import annotations

import random

from gpu_runtime.executor.base import DraftEntry
from gpu_runtime.executor.drafters.base import Drafter
from gpu_runtime.speculation.base import SpeculationPolicy
from gpu_runtime.speculation.token_tree import TokenTree


class VerifyAll(SpeculationPolicy):
    """Drafts every decode at a fixed depth/width and verifies the whole candidate tree."""

    name = "verify-all"

    def __init__(self, depth: int = 3, width: int = 2) -> None:
        self.depth, self.width = depth, width
        self.accepted = 0
        self.steps = 0

    def draft_plan(self, decodes, now):
        return [DraftEntry(r.request_id, self.depth, self.width) for r in decodes]

    def select(self, decodes, candidates, now):
        return dict(candidates)

    def observe(self, decodes, selected, result, draft_latency_s, now):
        self.steps += len(selected)
        self.accepted += sum(len(v) for v in result.accepted_nodes.values())


class NoisyTreeDrafter(Drafter):
    """Random trees whose nodes follow a known continuation with probability ``hit`` (else random tokens)."""

    def __init__(self, continuation: dict[int, list[int]], vocab: int, hit: float = 0.6, seed: int = 0,
                 max_nodes: int = 10) -> None:
        self.continuation = continuation  # keyed by prompt length: the reference output of that prompt
        self.vocab, self.hit, self.max_nodes = vocab, hit, max_nodes
        self.rng = random.Random(seed)

    def draft(self, entries: list[DraftEntry], keep_drafting=None) -> dict[str, TokenTree]:
        out = {}
        for e in entries:
            tokens = self.executor.token_ids(e.request_id)
            ref = self._reference(tokens)
            tree = TokenTree()
            frontier = [(-1, len(tokens))]  # (node, index into the full sequence of its token's successor)
            while frontier and len(tree) < self.max_nodes:
                parent, nxt = frontier.pop(0)
                for _ in range(self.rng.randint(1, e.width)):
                    if len(tree) >= self.max_nodes:
                        break
                    good = nxt < len(ref) and self.rng.random() < self.hit
                    tok = ref[nxt] if good else self.rng.randrange(self.vocab)
                    tree.token_ids.append(tok)
                    tree.parents.append(parent)
                    tree.path_probs.append(0.5)
                    if self.rng.random() < 0.8:
                        frontier.append((len(tree) - 1, nxt + 1))
            out[e.request_id] = tree
        return out

    def _reference(self, tokens: list[int]) -> list[int]:
        for plen, cont in self.continuation.items():
            if len(tokens) >= plen and len(tokens) - plen <= len(cont):
                return tokens[:plen] + cont
        return []
