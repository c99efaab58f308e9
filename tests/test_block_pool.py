"""BlockPool invariants under random allocate / cache / touch / free sequences, and LRU order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvmesh.protocol.kv_events import BlockRemoved, BlockStored


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_free_queue_is_fifo_with_o1_remove():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    assert q.num_free == 4


def test_lru_eviction_and_events():
    pool = BlockPool(
        4, 2, hash_to_event=lambda d: int.from_bytes(d[-8:], "big"), enable_events=True
    )
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [h(1), h(2)], 0, 2, [1, 2, 3, 4])
    stored = pool.take_events()
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    assert stored[0].block_hashes == [1, 2] and stored[0].token_ids == [1, 2, 3, 4]
    assert stored[0].parent_block_hash is None and stored[0].medium == "GPU"
    pool.free_blocks(reversed(a))  # tail first: block of h(2) is evicted before h(1)
    assert pool.get_cached_block(h(1)) is a[0]
    new = pool.get_new_blocks(3)  # two never-used blocks first, then the LRU cached one
    assert a[1] in new and a[0] not in new
    removed = pool.take_events()
    assert removed == [BlockRemoved(block_hashes=[2], medium="GPU")]
    assert pool.get_cached_block(h(2)) is None and pool.get_cached_block(h(1)) is a[0]
    pool.touch([a[0]])  # a hit revives the free cached block
    assert a[0].ref_cnt == 1 and pool.num_free_blocks == 0
    pool.check_invariants()


def test_duplicate_content_keeps_first_copy():
    pool = BlockPool(4, 2, enable_events=True, hash_to_event=lambda d: d)
    a, b = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [h(7)], 0, 1, [5, 6])
    pool.cache_full_blocks(b, [h(7)], 0, 1, [5, 6])
    assert pool.get_cached_block(h(7)) is a[0] and b[0].block_hash is None
    assert len(pool.take_events()) == 1
    pool.check_invariants()


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(3, 2, enable_events=True, hash_to_event=lambda d: d)
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [h(1)], 0, 1, [1, 2])
    assert not pool.reset_prefix_cache()
    pool.free_blocks(a)
    pool.take_events()
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h(1)) is None
    assert type(pool.take_events()[0]).__name__ == "AllBlocksCleared"


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 4), st.integers(0, 6)),
        st.tuples(st.just("free"), st.integers(0, 10), st.just(0)),
        st.tuples(st.just("hit"), st.integers(0, 6), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_invariants_under_random_operations(seq):
    pool = BlockPool(8, 4, enable_events=True, hash_to_event=lambda d: d)
    owners: list[list[KVCacheBlock]] = []
    for op, a, b in seq:
        if op == "alloc":
            if a > pool.num_free_blocks:
                continue
            blocks = pool.get_new_blocks(a)
            hashes = [h(b * 10 + i) for i in range(a)]  # content keys may repeat across ops
            pool.cache_full_blocks(blocks, hashes, 0, a, list(range(a * 4)))
            owners.append(blocks)
        elif op == "free" and owners:
            pool.free_blocks(reversed(owners.pop(a % len(owners))))
        elif op == "hit":
            block = pool.get_cached_block(h(a * 10))
            if block is not None:
                pool.touch([block])
                owners.append([block])
        pool.check_invariants()
        held = sum(len(o) for o in owners)
        refs = sum(blk.ref_cnt for blk in pool.blocks)
        assert refs == held  # every reference belongs to exactly one owner
        assert pool.num_free_blocks == sum(1 for blk in pool.blocks if blk.ref_cnt == 0)
    for o in owners:
        pool.free_blocks(o)
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
