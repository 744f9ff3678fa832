"""The own engine's speculative decoding totals count as vLLM's SpecDecodingStats does (pure logic)."""

from gpu_runtime.speculation.counts import SpecDecodeCounts


def test_each_verified_draft_counts_its_tokens_and_accepted_depth_per_position():
    counts = SpecDecodeCounts()
    # a: a tree of 5 nodes, 2 accepted; b: 3 drafted, none accepted; c: no draft this step (a plain decode)
    counts.observe({"a": 5, "b": 3, "c": 0}, {"a": [0, 2]})
    counts.observe({"a": 4}, {"a": [0, 1, 3]})
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (3, 12, 5)
    assert counts.num_accepted_tokens_per_pos == [2, 2, 1]
