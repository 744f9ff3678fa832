"""The prompt-lookup drafter's incremental n-gram index answers exactly like the full scan."""

from __future__ import annotations

import random

import pytest

from gpu_runtime.executor.base import DraftEntry
from gpu_runtime.executor.drafters.prompt_lookup import NgramIndex, PromptLookupDrafter, scan_matches


class _Tokens:
    """Stands in for the executor: the drafter reads ``token_ids(request_id)``."""

    def __init__(self) -> None:
        self.seqs: dict[str, list[int]] = {}

    def token_ids(self, rid: str) -> list[int]:
        return self.seqs[rid]


def _drafter(max_ngram: int = 3) -> tuple[PromptLookupDrafter, _Tokens]:
    d = PromptLookupDrafter(max_ngram=max_ngram, max_matches=4)
    ex = _Tokens()
    d.bind(ex)  # type: ignore[arg-type]
    return d, ex


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_index_matches_scan_while_growing(vocab):
    rng = random.Random(vocab)
    d, ex = _drafter()
    ex.seqs["r"] = seq = [rng.randrange(vocab) for _ in range(5)]
    for _ in range(300):
        for depth, width in ((4, 1), (3, 3)):
            got = d.draft([DraftEntry("r", depth, width)])["r"]
            assert got == d.propose(list(seq), depth, width)
        seq.extend(rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 2, 5])))


def test_index_follows_cuts_and_rewrites():
    """Preemption recompute and stop-string cuts shorten or rewrite the sequence in place."""
    rng = random.Random(1)
    d, ex = _drafter()
    ex.seqs["r"] = seq = [rng.randrange(6) for _ in range(40)]
    for step in range(200):
        got = d.draft([DraftEntry("r", 5, 2)])["r"]
        assert got == d.propose(list(seq), 5, 2), step
        op = rng.random()
        if op < 0.15 and len(seq) > 3:
            del seq[rng.randrange(1, len(seq)):]  # cut
        elif op < 0.3:
            seq[rng.randrange(len(seq))] = rng.randrange(6)  # rewrite in place
        else:
            seq.extend(rng.randrange(6) for _ in range(rng.randint(1, 3)))


def test_matches_newest_first_without_the_suffix_itself():
    idx = NgramIndex(max_ngram=2)
    idx.sync([1, 2, 9, 1, 2, 7, 1, 2])
    assert idx.matches(2, 10) == [4, 1]
    assert idx.matches(2, 1) == [4]
    assert idx.matches(1, 10) == [4, 1]
    assert idx.matches(3, 10) == []  # longer than the index's n-grams
    assert scan_matches([1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 1, 10) == [[7, 1], [9, 1]]


def test_free_drops_the_index():
    d, ex = _drafter()
    ex.seqs["r"] = [1, 2, 1, 2]
    d.draft([DraftEntry("r", 2, 1)])
    assert "r" in d._indexes
    d.free("r")
    assert "r" not in d._indexes
