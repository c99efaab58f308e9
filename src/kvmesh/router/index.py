"""Prefix indexes: which endpoint caches which KV blocks.

``PreciseIndex`` (here) mirrors the engines' caches from their KV events (llm-d-kv-cache's
in-memory index); ``router.approx_index.ApproximateIndex`` remembers where the router itself
sent each prefix (GIE's approx-prefix-cache). Both answer "how many consecutive leading blocks
of this request does each endpoint hold", walking the request's block keys once while the set
of still-matching endpoints shrinks, so a query costs O(blocks) dict lookups plus C-level set
operations, not O(blocks x endpoints). Neither is thread-safe: one event loop calls them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence, Set
from itertools import groupby, islice

from kvmesh.protocol.hashing import block_hash_to_int
from kvmesh.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

DEFAULT_MEDIUM_WEIGHTS: dict[str, float] = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5, "STORAGE": 0.5}

# Measured with tracemalloc (tests/test_router_index.py) on CPython 3.11-3.13, 64-bit: one block
# key held by one endpoint costs ~141 bytes (uint64 int 40, OrderedDict slot + index + node ~100).
# Holder objects are shared between blocks, so they add almost nothing per entry.
_BYTES_PER_BLOCK = 142.0
MAX_PENDING = 64  # deferred records or touches applied at once beyond this many


class _Holders:
    """Who holds a block: endpoint -> bitmask of media. Interned and shared by many blocks.

    Invariants: ``refs`` is the number of blocks pointing at this object; ``deficit`` holds
    ``1 - weight`` for the endpoints whose best medium weighs other than 1.0; the index's
    ``_views[key]`` is this object or an equal one (after remove_endpoint mutated it in place).
    """

    __slots__ = ("masks", "deficit", "key", "refs")

    def __init__(self, masks: dict[str, int], key: frozenset, deficit: dict[str, float]) -> None:
        self.masks = masks
        self.key = key
        self.deficit = deficit
        self.refs = 0


class PreciseIndex:
    """What each endpoint caches, learnt from its KV events (engine block hash ints -> endpoint
    -> media)."""

    def __init__(
        self,
        capacity: int = 2_000_000,
        medium_weights: dict[str, float] | None = None,
        touch_on_match: bool = True,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.touch_on_match = touch_on_match
        weights = DEFAULT_MEDIUM_WEIGHTS if medium_weights is None else medium_weights
        self._weights = {k.upper(): float(v) for k, v in weights.items()}
        self._default_weight = self._weights.get("GPU", 1.0)  # unknown media count as GPU
        self._bits: dict[str, int] = {}  # medium name -> one bit
        self._bit_weight: list[float] = []
        self._mask_weight: dict[int, float] = {}
        # Blocks in LRU order (oldest first). A block may point at an emptied holder after
        # remove_endpoint; such dead blocks count towards capacity but hold no entries.
        self._blocks: OrderedDict[int, _Holders] = OrderedDict()
        self._views: dict[frozenset, _Holders] = {}
        self._by_endpoint: dict[str, set[_Holders]] = {}
        self._empty = _Holders({}, frozenset(), {})  # never stored in _blocks
        self._entries = 0  # sum of len(h.masks) over blocks: (block, endpoint) pairs
        # matches whose blocks are yet to be made most recently used: only the eviction order
        # depends on them, so they wait until the next change (or settle(), once the request
        # they served is on its way)
        self._touches: list[tuple[Sequence[int], int]] = []

    def settle(self) -> None:
        """Make the blocks of the matches since the last change most recently used."""
        touches, self._touches = self._touches, []
        move = self._blocks.move_to_end
        for keys, n in touches:  # (a block may have gone meanwhile: never, as changes settle)
            deque(map(move, islice(keys, n)), 0)

    # ---- ingestion ------------------------------------------------------------------------
    def apply(self, endpoint: str, batch: KVEventBatch) -> None:
        if self._touches:
            self.settle()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(endpoint, event.block_hashes, self._bit(event.medium))
            elif isinstance(event, BlockRemoved):
                self._remove(endpoint, event.block_hashes, self._bit(event.medium))
            elif isinstance(event, AllBlocksCleared):
                self.remove_endpoint(endpoint)
        if self._entries > self.capacity or len(self._blocks) > self.capacity:
            self._evict()

    def _store(self, ep: str, hashes: Sequence[int | bytes], bit: int) -> None:
        blocks, empty = self._blocks, self._empty
        memo: dict[_Holders, _Holders] = {}  # old holder -> holder with (ep, bit) added
        for h in hashes:
            key = h if type(h) is int else block_hash_to_int(h)
            old = blocks.get(key)
            if old is None:
                old = empty
            else:
                blocks.move_to_end(key)
            new = memo.get(old)
            if new is None:
                mask = old.masks.get(ep, 0)
                new = old if mask & bit else self._derive(old, ep, mask | bit)
                memo[old] = new
            if new is not old:
                self._entries += len(new.masks) - len(old.masks)
                new.refs += 1
                if old is not empty:
                    self._release(old)
                blocks[key] = new

    def _remove(self, ep: str, hashes: Sequence[int | bytes], bit: int) -> None:
        blocks, empty = self._blocks, self._empty
        memo: dict[_Holders, _Holders] = {}
        for h in hashes:
            key = h if type(h) is int else block_hash_to_int(h)
            old = blocks.get(key)
            if old is None:
                continue
            new = memo.get(old)
            if new is None:
                mask = old.masks.get(ep, 0)
                new = self._derive(old, ep, mask & ~bit) if mask & bit else old
                memo[old] = new
            if new is old:
                continue
            self._entries += len(new.masks) - len(old.masks)
            self._release(old)
            if new is empty:
                del blocks[key]
            else:
                new.refs += 1
                blocks[key] = new  # keeps its LRU position

    def remove_endpoint(self, endpoint: str) -> None:
        """Forget everything the endpoint holds: O(distinct holder sets), not O(blocks)."""
        if self._touches:
            self.settle()
        for h in self._by_endpoint.pop(endpoint, ()):
            # Mutate in place: every block sharing h loses the endpoint at once.
            if self._views.get(h.key) is h:
                del self._views[h.key]
            del h.masks[endpoint]
            h.deficit.pop(endpoint, None)
            self._entries -= h.refs
            h.key = frozenset(h.masks.items())
            if h.masks:
                self._views.setdefault(h.key, h)

    def _evict(self) -> None:
        blocks = self._blocks
        while self._entries > self.capacity or len(blocks) > self.capacity:
            _, h = blocks.popitem(last=False)
            self._entries -= len(h.masks)
            self._release(h)

    def _bit(self, medium: str | None) -> int:
        name = "GPU" if medium is None or len(self._bits) >= 16 else medium.upper()
        bit = self._bits.get(name)
        if bit is None:  # at most 16 media (and "GPU"): masks stay small ints
            bit = self._bits[name] = 1 << len(self._bits)
            self._bit_weight.append(self._weights.get(name, self._default_weight))
        return bit

    def _weight(self, mask: int) -> float:
        w = self._mask_weight.get(mask)
        if w is None:
            w = max(wt for i, wt in enumerate(self._bit_weight) if mask >> i & 1)
            self._mask_weight[mask] = w
        return w

    def _derive(self, old: _Holders, ep: str, mask: int) -> _Holders:
        """The interned holder equal to ``old`` with ``ep``'s mask set (0 removes ep)."""
        masks = dict(old.masks)
        if mask:
            masks[ep] = mask
        else:
            masks.pop(ep, None)
        if not masks:
            return self._empty
        key = frozenset(masks.items())
        h = self._views.get(key)
        if h is None:
            deficit = {e: 1.0 - w for e, m in masks.items() if (w := self._weight(m)) != 1.0}
            h = self._views[key] = _Holders(masks, key, deficit)
            for e in masks:
                self._by_endpoint.setdefault(e, set()).add(h)
        return h

    def _release(self, h: _Holders) -> None:
        h.refs -= 1
        if h.refs == 0:
            if self._views.get(h.key) is h:
                del self._views[h.key]
            for e in h.masks:
                holders = self._by_endpoint.get(e)
                if holders is not None:
                    holders.discard(h)

    # ---- queries ----------------------------------------------------------------------------
    def longest_match(
        self, block_hashes: Sequence[int], endpoints: Iterable[str] | None = None
    ) -> dict[str, float]:
        """Per endpoint: sum over its consecutive leading held blocks of the best medium weight.

        Endpoints without a hit are absent. Blocks share interned holder objects, so weights
        are charged per (holder, run of blocks) and subset checks run once per holder; the
        walk over the blocks and their LRU touches are C-level iterations.
        """
        blocks = self._blocks
        active = endpoint_set(endpoints)
        if active is not None and not active:
            return {}
        out: dict[str, float] = {}  # endpoints that dropped out -> their match
        deficit: dict[str, float] = {}  # endpoint -> sum of (1 - weight) over its matched blocks
        pending: dict[_Holders, int] = {}  # blocks per holder (with deficits) since last shrink
        superset: set[_Holders] = set()  # holders known to contain `active` (it only shrinks)
        n = 0  # blocks matched by all of `active`
        for h, run in groupby(map(blocks.get, block_hashes)):  # runs of one holder
            if h is None:  # the first block not held: groupby read no further
                break
            if h not in superset:
                held = h.masks.keys()
                if active is None:
                    active = set(held)
                elif not held >= active:
                    _charge(deficit, pending, active)
                    pending.clear()
                    still = active & held
                    if n:
                        _settle(out, active - still, n, deficit)
                    active = still
                if not active:
                    break
                superset.add(h)
            count = len(list(run))
            if h.deficit:
                pending[h] = pending.get(h, 0) + count
            n += count
        if n and self.touch_on_match:  # the matched blocks, in order: most recently used
            self._touches.append((block_hashes, n))
            if len(self._touches) > MAX_PENDING:
                self.settle()
        if active and n:
            _charge(deficit, pending, active)
            _settle(out, active, n, deficit)
        return out

    def num_entries(self) -> int:
        """(block, endpoint) pairs held; at most ``capacity``."""
        return self._entries

    def num_blocks(self) -> int:
        return len(self._blocks)

    def bytes_per_entry_estimate(self) -> float:
        """Approximate heap bytes per (block, endpoint) entry (see _BYTES_PER_BLOCK)."""
        holders = sum(200 + 100 * len(h.masks) for h in self._views.values())
        total = _BYTES_PER_BLOCK * len(self._blocks) + holders
        return total / max(1, self._entries) if self._entries else _BYTES_PER_BLOCK


def endpoint_set(endpoints: Iterable[str] | None) -> Set[str] | None:
    """The endpoints a query is over (None: all); a set is used as given, never changed."""
    if endpoints is None or isinstance(endpoints, (set, frozenset)):
        return endpoints
    return set(endpoints)


def _settle(out: dict[str, float], ended: Set[str], n: int, deficit: dict[str, float]) -> None:
    """`ended` matched `n` blocks, less their deficits (charged in full by now): into `out`."""
    out.update(dict.fromkeys(ended, n - 0.0))
    for e, d in deficit.items():
        if e in ended:
            out[e] = n - d


def _charge(deficit: dict[str, float], pending: dict[_Holders, int], active: set[str]) -> None:
    """Add the deficits of ``pending`` runs to the endpoints that matched them (``active``)."""
    for h, count in pending.items():
        for e, d in h.deficit.items():
            if e in active:
                deficit[e] = deficit.get(e, 0.0) + d * count
