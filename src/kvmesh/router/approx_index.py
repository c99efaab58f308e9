"""The approximate prefix index: what each endpoint probably caches, learnt from where the
router itself sent each prompt's blocks (GIE's approx-prefix-cache), for the blocks whose KV
events have not come yet. Answers as router.index.PreciseIndex does: consecutive leading blocks
per endpoint. Not thread-safe: one event loop calls it.

Unlike GIE's, a record touches a prompt's blocks last to first, so an endpoint's LRU drops a
prompt's blocks from its end (a block is worth nothing without the blocks before it, as vLLM
frees a request's blocks tail first). Block keys are chained (a key names its whole prefix),
so every record of a block also records the blocks before it, later: what an endpoint holds of
any prompt is a prefix of it. A lookup then finds where each endpoint's prefix ends by binary
search, a few probes per endpoint instead of one per block of a long context.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvmesh.router.index import MAX_PENDING, endpoint_set


class ApproximateIndex:
    """What each endpoint probably caches, learnt from the router's own past decisions
    (GIE/llm-d approx-prefix-cache)."""

    def __init__(self, capacity_per_endpoint: int = 31_250) -> None:
        if capacity_per_endpoint <= 0:
            raise ValueError(f"capacity_per_endpoint must be positive, got {capacity_per_endpoint}")
        self.capacity_per_endpoint = capacity_per_endpoint
        # key -> endpoints sent it. Values are interned frozensets shared by many keys;
        # _canon[s] = [s, number of keys pointing at s].
        self._pods: dict[int, frozenset[str]] = {}
        self._canon: dict[frozenset[str], list] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}  # per endpoint, oldest first
        self._entries = 0  # sum of len(lru) == sum of len(pods[k])
        # records not yet applied: every read and change applies them first (settle), so no
        # caller can tell; the router settles once the request that made one is on its way
        self._pending: list[tuple[str, Sequence[int]]] = []

    def record(self, endpoint: str, block_keys: Sequence[int]) -> None:
        """`endpoint` was sent a prompt of `block_keys` (read later: never changed)."""
        self._pending.append((endpoint, block_keys))
        if len(self._pending) > MAX_PENDING:
            self.settle()

    def settle(self) -> None:
        """Apply the records made since the last read."""
        pending, self._pending = self._pending, []
        for endpoint, keys in pending:
            self._record(endpoint, keys)

    def _record(self, endpoint: str, block_keys: Sequence[int]) -> None:
        lru = self._lru.get(endpoint)
        if lru is None:
            lru = self._lru[endpoint] = OrderedDict()
        pods = self._pods
        memo: dict[frozenset[str] | None, frozenset[str]] = {}
        for key in reversed(block_keys):  # the first block touched last: evicted last
            if key in lru:
                lru.move_to_end(key)
                continue
            lru[key] = None
            self._entries += 1
            old = pods.get(key)
            new = memo.get(old)
            if new is None:
                new = memo[old] = self._intern(old | {endpoint} if old else frozenset((endpoint,)))
            self._canon[new][1] += 1
            if old is not None:
                self._release(old)
            pods[key] = new
        while len(lru) > self.capacity_per_endpoint:
            key, _ = lru.popitem(last=False)
            self._drop(endpoint, key)

    def remove_endpoint(self, endpoint: str) -> None:
        if self._pending:
            self.settle()
        for key in self._lru.pop(endpoint, ()):
            self._drop(endpoint, key)

    def _drop(self, endpoint: str, key: int) -> None:
        old = self._pods[key]
        self._entries -= 1
        self._release(old)
        if len(old) == 1:
            del self._pods[key]
        else:
            new = self._intern(old - {endpoint})
            self._canon[new][1] += 1
            self._pods[key] = new

    def _intern(self, s: frozenset[str]) -> frozenset[str]:
        entry = self._canon.get(s)
        if entry is None:
            entry = self._canon[s] = [s, 0]
        return entry[0]

    def _release(self, s: frozenset[str]) -> None:
        entry = self._canon[s]
        entry[1] -= 1
        if entry[1] == 0:
            del self._canon[s]

    def longest_match(
        self, block_keys: Sequence[int], endpoints: Iterable[str] | None = None
    ) -> dict[str, int]:
        """Consecutive leading blocks per endpoint; endpoints with none are absent. Each holds a
        prefix of the keys (see the module's note), so the blocks every endpoint of a set holds
        end where a binary search says, and the set shrinks there: one search per drop."""
        if self._pending:
            self.settle()
        active = endpoint_set(endpoints)
        if (active is not None and not active) or not block_keys:
            return {}
        get, last = self._pods.get, len(block_keys) - 1
        first = get(block_keys[0])
        if first is None:
            return {}
        held = first if active is None else first & active  # all hold blocks 0..lo
        counts: dict[str, int] = {}
        lo = 0
        while held:
            hi = last
            while lo < hi:  # the last block that all of `held` hold
                mid = (lo + hi + 1) // 2
                s = get(block_keys[mid])
                if s is not None and s >= held:
                    lo = mid
                else:
                    hi = mid - 1
            if lo == last:
                counts.update(dict.fromkeys(held, lo + 1))
                break
            s = get(block_keys[lo + 1])
            still = held & s if s is not None else frozenset()
            counts.update(dict.fromkeys(held - still, lo + 1))
            held, lo = still, lo + 1
        return counts

    def num_entries(self) -> int:
        """(block, endpoint) pairs recorded; at most capacity_per_endpoint per endpoint."""
        if self._pending:
            self.settle()
        return self._entries
