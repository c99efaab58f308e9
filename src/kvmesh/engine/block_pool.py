"""BlockPool: the KV cache's blocks, their ref counts, the prefix-cache map and the LRU free queue.

Invariants (checked by `check_invariants`):
- a block is in the free queue  <=>  its ref_cnt == 0
- a block with a hash is in `cached` under that hash, and `cached` maps only to such blocks
- the free queue's order is eviction order: the front is evicted first (LRU)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvmesh.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """Intrusive doubly-linked list of free blocks; O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The first n blocks, unlinked (n popleft() calls in one pass)."""
        if n > self.num_free:
            raise ValueError("no free blocks")
        out = []
        block = self.head.next_free
        for _ in range(n):
            assert block is not None
            out.append(block)
            after = block.next_free
            block.prev_free = block.next_free = None
            block = after
        assert block is not None
        self.head.next_free = block
        block.prev_free = self.head
        self.num_free -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, "block is already free"
        last = self.tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free += 1

    def extend(self, blocks: list[KVCacheBlock]) -> None:
        """Append blocks in their order (len(blocks) append() calls in one pass)."""
        last = self.tail.prev_free
        assert last is not None
        for block in blocks:
            assert block.prev_free is None and block.next_free is None, "block is already free"
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = self.tail
        self.tail.prev_free = last
        self.num_free += len(blocks)

    def __iter__(self):
        node = self.head.next_free
        while node is not None and node is not self.tail:
            yield node
            node = node.next_free


class BlockPool:
    """Owns every block. Cached blocks with ref_cnt 0 stay reusable until popped for new data."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_to_event: Callable[[bytes], int | bytes] | None = None,
        enable_events: bool = False,
        medium: str = "GPU",
    ) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.hash_to_event = hash_to_event or (lambda h: h)
        self.enable_events = enable_events
        self.medium = medium
        self.events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self.num_evictions = 0
        # called for each newly cached block: (block, hash, its tokens, parent hash or None)
        self.on_cached: Callable[[KVCacheBlock, bytes, list[int], bytes | None], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free, as vLLM's)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a free cached block leaves the free queue."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks, {self.num_free_blocks} free")
        out = self.free_queue.popleft_n(n)
        evicted: list[int | bytes] = []
        for block in out:
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                evicted.append(self.hash_to_event(block.block_hash))
                self._uncache(block)
            block.ref_cnt = 1
        if evicted:
            self.num_evictions += len(evicted)
            if self.enable_events:
                self.events.append(BlockRemoved(block_hashes=evicted, medium=self.medium))
        return out

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; pass blocks in eviction order (the tail of a request first)."""
        freed = []  # appended to the free queue in this order, as they reach ref 0
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        self.free_queue.extend(freed)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[bytes],
        num_cached: int,
        num_full: int,
        token_ids: list[int],
        extra_keys: list | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Register blocks[num_cached:num_full] under their hashes; emit one BlockStored."""
        if not self.enable_caching or num_full <= num_cached:
            return
        fresh: list[int] = []
        for i in range(num_cached, num_full):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None:  # already registered (a hit)
                assert block.block_hash == block_hash
                continue
            if block_hash in self.cached:  # same content computed twice: keep the first copy
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block
            fresh.append(i)
            if self.on_cached is not None:
                bs = self.block_size
                parent = block_hashes[i - 1] if i else None
                self.on_cached(block, block_hash, token_ids[i * bs : (i + 1) * bs], parent)
        if self.enable_events and fresh:
            self._emit_stored(fresh, block_hashes, token_ids, extra_keys, lora_name)

    def _emit_stored(self, fresh, block_hashes, token_ids, extra_keys, lora_name) -> None:
        """One BlockStored per consecutive run of newly cached blocks of one request."""
        bs = self.block_size
        runs: list[list[int]] = []
        for i in fresh:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self.events.append(
                BlockStored(
                    block_hashes=[self.hash_to_event(block_hashes[j]) for j in run],
                    parent_block_hash=self.hash_to_event(block_hashes[first - 1])
                    if first
                    else None,
                    token_ids=token_ids[first * bs : (last + 1) * bs],
                    block_size=bs,
                    lora_id=None,
                    medium=self.medium,
                    lora_name=lora_name,
                    extra_keys=[extra_keys[j] if extra_keys else None for j in run],
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )

    def _uncache(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no request holds a block."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.enable_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events

    def check_invariants(self) -> None:
        free = list(self.free_queue)
        assert len(free) == self.free_queue.num_free
        assert len({id(b) for b in free}) == len(free), "block twice in the free queue"
        free_ids = {b.block_id for b in free}
        for block in self.blocks:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), block
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, "hashed block not in the map"
        for h, block in self.cached.items():
            assert block.block_hash == h
