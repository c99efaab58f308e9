"""KVOffloader: the device cache's lower tiers, top (host DRAM) to bottom (disk).

Policy, and why:
- Write-through to the top tier, as vLLM's OffloadingConnector does: every block registered in
  the device prefix cache (computed, loaded or imported) is copied to the top tier right after
  the step that cached it. Device eviction then costs nothing (no copy on the allocation path,
  which would stall the step that needs the block), and the copy overlaps compute on a device
  with its own copy engine.
- Spill on eviction below the top: a block the top tier evicts is copied to the next tier
  (disk) before its slot is reused, so the disk only receives blocks that outlived the host tier
  instead of every computed block.
- A prefix found only in a lower tier is loaded into fresh device blocks and registered as
  device cache blocks, so the scheduler treats it as computed (never recomputed). Loaded blocks
  are written through to the top tier like any other, which promotes disk blocks to host.
- Loads are asynchronous by default (`--kv-offloading-async`, see `kv_loads`): the copy runs on
  a copy worker while the request waits in WAITING_FOR_REMOTE_KVS and the others keep decoding;
  `load` is the synchronous path (the old behaviour, and peer exports, which need the KV now).
- Stores (and the spills below them) stay synchronous, at the end of the step: an asynchronous
  store would have to hold its device blocks (unevictable) until the copy ends, as vLLM's
  `request_finished` delays freeing; here the device -> host copy is one gather (enqueued, not
  awaited, on CUDA), cheap next to a load from disk, so holding blocks would cost cache space
  for little gain. A spill to disk writes only what the host tier evicts, a few blocks a step.

The copies themselves are the runner's (`ModelRunner.copy_*`): the torch runner enqueues stores
on the compute stream without blocking the host on CUDA and runs them synchronously on CPU;
asynchronous loads run on its copy worker (a CUDA stream of their own on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvmesh.engine.tiers import BlockToStore, OffloadTier


class TierLoad(NamedTuple):
    """One tier's share of a load: block_hashes[i] in slots[i] -> device block_ids[i]."""

    medium: str
    block_hashes: list[bytes]
    slots: list[int]
    block_ids: list[int]


@dataclass(slots=True)
class TierTraffic:
    """Bytes moved in and out of one tier since the last `take_traffic`."""

    loaded_bytes: int = 0
    stored_bytes: int = 0
    hit_tokens: int = 0


class KVOffloader:
    def __init__(self, tiers: Sequence[OffloadTier], copier, bytes_per_block: int) -> None:
        assert tiers, "an offloader needs at least one tier"
        assert len({t.medium for t in tiers}) == len(tiers), "one tier per medium"
        self.tiers = list(tiers)
        self.copier = copier  # a ModelRunner: copy_to_tier, copy_from_tier, copy_between_tiers
        self.bytes_per_block = bytes_per_block
        self.pending: list[tuple[int, BlockToStore]] = []  # (device block id, block) to store
        self.traffic = {t.medium: TierTraffic() for t in self.tiers}

    # ---- stores (device -> top tier, then spills downwards) ------------------------------
    def queue_store(self, block_id: int, block: BlockToStore) -> None:
        self.pending.append((block_id, block))

    def flush(self, still_cached) -> None:
        """Copy the queued device blocks to the top tier; `still_cached(block_id, hash)` says
        whether the device block still holds that block (its data is then intact)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        by_hash = {b.block_hash: bid for bid, b in pending if still_cached(bid, b.block_hash)}
        self._store_from_device(
            0, [b for bid, b in pending if by_hash.get(b.block_hash) == bid], by_hash
        )

    def _store_from_device(self, level: int, blocks: list[BlockToStore], device_ids) -> None:
        """Store device blocks in tiers[level]; those the batch itself pushed out again (a
        tier smaller than one step's blocks) go on to the tier below, still from the device."""
        if not blocks or level >= len(self.tiers):
            return
        tier = self.tiers[level]
        stores, evicted, dropped = tier.prepare_store(blocks)
        self._spill(level, evicted)
        if stores:
            ids = [device_ids[b.block_hash] for b, _ in stores]
            self.copier.copy_to_tier(tier.medium, ids, [s for _, s in stores])
            self.traffic[tier.medium].stored_bytes += len(stores) * self.bytes_per_block
        self._store_from_device(level + 1, dropped, device_ids)

    def _spill(self, level: int, evicted: list) -> None:
        """Copy blocks evicted from tiers[level] into tiers[level + 1] (if any) before their
        slots are reused; what that tier evicts in turn spills further down."""
        if not evicted or level + 1 >= len(self.tiers):
            return
        src, dst = self.tiers[level], self.tiers[level + 1]
        slot_of = {h: e.slot for h, e in evicted}
        blocks = [BlockToStore(h, e.token_ids, e.parent) for h, e in evicted]
        stores, deeper, _ = dst.prepare_store(blocks)  # a spill larger than dst keeps its newest
        self._spill(level + 1, deeper)
        if stores:
            self.copier.copy_between_tiers(
                src.medium,
                [slot_of[b.block_hash] for b, _ in stores],
                dst.medium,
                [s for _, s in stores],
            )
            self.traffic[dst.medium].stored_bytes += len(stores) * self.bytes_per_block

    # ---- loads (a lower tier -> device) --------------------------------------------------
    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading hashes some tier holds (each block from whichever tier has it)."""
        n = 0
        for h in block_hashes:
            if not any(h in t for t in self.tiers):
                break
            n += 1
        return n

    def prepare_load(
        self, block_hashes: Sequence[bytes], block_ids: Sequence[int]
    ) -> list[TierLoad]:
        """The copies that fill these device blocks, each from the highest tier holding its
        block; every block read stays referenced (never evicted) until `complete_load`."""
        assert len(block_hashes) == len(block_ids)
        loads: list[TierLoad] = []
        for level, tier in enumerate(self.tiers):
            picked = [
                (h, bid)
                for h, bid in zip(block_hashes, block_ids, strict=True)
                if h in tier and not any(h in t for t in self.tiers[:level])
            ]
            if picked:
                hashes = [h for h, _ in picked]
                slots = tier.prepare_load(hashes)
                loads.append(TierLoad(tier.medium, hashes, slots, [bid for _, bid in picked]))
        return loads

    def run_loads(self, loads: Sequence[TierLoad]) -> None:
        """The copies themselves: on the engine thread (sync) or the copy worker (async)."""
        for load in loads:
            self.copier.copy_from_tier(load.medium, load.slots, load.block_ids)

    def complete_load(self, loads: Sequence[TierLoad], ok: bool = True) -> None:
        tiers = {t.medium: t for t in self.tiers}
        for load in loads:
            tier = tiers[load.medium]
            tier.complete_load(load.block_hashes)
            if ok:
                moved = self.traffic[load.medium]
                moved.loaded_bytes += len(load.slots) * self.bytes_per_block
                moved.hit_tokens += len(load.slots) * tier.block_size

    def load(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Copy the blocks into these device blocks now, on the calling thread."""
        loads = self.prepare_load(block_hashes, block_ids)
        ok = False
        try:
            self.run_loads(loads)
            ok = True
        finally:
            self.complete_load(loads, ok)

    def take_traffic(self) -> dict[str, TierTraffic]:
        traffic = self.traffic
        self.traffic = {t.medium: TierTraffic() for t in self.tiers}
        return traffic

    def clear(self) -> bool:
        self.pending.clear()
        return all([t.clear() for t in self.tiers])

    def check_invariants(self) -> None:
        for tier in self.tiers:
            tier.check_invariants()
            assert all(e.ref_cnt == 0 for e in tier.entries.values()), "a load left a reference"
