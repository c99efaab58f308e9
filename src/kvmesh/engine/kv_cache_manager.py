"""KVCacheManager: per-request block tables over the BlockPool, with automatic prefix caching.
Asynchronous tier loads (engine.kv_loads) build on it; it knows them only as TierLoads."""

from __future__ import annotations

from collections.abc import Sized
from itertools import takewhile
from operator import attrgetter
from typing import NamedTuple, Protocol

from kvmesh.engine.block_pool import BlockPool, KVCacheBlock
from kvmesh.engine.offload import KVOffloader
from kvmesh.engine.sequence import Request
from kvmesh.engine.tiers import BlockToStore, OffloadTier
from kvmesh.protocol.hashing import BlockHasher, block_hash_to_int, event_extra_keys

_ref_cnt = attrgetter("ref_cnt")


class ComputedBlocks(NamedTuple):
    blocks: list[KVCacheBlock]
    num_tokens: int


class TierLoads(Protocol):
    """Prefixes copied up from lower tiers while their requests wait, as the scheduler drives
    them (engine.kv_loads.AsyncKVLoads is the one): ``computed_or_park`` gives the prefix to
    admit a request with, or None while it waits; ``poll`` the requests to resume."""

    @property
    def jobs(self) -> Sized: ...  # the copies in flight
    @property
    def busy(self) -> bool: ...
    @property
    def num_waiting(self) -> int: ...
    def computed_or_park(self, request: Request) -> ComputedBlocks | None: ...
    def poll(self) -> list[Request]: ...
    def wait(self, timeout: float = ...) -> None: ...
    def release(self, request: Request) -> None: ...
    def release_all(self) -> None: ...
    def forget(self, request: Request) -> None: ...


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        enable_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hasher = BlockHasher(hash_algo, block_size)
        self.pool = BlockPool(
            num_blocks,
            block_size,
            enable_caching=enable_caching,
            hash_to_event=block_hash_to_int,
            enable_events=enable_events,
        )
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks of the request registered in the map
        self.prefix_cache_queries = 0  # tokens looked up at first admission, not yet reported
        self.prefix_cache_hits = 0
        self.offloader: KVOffloader | None = None
        self.loads: TierLoads | None = None  # set: tier loads run on a copy worker

    def enable_offloading(self, tiers: list[tuple[str, int]], copier, bytes_per_block: int):
        """Add lower tiers [(medium, slots)], top first; `copier` (the runner) moves the KV."""

        def emit(event) -> None:
            if self.pool.enable_events:
                self.pool.events.append(event)

        self.offloader = KVOffloader(
            [OffloadTier(m, n, self.block_size, block_hash_to_int, emit) for m, n in tiers],
            copier,
            bytes_per_block,
        )
        queue = self.offloader.queue_store
        self.pool.on_cached = lambda block, h, tokens, parent: queue(
            block.block_id, BlockToStore(h, tuple(tokens), parent)
        )
        return self.offloader

    def flush_offload(self) -> None:
        """Write newly cached device blocks through to the top tier; call before any device
        block is written again (end of step, before imports and loads)."""
        if self.offloader is not None:
            blocks = self.pool.blocks
            self.offloader.flush(lambda bid, h: blocks[bid].block_hash == h)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def update_block_hashes(self, request: Request) -> None:
        """Hash every newly full block of the request (prompt and generated tokens alike)."""
        if not self.enable_caching:
            return
        start = len(request.block_hashes)
        if (start + 1) * self.block_size > request.num_tokens:
            return
        parent = request.block_hashes[-1] if start else None
        request.block_hashes.extend(
            self.hasher.hash_blocks(
                request.all_token_ids,
                start,
                parent,
                cache_salt=request.cache_salt,
                lora_name=request.lora_name,
            )
        )

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix, in full blocks, leaving at least the last token to compute."""
        if not self.enable_caching:
            return ComputedBlocks([], 0)
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.find_cached(request.block_hashes[:max_blocks])
        if self.offloader is not None and len(hits) < max_blocks:
            extra = None
            if request.cache_salt is not None:
                salt = request.cache_salt
                extra = [event_extra_keys(i, cache_salt=salt) for i in range(max_blocks)]
            hits += self.load_from_tiers(
                hits, request.block_hashes[:max_blocks], extra, request.lora_name
            )
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def find_cached(self, block_hashes: list[bytes]) -> list[KVCacheBlock]:
        """The device blocks of the longest cached prefix of these hashes."""
        # BlockPool.get_cached_block over the hashes, up to the first miss (a block is truthy)
        hits: list[KVCacheBlock] = list(takewhile(bool, map(self.pool.cached.get, block_hashes)))
        if self.offloader is not None and hits:  # a device hit keeps its copies warm too
            self.offloader.tiers[0].touch(b.block_hash for b in hits if b.block_hash)
        return hits

    def load_from_tiers(
        self,
        hits: list[KVCacheBlock],
        block_hashes: list[bytes],
        extra_keys: list | None = None,
        lora_name: str | None = None,
    ) -> list[KVCacheBlock]:
        """Load the blocks after the device hits that lower tiers hold into fresh device blocks,
        registered as cached (ref 0, like any cached block); as many as free blocks allow."""
        assert self.offloader is not None
        self.flush_offload()  # queued stores read device blocks that may be reused below
        start = len(hits)
        n = self.offloader.lookup(block_hashes[start:])
        n = min(n, self.pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0))
        if n <= 0:
            return []
        self.pool.touch(hits)  # the hits must survive the allocation below
        new = self.pool.get_new_blocks(n)
        wanted = block_hashes[start : start + n]
        try:
            self.offloader.load(wanted, [b.block_id for b in new])
        except (OSError, RuntimeError, ValueError):
            self.pool.free_blocks(reversed(new))
            self.pool.free_blocks(reversed(hits))
            return []
        tokens = [0] * (start * self.block_size)
        for h in wanted:
            tier = next(t for t in self.offloader.tiers if h in t)
            tokens.extend(tier.entries[h].token_ids)
        self.pool.cache_full_blocks(
            hits + new, block_hashes, start, start + n, tokens, extra_keys, lora_name
        )
        self.pool.free_blocks(reversed(new))
        self.pool.free_blocks(reversed(hits))
        return new

    def record_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    def take_prefix_stats(self) -> tuple[int, int]:
        """(queried, hit) tokens since the last call, for the Prometheus counters."""
        stats = (self.prefix_cache_queries, self.prefix_cache_hits)
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        return stats

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens after the computed ones; None when blocks run out."""
        held = self.req_to_blocks.get(request.request_id)
        if held is None:
            held = self.req_to_blocks[request.request_id] = []
        total = request.num_computed_tokens + num_new_tokens
        hits = computed.blocks if computed is not None else ()
        if computed is not None:
            total += computed.num_tokens
        num_needed = -(-total // self.block_size) - len(held) - len(hits)
        if hits:
            # computed blocks with ref 0 sit in the free queue: taking them shrinks what is free
            num_evictable_hits = list(map(_ref_cnt, hits)).count(0)
            if num_needed > self.pool.num_free_blocks - num_evictable_hits:
                return None
            self.pool.touch(hits)
            held.extend(hits)
            self.num_cached_blocks[request.request_id] = len(held)
        if num_needed <= 0:  # most decode steps: the last block has room
            return []
        if num_needed > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.get_new_blocks(num_needed)
        held.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks made full by the first num_tokens, once their KV is computed.

        Caching after the forward pass (not at allocation) means a cached block always holds
        valid KV, whatever preemption or abort happens between scheduling and execution."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_cached = self.num_cached_blocks.get(rid, 0)
        if num_tokens // self.block_size <= num_cached:  # no block newly full: most decode steps
            return
        self.update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_full <= num_cached:
            return
        extra = None
        if request.cache_salt is not None:
            extra = [event_extra_keys(i, cache_salt=request.cache_salt) for i in range(num_full)]
        self.pool.cache_full_blocks(
            self.req_to_blocks[rid],
            request.block_hashes,
            num_cached,
            num_full,
            request.all_token_ids,
            extra_keys=extra,
            lora_name=request.lora_name,
        )
        self.num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so the tail is evicted before shared prefixes."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def detach(self, request: Request) -> list[KVCacheBlock]:
        """Take a request's blocks out of its table without dropping their references."""
        self.num_cached_blocks.pop(request.request_id, None)
        return self.req_to_blocks.pop(request.request_id, [])

    def adopt_blocks(
        self, request: Request, payload_hashes: list[bytes], first: int = 0
    ) -> list[int]:
        """Indices of the request's full blocks that a payload of blocks first, first + 1, ...
        can fill: the leading ones whose hashes equal the request's own (at most all but the
        last token), minus those already cached here."""
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        limit = min(len(payload_hashes), max_blocks - first)
        own = request.block_hashes[first:]
        verified = 0
        while verified < limit and payload_hashes[verified] == own[verified]:
            verified += 1
        return [
            i
            for i in range(first, first + verified)
            if self.pool.get_cached_block(request.block_hashes[i]) is None
        ]

    def cache_imported(
        self, request: Request, indices: list[int], blocks: list[KVCacheBlock]
    ) -> None:
        """Register imported blocks as ordinary prefix-cache blocks (BlockStored included),
        then release them: the request finds them like any cached prefix."""
        by_index = dict(zip(indices, blocks, strict=True))
        n = max(indices) + 1
        row = [
            by_index.get(i) or self.pool.get_cached_block(request.block_hashes[i]) for i in range(n)
        ]
        if any(b is None for b in row):  # a gap (evicted meanwhile): register what is whole
            n = row.index(None)
            row = row[:n]
        self.pool.cache_full_blocks(
            row, request.block_hashes, 0, n, request.all_token_ids, lora_name=request.lora_name
        )
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        return self.offloader.clear() if self.offloader is not None else True

    def take_events(self) -> list:
        return self.pool.take_events()
