"""Prefix indexes: precise (from KV events) and approximate (from routing decisions)."""

from __future__ import annotations

import gc
import random
import time
import tracemalloc

import pytest

from kvmesh.protocol.hashing import block_hash_to_int
from kvmesh.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from kvmesh.router.approx_index import ApproximateIndex
from kvmesh.router.index import PreciseIndex


def stored(hashes, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(hashes, medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def batch(*events) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))


# ---- PreciseIndex ----------------------------------------------------------------------------
def test_precise_consecutive_leading_blocks_per_endpoint():
    idx = PreciseIndex()
    idx.apply("a", batch(stored([1, 2, 3, 4])))
    idx.apply("b", batch(stored([1, 2])))
    idx.apply("c", batch(stored([2, 3, 4])))  # no block 1: no leading match
    assert idx.longest_match([1, 2, 3, 4, 5]) == {"a": 4.0, "b": 2.0}
    assert idx.longest_match([1, 2, 3], ["b", "c", "zzz"]) == {"b": 2.0}
    assert idx.longest_match([9, 1, 2]) == {}
    assert idx.longest_match([], ["a"]) == {}
    assert idx.longest_match([1, 2], []) == {}
    # a hole stops the match even though later blocks are held
    idx.apply("a", batch(removed([2])))
    assert idx.longest_match([1, 2, 3, 4]) == {"a": 1.0, "b": 2.0}
    assert idx.num_entries() == 4 + 2 + 3 - 1


def test_precise_medium_weights_and_per_medium_removal():
    idx = PreciseIndex()
    idx.apply("a", batch(stored([1, 2, 3, 4], "GPU"), stored([3, 4, 5], "CPU")))
    idx.apply("b", batch(stored([1, 2, 3], "cpu"), stored([4], "DISK")))
    got = idx.longest_match([1, 2, 3, 4, 5, 6])
    assert got["a"] == pytest.approx(4 + 0.8)
    assert got["b"] == pytest.approx(3 * 0.8 + 0.5)
    # GPU copies evicted, CPU copies stay
    idx.apply("a", batch(removed([3, 4], "GPU")))
    assert idx.longest_match([1, 2, 3, 4, 5])["a"] == pytest.approx(2 + 3 * 0.8)
    idx.apply("a", batch(removed([3], "CPU")))
    assert idx.longest_match([1, 2, 3, 4, 5])["a"] == pytest.approx(2.0)
    # removing a medium the endpoint does not hold changes nothing
    idx.apply("b", batch(removed([1, 2], "GPU")))
    assert idx.longest_match([1])["b"] == pytest.approx(0.8)


def test_precise_unknown_or_missing_medium_counts_as_gpu_and_custom_weights():
    idx = PreciseIndex(medium_weights={"GPU": 1.0, "CPU": 0.25})
    idx.apply("a", batch(stored([1, 2], None), stored([3], "HBM3")))
    assert idx.longest_match([1, 2, 3]) == {"a": 3.0}
    idx.apply("a", batch(removed([1], None)))  # None medium removes the GPU copy
    assert idx.longest_match([1, 2, 3]) == {}
    idx.apply("b", batch(stored([1], "CPU")))
    assert idx.longest_match([1]) == {"b": 0.25}


def test_precise_bytes_hashes_and_wire_roundtrip():
    digests = [bytes([i]) * 32 for i in range(1, 4)]
    ints = [block_hash_to_int(d) for d in digests]
    idx = PreciseIndex()
    payload = encode_batch(batch(stored(digests), AllBlocksCleared(), stored(digests[:2])))
    idx.apply("a", decode_batch(payload))
    assert idx.longest_match(ints) == {"a": 2.0}
    idx.apply("a", batch(removed(digests[1:])))
    assert idx.longest_match(ints) == {"a": 1.0}


def test_precise_all_blocks_cleared_and_remove_endpoint():
    idx = PreciseIndex()
    idx.apply("a", batch(stored([1, 2, 3])))
    idx.apply("b", batch(stored([1, 2, 3], "CPU")))
    idx.apply("c", batch(stored([1])))
    idx.apply("a", batch(AllBlocksCleared()))
    assert idx.longest_match([1, 2, 3]) == pytest.approx({"b": 2.4, "c": 1.0})
    assert idx.num_entries() == 4
    idx.remove_endpoint("b")
    idx.remove_endpoint("nobody")
    assert idx.longest_match([1, 2, 3]) == {"c": 1.0}
    assert idx.num_entries() == 1
    idx.remove_endpoint("c")  # blocks 2, 3 now have no holders at all
    assert idx.longest_match([1, 2, 3]) == {}
    assert idx.num_entries() == 0
    idx.apply("a", batch(stored([1, 2])))  # dead blocks come back to life
    assert idx.longest_match([1, 2, 3]) == {"a": 2.0}
    assert idx.num_entries() == 2


def test_precise_capacity_evicts_least_recently_stored_or_matched():
    idx = PreciseIndex(capacity=6)
    idx.apply("a", batch(stored([1, 2, 3])))
    idx.apply("b", batch(stored([1, 2, 3])))
    assert idx.num_entries() == 6
    idx.apply("a", batch(stored([4])))  # 7 entries: evicts block 1 (2 entries)
    assert idx.num_entries() == 5
    assert idx.longest_match([1, 2, 3]) == {}
    assert idx.longest_match([2, 3]) == {"a": 2.0, "b": 2.0}  # a hit refreshes 2 and 3
    idx.apply("c", batch(stored([7])))
    idx.apply("c", batch(stored([8])))  # 7 entries: the oldest block is now 4
    assert idx.num_entries() == 6
    assert idx.longest_match([2, 3, 4]) == {"a": 2.0, "b": 2.0}
    assert idx.longest_match([7, 8]) == {"c": 2.0}
    for i in range(100):
        idx.apply(f"e{i % 5}", batch(stored(range(i * 3, i * 3 + 3), "CPU")))
        assert idx.num_entries() <= 6


def test_precise_without_touch_evicts_in_store_order():
    idx = PreciseIndex(capacity=3, touch_on_match=False)
    idx.apply("a", batch(stored([1, 2, 3])))
    assert idx.longest_match([1]) == {"a": 1.0}
    idx.apply("a", batch(stored([4])))
    assert idx.longest_match([1]) == {}
    idx.apply("a", batch(stored([2])))  # storing again refreshes
    idx.apply("a", batch(stored([5])))
    assert idx.longest_match([2]) == {"a": 1.0}
    assert idx.longest_match([3]) == {}


def test_precise_matches_naive_model_under_random_events():
    """Interning and in-place endpoint removal agree with a plain dict-of-dicts model."""
    rng = random.Random(7)
    idx = PreciseIndex(capacity=10**9)
    model: dict[int, dict[str, set[str]]] = {}
    weights = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5}
    endpoints = [f"e{i}" for i in range(6)]
    for _ in range(3000):
        ep = rng.choice(endpoints)
        r = rng.random()
        if r < 0.5:
            medium = rng.choice(list(weights))
            start = rng.randrange(20)
            keys = list(range(start, start + rng.randrange(1, 8)))
            idx.apply(ep, batch(stored(keys, medium)))
            for k in keys:
                model.setdefault(k, {}).setdefault(ep, set()).add(medium)
        elif r < 0.9:
            medium = rng.choice(list(weights))
            keys = rng.sample(range(30), rng.randrange(1, 6))
            idx.apply(ep, batch(removed(keys, medium)))
            for k in keys:
                model.get(k, {}).get(ep, set()).discard(medium)
        elif r < 0.97:
            idx.apply(ep, batch(AllBlocksCleared()))
            for holders in model.values():
                holders.pop(ep, None)
        else:
            idx.remove_endpoint(ep)
            for holders in model.values():
                holders.pop(ep, None)
        query = list(range(rng.randrange(3), 30))
        expect: dict[str, float] = {}
        for ep2 in endpoints:
            total = 0.0
            for k in query:
                media = model.get(k, {}).get(ep2)
                if not media:
                    break
                total += max(weights[m] for m in media)
            if total:
                expect[ep2] = total
        subset = rng.sample(endpoints, 3)
        assert idx.longest_match(query) == pytest.approx(expect)
        assert idx.longest_match(query, subset) == pytest.approx(
            {e: v for e, v in expect.items() if e in subset}
        )
        assert idx.num_entries() == sum(
            1 for holders in model.values() for media in holders.values() if media
        )


def test_precise_longest_match_speed_1000_blocks_64_endpoints():
    rng = random.Random(0)
    keys = [rng.getrandbits(64) for _ in range(1000)]
    endpoints = [f"ep{i}" for i in range(64)]
    idx = PreciseIndex()
    for i, ep in enumerate(endpoints):
        idx.apply(ep, batch(stored(keys[: 15 * (i + 1)], "CPU" if i % 2 else "GPU")))
        idx.apply(ep, batch(stored(keys)))
    best = float("inf")
    for _ in range(20):
        t = time.perf_counter()
        got = idx.longest_match(keys, endpoints)
        best = min(best, time.perf_counter() - t)
    assert got == {ep: 1000.0 for ep in endpoints}
    assert best < 0.02  # ~0.2 ms on an idle core; generous for a shared machine


def test_precise_bytes_per_entry_measured():
    n = 50_000
    rng = random.Random(1)
    gc.collect()
    tracemalloc.start()
    try:
        idx = PreciseIndex()
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(n // 500):
            idx.apply("a", batch(stored([rng.getrandbits(64) for _ in range(500)])))
        gc.collect()
        measured = (tracemalloc.get_traced_memory()[0] - base) / idx.num_entries()
    finally:
        tracemalloc.stop()
    estimate = idx.bytes_per_entry_estimate()
    assert idx.num_entries() == n
    assert 0.6 * measured < estimate < 1.6 * measured, (measured, estimate)


# ---- ApproximateIndex ----------------------------------------------------------------------
def test_approximate_record_and_match():
    idx = ApproximateIndex()
    idx.record("a", [1, 2, 3, 4])
    idx.record("b", [1, 2, 9])
    idx.record("c", [2, 3])
    assert idx.longest_match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert idx.longest_match([1, 2, 9], ["b", "c"]) == {"b": 3}
    assert idx.longest_match([7]) == {}
    assert idx.num_entries() == 9
    idx.record("a", [1, 2])  # already there: refresh only
    assert idx.num_entries() == 9


def test_approximate_lru_per_endpoint():
    idx = ApproximateIndex(capacity_per_endpoint=4)
    idx.record("a", [1, 2, 3, 4])  # touched 4, 3, 2, 1: a's oldest is the prompt's last block
    idx.record("b", [1, 2])
    idx.record("a", [5])  # evicts a's 4, not its 1: what a holds is still a prefix
    assert idx.longest_match([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert idx.num_entries() == 6
    idx.record("a", [6, 7])  # evicts 3 and 2
    assert idx.longest_match([1, 2, 3]) == {"a": 1, "b": 2}
    idx.remove_endpoint("b")
    idx.remove_endpoint("zzz")
    assert idx.longest_match([1, 2, 3]) == {"a": 1}
    assert idx.num_entries() == 4


def holding_invariants(idx: ApproximateIndex) -> dict[str, set[int]]:
    """Each endpoint's held blocks, after checking the invariants of what it holds."""
    out = {}
    for ep, held in idx._held.items():
        kids: dict[int, int] = {}
        for parent in held.parent.values():
            if parent is not None:
                assert parent in held.parent  # a block's prefix is held: prefix-closed
                kids[parent] = kids.get(parent, 0) + 1
        assert held.kids == kids
        assert set(held.touched) <= set(held.parent)  # touch points are held blocks
        assert set(held.parent) - set(kids) <= set(held.touched)  # every leaf is one
        assert len(held.parent) <= idx.capacity_per_endpoint
        out[ep] = set(held.parent)
    return out


@pytest.mark.parametrize(("seed", "cap"), [(3, 12), (5, 4), (7, 30), (11, 1)])
def test_approximate_matches_naive_model(seed, cap):
    """Random prompts over a small tree of shared prefixes, keyed as chains (a key names its
    whole prefix, as block hashes do), against a model of per-endpoint LRUs touched last block
    first: the binary searches agree with a walk over every block, and each endpoint holds
    exactly the model's blocks (its touch points evict as a block LRU does)."""
    rng = random.Random(seed)
    idx = ApproximateIndex(capacity_per_endpoint=cap)
    model: dict[str, list[int]] = {}  # endpoint -> keys, most recent last
    endpoints = ["a", "b", "c", "d"]
    ids: dict[tuple[int, ...], int] = {}  # a prefix -> its key

    def prompt_keys() -> list[int]:
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
        return [ids.setdefault(tuple(tokens[: j + 1]), len(ids) + 1) for j in range(len(tokens))]

    for _ in range(3000):
        ep = rng.choice(endpoints)
        if rng.random() < 0.95:
            keys = prompt_keys()
            idx.record(ep, keys)
            lru = model.setdefault(ep, [])
            for k in reversed(keys):
                if k in lru:
                    lru.remove(k)
                lru.append(k)
            del lru[: max(0, len(lru) - cap)]
        else:
            idx.remove_endpoint(ep)
            model.pop(ep, None)
        query = prompt_keys()
        expect = {}
        for e, keys in model.items():
            n = 0
            while n < len(query) and query[n] in keys:
                n += 1
            if n:
                expect[e] = n
        assert idx.longest_match(query) == expect
        assert idx.longest_match(query, ["a", "c"]) == {
            e: v for e, v in expect.items() if e in ("a", "c")
        }
        assert idx.num_entries() == sum(len(v) for v in model.values())
        held = holding_invariants(idx)
        assert {e: b for e, b in held.items() if b} == {e: set(v) for e, v in model.items() if v}
