"""Offload tiers, device-free: LRU with ref-counted loads, write-through, spills, events, and
the block/tier invariants under random workloads (a fake copier tracks what each slot holds)."""

from __future__ import annotations

import concurrent.futures as cf

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.sequence import Request, SamplingParams
from kvmesh.engine.tiers import BlockToStore, OffloadTier
from kvmesh.protocol.kv_events import BlockRemoved, BlockStored

BS = 4


class FakeCopier:
    """Moves block hashes instead of KV: every slot and device block says what it holds."""

    def __init__(self) -> None:
        self.device: dict[int, bytes] = {}
        self.tiers: dict[str, dict[int, bytes]] = {"CPU": {}, "DISK": {}}
        self.loads: list[tuple[str, int]] = []

    def copy_to_tier(self, medium, block_ids, slots) -> None:
        for bid, slot in zip(block_ids, slots, strict=True):
            self.tiers[medium][slot] = self.device[bid]

    def copy_from_tier(self, medium, slots, block_ids) -> None:
        self.loads.append((medium, len(slots)))
        for slot, bid in zip(slots, block_ids, strict=True):
            self.device[bid] = self.tiers[medium][slot]

    def copy_between_tiers(self, src, src_slots, dst, dst_slots) -> None:
        for s, d in zip(src_slots, dst_slots, strict=True):
            self.tiers[dst][d] = self.tiers[src][s]


class SteppedWorker:
    """An async copy worker whose copies land when the test says: `tick()` ends the loads that
    have waited `delay` ticks, `release()` ends them all (and `wait`, as nothing else runs)."""

    def __init__(self, run, delay: int = 0) -> None:
        self.run = run
        self.delay = delay
        self.pending: list[list] = []  # [ticks left, future, loads]

    def submit(self, loads) -> cf.Future:
        fut: cf.Future = cf.Future()
        self.pending.append([self.delay, fut, loads])
        return fut

    def tick(self) -> None:
        for entry in self.pending:
            entry[0] -= 1
        self._land([e for e in self.pending if e[0] < 0])

    def release(self) -> None:
        self._land(list(self.pending))

    def _land(self, entries: list[list]) -> None:
        for entry in entries:
            self.pending.remove(entry)
            try:
                self.run(entry[2])
            except OSError as exc:  # as the thread worker: the scheduler sees the failure
                entry[1].set_exception(exc)
            else:
                entry[1].set_result(None)

    def wait(self, handles, timeout) -> None:
        self.release()


def make_kv(num_blocks=8, cpu=6, disk=10, events=True) -> tuple[KVCacheManager, FakeCopier]:
    kv = KVCacheManager(num_blocks, BS, enable_events=events)
    copier = FakeCopier()
    tiers = [("CPU", cpu)] + ([("DISK", disk)] if disk else [])
    kv.enable_offloading(tiers, copier, bytes_per_block=100)
    return kv, copier


def run_request(kv: KVCacheManager, copier: FakeCopier, rid: str, tokens: list[int]) -> int:
    """Admit, 'compute' (device blocks take the request's hashes), cache, free; cached tokens."""
    req = Request(rid, tokens, SamplingParams(max_tokens=1))
    computed = kv.get_computed_blocks(req)
    for i, block in enumerate(computed.blocks):  # a hit holds exactly the block it claims
        assert copier.device.get(block.block_id) == req.block_hashes[i]
    if kv.allocate_slots(req, req.num_tokens - computed.num_tokens, computed) is None:
        return -1
    req.num_computed_tokens = req.num_tokens
    for i, block in enumerate(kv.req_to_blocks[rid][: len(req.block_hashes)]):
        copier.device[block.block_id] = req.block_hashes[i]
    kv.cache_blocks(req, req.num_tokens)
    kv.flush_offload()
    kv.free(req)
    return computed.num_tokens


def hashes_of(kv: KVCacheManager, tokens: list[int]) -> list[bytes]:
    req = Request("probe", tokens, SamplingParams())
    kv.update_block_hashes(req)
    return req.block_hashes


def check(kv: KVCacheManager, copier: FakeCopier) -> None:
    kv.pool.check_invariants()
    kv.offloader.check_invariants()
    for h, block in kv.pool.cached.items():
        assert copier.device[block.block_id] == h, "a cached device block holds other data"
    for tier in kv.offloader.tiers:
        assert len(tier.entries) <= tier.num_slots
        for h, entry in tier.entries.items():
            assert copier.tiers[tier.medium][entry.slot] == h, f"{tier.medium} slot corrupt"


def test_lru_store_evicts_oldest_unreferenced():
    tier = OffloadTier("CPU", 2, BS)
    a, b, c = (BlockToStore(bytes([i]), (i,) * BS, None) for i in range(3))
    stores, evicted, _ = tier.prepare_store([a, b])
    assert [s for _, s in stores] == [0, 1] and not evicted
    slots = tier.prepare_load([a.block_hash])  # a is being read: it must survive
    _, evicted, _ = tier.prepare_store([c])
    assert [h for h, _ in evicted] == [b.block_hash] and a.block_hash in tier
    tier.complete_load([a.block_hash])
    assert slots == [0] and tier.hit_blocks == 1
    tier.check_invariants()


def test_store_everything_referenced_skips():
    tier = OffloadTier("CPU", 1, BS)
    a, b = (BlockToStore(bytes([i]), (i,) * BS, None) for i in range(2))
    tier.prepare_store([a])
    tier.prepare_load([a.block_hash])
    stores, evicted, dropped = tier.prepare_store([b])
    assert stores == [] and evicted == [] == dropped and b.block_hash not in tier
    tier.check_invariants()


def test_batch_larger_than_tier_keeps_the_newest():
    tier = OffloadTier("CPU", 2, BS)
    blocks = [BlockToStore(bytes([i]), (i,) * BS, None) for i in range(3)]
    stores, evicted, dropped = tier.prepare_store(blocks)
    assert evicted == []  # block 0 was never written: nothing to spill ...
    assert dropped == [blocks[0]]  # ... but the caller may store it further down
    assert [b.block_hash for b, _ in stores] == [bytes([1]), bytes([2])]
    tier.check_invariants()


def test_blocks_a_small_host_tier_cannot_keep_go_straight_to_disk():
    kv, copier = make_kv(num_blocks=12, cpu=2, disk=32)
    prompt = list(range(100, 141))  # 10 full blocks, cached in one step
    run_request(kv, copier, "a", prompt)
    cpu, disk = kv.offloader.tiers
    hashes = hashes_of(kv, prompt)
    assert all(h in cpu or h in disk for h in hashes[:10])
    check(kv, copier)


def test_prefix_evicted_from_device_is_loaded_from_host_not_recomputed():
    kv, copier = make_kv(num_blocks=8, cpu=16, disk=0)
    prompt = list(range(100, 121))  # 5 full blocks + 1 token
    assert run_request(kv, copier, "a", prompt) == 0
    assert run_request(kv, copier, "b", list(range(500, 532))) == 0  # evicts all of a
    assert kv.find_cached(hashes_of(kv, prompt)) == []
    assert run_request(kv, copier, "c", prompt) == 20
    assert copier.loads and copier.loads[-1][0] == "CPU"
    traffic = kv.offloader.take_traffic()["CPU"]
    assert traffic.hit_tokens > 0 and traffic.loaded_bytes == traffic.hit_tokens // BS * 100
    check(kv, copier)


def test_host_eviction_spills_to_disk_and_disk_hits_load():
    kv, copier = make_kv(num_blocks=8, cpu=5, disk=32)
    first = list(range(100, 121))
    run_request(kv, copier, "a", first)
    for i in range(3):  # push a's blocks out of the device and out of the host tier
        run_request(kv, copier, f"f{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 21)))
    cpu, disk = kv.offloader.tiers
    hashes = hashes_of(kv, first)
    assert kv.find_cached(hashes) == [] and not any(h in cpu for h in hashes)
    assert kv.offloader.lookup(hashes) == 5 and all(h in disk for h in hashes[:5])
    assert run_request(kv, copier, "again", first) == 20
    assert copier.loads[-1] == ("DISK", 5)
    assert all(h in cpu for h in hashes[:5])  # loaded blocks are promoted to the host tier
    check(kv, copier)


def test_tier_events_carry_their_medium():
    kv, copier = make_kv(num_blocks=8, cpu=5, disk=32)
    run_request(kv, copier, "a", list(range(100, 121)))
    events = kv.take_events()
    media = {(type(e).__name__, e.medium) for e in events}
    assert ("BlockStored", "GPU") in media and ("BlockStored", "CPU") in media
    cpu_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert sum(len(e.block_hashes) for e in cpu_stored) == 5
    assert cpu_stored[0].token_ids[:BS] == [100, 101, 102, 103]  # self-describing
    run_request(kv, copier, "b", list(range(200, 221)))
    events = kv.take_events()
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events)
    assert any(isinstance(e, BlockStored) and e.medium == "DISK" for e in events)


def test_reset_prefix_cache_clears_tiers():
    kv, copier = make_kv()
    run_request(kv, copier, "a", list(range(100, 121)))
    assert kv.reset_prefix_cache()
    assert all(not t.entries for t in kv.offloader.tiers)
    check(kv, copier)


PREFIXES = [list(range(1000 * k, 1000 * k + 12)) for k in range(1, 5)]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 14), st.integers(0, 3)),
        min_size=1,
        max_size=40,
    ),
    st.integers(6, 12),
    st.integers(1, 8),
    st.integers(0, 12),
)
def test_random_workload_keeps_block_and_tier_invariants(ops, device, cpu, disk):
    kv, copier = make_kv(num_blocks=device, cpu=cpu, disk=disk)
    for n, (prefix, tail_len, salt) in enumerate(ops):
        tokens = PREFIXES[prefix] + [7 + salt] * tail_len + [n]
        run_request(kv, copier, f"r{n}", tokens)
        check(kv, copier)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks, "a request leaked device blocks"
