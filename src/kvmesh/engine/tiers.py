"""Offload tiers below the device cache (host DRAM, disk): LRU stores of whole blocks by hash.

A tier never touches KV data: it owns `num_slots` slots and says which slot holds which block
hash; the runner copies the bytes (see `ModelRunner.copy_to_tier`). Loads take a reference on
the blocks they read, so a block being loaded is never evicted; stores evict the least recently
used unreferenced blocks to make room, and report them so the caller may spill them to the tier
below before their slots are overwritten.

Invariants (checked by `check_invariants`):
- every slot is either free or held by exactly one entry
- an entry with ref_cnt > 0 is never evicted
- the entries' order is recency: the first is evicted first
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvmesh.protocol.kv_events import BlockRemoved, BlockStored

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"


@dataclass(slots=True)
class TierEntry:
    slot: int
    token_ids: tuple[int, ...]  # the block's tokens, so tier events describe themselves
    parent: bytes | None  # hash of the block before it in its request, None for the first
    ref_cnt: int = 0


@dataclass(slots=True)
class BlockToStore:
    block_hash: bytes
    token_ids: tuple[int, ...]
    parent: bytes | None


class OffloadTier:
    def __init__(
        self,
        medium: str,
        num_slots: int,
        block_size: int,
        hash_to_event: Callable[[bytes], int | bytes] = lambda h: h,
        emit: Callable[[object], None] | None = None,
    ) -> None:
        assert num_slots > 0
        self.medium = medium
        self.num_slots = num_slots
        self.block_size = block_size
        self.hash_to_event = hash_to_event
        self.emit = emit
        self.entries: OrderedDict[bytes, TierEntry] = OrderedDict()
        # slots [fresh, num_slots) were never used; freed ones are reused first, last freed
        # first, then fresh ones in order (slot 0 first): a tier of millions of slots costs
        # nothing until it fills
        self.free_slots: list[int] = []
        self.fresh = 0
        self.hit_blocks = 0  # blocks loaded from this tier
        self.stored_blocks = 0
        self.evicted_blocks = 0

    @property
    def usage(self) -> float:
        return len(self.entries) / self.num_slots

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def lookup(self, block_hashes: Iterable[bytes]) -> int:
        """How many of the leading hashes this tier holds, consecutively."""
        n = 0
        for h in block_hashes:
            if h not in self.entries:
                break
            n += 1
        return n

    def touch(self, block_hashes: Iterable[bytes]) -> None:
        for h in block_hashes:
            if h in self.entries:
                self.entries.move_to_end(h)

    def prepare_load(self, block_hashes: list[bytes]) -> list[int]:
        """Slots of the blocks to read; each is referenced until `complete_load`."""
        slots = []
        for h in block_hashes:
            entry = self.entries[h]
            entry.ref_cnt += 1
            self.entries.move_to_end(h)
            slots.append(entry.slot)
        return slots

    def complete_load(self, block_hashes: list[bytes]) -> None:
        for h in block_hashes:
            entry = self.entries[h]
            assert entry.ref_cnt > 0, f"load of {h.hex()} completed twice"
            entry.ref_cnt -= 1
        self.hit_blocks += len(block_hashes)

    def prepare_store(
        self, blocks: list[BlockToStore]
    ) -> tuple[list[tuple[BlockToStore, int]], list[tuple[bytes, TierEntry]], list[BlockToStore]]:
        """(slots for the blocks not yet held (held ones are touched); the entries evicted to
        free them, whose slots the caller must read (to spill them) before writing; the blocks
        of this batch that a later one of it pushed out again, never written). Blocks that
        find no slot (everything referenced) are skipped."""
        stores: dict[bytes, tuple[BlockToStore, int]] = {}  # insertion order = store order
        evicted: list[tuple[bytes, TierEntry]] = []
        dropped: list[BlockToStore] = []
        for block in blocks:
            if block.block_hash in self.entries:
                self.entries.move_to_end(block.block_hash)
                continue
            if not self.free_slots and self.fresh == self.num_slots:
                victim = self._evict_one()
                if victim is None:
                    break
                if victim[0] in stores:  # stored earlier in this batch: never written
                    dropped.append(stores.pop(victim[0])[0])
                else:
                    evicted.append(victim)
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                slot, self.fresh = self.fresh, self.fresh + 1
            self.entries[block.block_hash] = TierEntry(slot, block.token_ids, block.parent)
            stores[block.block_hash] = (block, slot)
        self.stored_blocks += len(stores)
        self.evicted_blocks += len(evicted)
        if self.emit is not None:
            if evicted:
                removed = [self.hash_to_event(h) for h, _ in evicted]
                self.emit(BlockRemoved(block_hashes=removed, medium=self.medium))
            for run in _chains([b for b, _ in stores.values()]):
                self.emit(self._stored_event(run))
        return list(stores.values()), evicted, dropped

    def _evict_one(self) -> tuple[bytes, TierEntry] | None:
        for h, entry in self.entries.items():
            if entry.ref_cnt == 0:
                del self.entries[h]
                self.free_slots.append(entry.slot)
                return h, entry
        return None

    def _stored_event(self, run: list[BlockToStore]) -> BlockStored:
        first = run[0]
        return BlockStored(
            block_hashes=[self.hash_to_event(b.block_hash) for b in run],
            parent_block_hash=self.hash_to_event(first.parent) if first.parent else None,
            token_ids=[t for b in run for t in b.token_ids],
            block_size=self.block_size,
            lora_id=None,
            medium=self.medium,
            lora_name=None,
            extra_keys=[None] * len(run),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    def clear(self) -> bool:
        """Forget every block; refused while a load holds one."""
        if any(e.ref_cnt for e in self.entries.values()):
            return False
        self.entries.clear()
        self.free_slots, self.fresh = [], 0
        return True

    def check_invariants(self) -> None:
        held = [e.slot for e in self.entries.values()]
        free = [*self.free_slots, *range(self.fresh, self.num_slots)]
        assert len(held) + len(free) == self.num_slots, "slot leaked or doubled"
        assert len(set(held) | set(free)) == self.num_slots, "slot owned twice"
        assert all(s < self.fresh for s in self.free_slots), "a fresh slot freed"
        assert all(e.ref_cnt >= 0 for e in self.entries.values())


def _chains(blocks: list[BlockToStore]) -> list[list[BlockToStore]]:
    """Split into runs where each block's parent is the block before it (one event each)."""
    runs: list[list[BlockToStore]] = []
    for b in blocks:
        if runs and b.parent == runs[-1][-1].block_hash:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs
