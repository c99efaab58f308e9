"""The approximate prefix index: what each endpoint probably caches, learnt from where the
router itself sent each prompt's blocks (GIE's approx-prefix-cache), for the blocks whose KV
events have not come yet. Answers as router.index.PreciseIndex does: consecutive leading blocks
per endpoint. Not thread-safe: one event loop calls it.

Unlike GIE's, an endpoint's LRU drops a prompt's blocks from its end (a block is worth nothing
without the blocks before it, as vLLM frees a request's blocks tail first): as if a record
touched a prompt's blocks last to first. Block keys are chained (a key names its whole prefix),
so what an endpoint holds is a tree of prefixes, and of any prompt a prefix. A lookup finds
where each endpoint's prefix ends by binary search, a few probes per endpoint instead of one
per block of a long context.

Nor does a record touch every block: an endpoint keeps, oldest first, the last blocks of the
prompts recorded for it (touch points). A block's recency is that of the newest touch point at
or below it in the tree, so eviction takes the oldest touch point that is a leaf, and its parent,
once a leaf, is the oldest block left: it goes first in line (a touch point of its own keeps its
place). A touch point that is not a leaf is passed over: its subtree's are newer. So an agent's
next turn costs a binary search and its new blocks, not a touch of its whole context, and the
LRU drops exactly the blocks, in exactly the order, that an LRU of blocks touched last to first
would (a test holds them equal).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvmesh.router.index import MAX_PENDING, endpoint_set


class _Holding:
    """What one endpoint holds. Invariants: ``parent`` has every block it holds (key -> the
    key before it in its prompt, None for a first block), ``kids[k]`` counts the held blocks
    whose parent is k (absent: none), every held block without kids is in ``touched``, and
    ``touched`` holds only held blocks."""

    __slots__ = ("parent", "kids", "touched")

    def __init__(self) -> None:
        self.parent: dict[int, int | None] = {}
        self.kids: dict[int, int] = {}
        self.touched: OrderedDict[int, None] = OrderedDict()  # touch points, oldest first


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
        self._held: dict[str, _Holding] = {}
        self._entries = 0  # blocks held, summed over endpoints == sum of len(pods[k])
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
        n = len(block_keys)
        if not n:
            return
        held = self._held.get(endpoint)
        if held is None:
            held = self._held[endpoint] = _Holding()
        parent_of = held.parent
        lo, hi = 0, n  # the blocks the endpoint holds: a prefix, found by binary search
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if block_keys[mid - 1] in parent_of:
                lo = mid
            else:
                hi = mid - 1
        if lo < n:
            self._add(endpoint, held, block_keys, lo)
        touched, last = held.touched, block_keys[-1]
        if last in touched:
            touched.move_to_end(last)
        else:
            touched[last] = None
        while len(parent_of) > self.capacity_per_endpoint:
            self._evict(endpoint, held)

    def _add(self, endpoint: str, held: _Holding, block_keys: Sequence[int], start: int) -> None:
        """The blocks of ``block_keys`` from ``start`` on, each the child of the one before."""
        pods, parent_of, kids = self._pods, held.parent, held.kids
        memo: dict[frozenset[str] | None, frozenset[str]] = {}
        parent = block_keys[start - 1] if start else None
        for key in block_keys[start:]:
            if key in parent_of:  # (keys that are not chains: held already, elsewhere)
                parent = key
                continue
            parent_of[key] = parent
            if parent is not None:
                kids[parent] = kids.get(parent, 0) + 1
            self._entries += 1
            old = pods.get(key)
            new = memo.get(old)
            if new is None:
                new = memo[old] = self._intern(old | {endpoint} if old else frozenset((endpoint,)))
            self._canon[new][1] += 1
            if old is not None:
                self._release(old)
            pods[key] = new
            parent = key

    def _evict(self, endpoint: str, held: _Holding) -> None:
        """Drop the endpoint's least recently touched block: a leaf (see the module's note)."""
        touched, kids = held.touched, held.kids
        key, _ = touched.popitem(last=False)
        while key in kids:  # not a leaf: its subtree's touch points are newer
            key, _ = touched.popitem(last=False)
        parent = held.parent.pop(key)
        self._drop(endpoint, key)
        if parent is not None:
            left = kids[parent] - 1
            if left:
                kids[parent] = left
            else:  # a leaf now, as old as the block just dropped: first in line
                del kids[parent]
                if parent not in touched:
                    touched[parent] = None
                    touched.move_to_end(parent, last=False)

    def remove_endpoint(self, endpoint: str) -> None:
        if self._pending:
            self.settle()
        held = self._held.pop(endpoint, None)
        for key in held.parent if held is not None else ():
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
