"""Token ids -> the engine's block hashes (as KV-event ints), cached for growing prompts.

Each hashed sequence keeps its digests; a fingerprint of its token ids every ``hash_span``
blocks (a span checkpoint: xxh3-128 with a seed drawn per process, so collisions cannot be
crafted; one could only mis-key a routing hint, engines hash their own blocks) finds them again,
so a known prefix costs no hashing.

Not thread-safe: the router calls it from one thread at a time.
"""

from __future__ import annotations

import secrets
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvmesh.protocol.hashing import BlockHasher, block_hash_to_int


@dataclass
class BlockKeyStats:
    blocks_hashed: int = 0  # block digests computed with the hash function
    blocks_reused: int = 0  # block digests taken from the cache


@dataclass
class TokenizerStats(BlockKeyStats):
    """The router tokenizer's counts (router.tokens), the block keys' among them."""

    encodes: int = 0  # raw text encodes requested
    exact_hits: int = 0  # whole text found in the cache
    prefix_hits: int = 0  # cached prefix reused, only a tail encoded
    full_encodes: int = 0  # encoded from the start (cold, short, or seam check failed)
    seam_failures: int = 0
    whole_hits: int = 0  # whole prompt found in the LRU of whole prompts: nothing computed
    chars_encoded: int = 0  # characters actually passed to the tokenizer
    uncached: int = 0  # prompts encoded and keyed whole, no cache touched (a thread held them)


class _Seq:
    """Block digests (and their event ints) of one hashed token sequence; ``points`` counts the
    span checkpoints leading to it. Blocks of sequences with points > 0 count to the budget."""

    __slots__ = ("digests", "ints", "points")

    def __init__(self, digests: list[bytes], ints: list[int]) -> None:
        self.digests, self.ints, self.points = digests, ints, 0


class BlockKeyCache:
    """Invariant: ``blocks`` is the number of blocks over the sequences some checkpoint leads to,
    and at most ``capacity_blocks`` after each call (the oldest checkpoints go first)."""

    def __init__(
        self,
        block_size: int,
        hash_algo: str,
        capacity_blocks: int,
        hash_span: int,
        stats: BlockKeyStats | None = None,
    ) -> None:
        self.block_size = block_size
        self.hasher = BlockHasher(hash_algo, block_size)
        self.capacity_blocks = capacity_blocks
        self.hash_span = hash_span
        self.stats = stats if stats is not None else BlockKeyStats()
        self.blocks = 0
        self._spans: OrderedDict[bytes, _Seq] = OrderedDict()  # span checkpoint -> sequence
        self._seed = secrets.randbits(64)

    def block_keys(
        self, token_ids: Sequence[int], cache_salt: str | None = None, lora_name: str | None = None
    ) -> list[int]:
        """The engine's block hashes of the full blocks, as KV-event ints."""
        bs, n, st = self.block_size, len(token_ids) // self.block_size, self.stats
        if n == 0:
            return []
        try:
            raw = memoryview(array("I", token_ids[: n * bs]).tobytes())
        except (OverflowError, TypeError):  # not uint32 ids: hash without the cache
            st.blocks_hashed += n
            digests = self.hasher.hash_blocks(
                token_ids, 0, None, cache_salt=cache_salt, lora_name=lora_name
            )
            return [block_hash_to_int(d) for d in digests]
        salt = repr((cache_salt, lora_name)).encode("utf-8", "surrogatepass")
        h = xxhash.xxh3_128(salt, seed=self._seed)
        span = 4 * bs * self.hash_span
        points = []  # points[k-1]: digest of (salt, lora, ids of the first k spans)
        for a in range(span, len(raw) + 1, span):
            h.update(raw[a - span : a])
            points.append(h.digest())
        spans, k = self._spans, len(points)
        while k and points[k - 1] not in spans:
            k -= 1
        m = k * self.hash_span
        known = spans[points[k - 1]] if k else _Seq([], [])
        digests, ints = known.digests[:m], known.ints[:m]
        fresh = self.hasher.hash_blocks(
            token_ids[: n * bs],
            m,
            digests[-1] if digests else None,
            cache_salt=cache_salt,
            lora_name=lora_name,
        )
        digests += fresh
        ints += [block_hash_to_int(d) for d in fresh]
        st.blocks_hashed += len(fresh)
        st.blocks_reused += m
        if points:
            seq = _Seq(digests, ints)
            self.blocks += n
            for p in points:  # re-register all: superseded sequences are freed
                old = spans.pop(p, None)
                if old is not None:
                    self._unref(old)
                spans[p] = seq
                seq.points += 1
            while self.blocks > self.capacity_blocks and spans:
                self._unref(spans.popitem(last=False)[1])
        return list(ints)

    def _unref(self, seq: _Seq) -> None:
        seq.points -= 1
        if seq.points == 0:
            self.blocks -= len(seq.ints)
