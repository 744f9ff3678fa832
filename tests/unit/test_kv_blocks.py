"""Block manager: accounting, allocation failure, truncation of scratch slots, elastic pool."""

from gpu_runtime.executor.kv_blocks import BlockManager


def test_blocks_needed_counts_partial_blocks():
    bm = BlockManager(10, 4)
    assert bm.blocks_needed("a", 1) == 1
    assert bm.blocks_needed("a", 4) == 1
    assert bm.blocks_needed("a", 5) == 2
    bm.allocate("a", 3)
    assert bm.blocks_needed("a", 1) == 0  # fits in the partly used block
    assert bm.blocks_needed("a", 2) == 1


def test_allocate_returns_none_and_changes_nothing_when_full():
    bm = BlockManager(3, 4)
    alloc = bm.allocate("a", 9)
    assert alloc is not None and len(alloc.new_blocks) == 3 and alloc.num_tokens == 9
    assert bm.num_free == 0
    assert bm.allocate("b", 1) is None
    assert "b" not in bm.tables
    assert bm.allocate("a", 3) is not None  # still room in a's last block
    assert bm.allocate("a", 1) is None
    assert bm.num_tokens("a") == 12


def test_slots_follow_the_block_table():
    bm = BlockManager(8, 4)
    bm.allocate("x", 2)
    bm.allocate("y", 4)
    bm.allocate("x", 4)
    tx = bm.tables["x"].blocks
    assert bm.slots("x", 0, 6) == [tx[0] * 4 + i for i in range(4)] + [tx[1] * 4, tx[1] * 4 + 1]
    assert bm.slot("x", 5) == tx[1] * 4 + 1


def test_truncate_and_free_return_blocks():
    bm = BlockManager(8, 4)
    bm.allocate("a", 13)
    assert bm.num_free == 4
    assert bm.truncate("a", 5) == 2
    assert bm.num_free == 6 and bm.num_tokens("a") == 5
    assert bm.truncate("a", 9) == 0
    assert bm.free("a") == 2
    assert bm.num_free == 8 and bm.free("a") == 0


def test_grow_and_shrink_only_free_top_blocks():
    bm = BlockManager(4, 2)
    new = bm.grow(3)
    assert new == [4, 5, 6] and bm.total_blocks == 7 and bm.num_free == 7
    held = bm.allocate("a", 14)  # takes all 7
    assert held is not None and bm.shrink(2) == 0
    bm.free("a")
    assert bm.shrink(3) == 3 and bm.total_blocks == 4 and bm.num_free == 4
    assert max(b for b in range(bm.total_blocks)) == 3
    a = bm.allocate("b", 8)
    assert a is not None and sorted(a.new_blocks) == [0, 1, 2, 3]


def test_no_leak_over_many_requests():
    bm = BlockManager(16, 4)
    for i in range(1000):
        rid = f"r{i}"
        assert bm.allocate(rid, 1 + i % 9) is not None
        bm.allocate(rid, 3)
        bm.truncate(rid, 2)
        if i % 3:
            bm.free(rid)
        if i >= 2:
            bm.free(f"r{i - 2}")  # others finish later (freeing twice is harmless)
    for rid in list(bm.tables):
        bm.free(rid)
    assert bm.num_free == 16
