"""The block hashes of the sim's prompts, computed once per block for the router and the engine.

The HTTP router hashes a prompt's blocks (router.block_keys) and the engine hashes them again
(kv_cache_manager.update_block_hashes), both with `protocol.hashing.BlockHasher`: the same digests
by construction. The sim hashes each prompt once with that hasher, gives the router the digests'
event ints and the engine the digests (an engine Request whose `block_hashes` are filled hashes
only the blocks after them), and reuses the digests of an earlier prompt that this one extends
run by run (an agent's next turn extends its last prompt), so a turn hashes only its new blocks.

Invariant: `digests(runs)` equals `BlockHasher.hash_blocks(tokens of runs, 0, None)`, whatever is
cached: a cached prompt p is reused only when p == runs[:k], and then only for the blocks that lie
wholly inside p's tokens.
"""

from __future__ import annotations

from collections import OrderedDict

from kvmesh.protocol.hashing import BlockHasher, block_hash_to_int

Runs = tuple[tuple[int, int], ...]


class PromptDigests:
    """Digests and event ints of prompts given as runs of token ids, with an LRU of the last
    prompts' digests to extend, at most `capacity_blocks` blocks over all of them (entries share
    their digest objects: a block costs two list slots per entry that holds it)."""

    def __init__(self, hasher: BlockHasher, capacity_blocks: int = 1 << 22) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.capacity_blocks = capacity_blocks
        self.blocks = 0  # blocks over the cached entries
        self._memo: OrderedDict[Runs, tuple[list[bytes], list[int]]] = OrderedDict()
        self.blocks_hashed = 0
        self.blocks_reused = 0

    def digests(self, runs: Runs, token_ids: list[int]) -> tuple[list[bytes], list[int]]:
        """(digests, event ints) of the full blocks of `token_ids` (the tokens of `runs`). The
        lists are shared with the cache: copy before changing them."""
        memo, bs = self._memo, self.block_size
        hit = memo.get(runs)
        if hit is not None:
            memo.move_to_end(runs)
            self.blocks_reused += len(hit[0])
            return hit
        digests: list[bytes] = []
        ints: list[int] = []
        for k in range(len(runs) - 1, 0, -1):
            known = memo.get(runs[:k])
            if known is not None:
                m = sum(n for _, n in runs[:k]) // bs  # blocks wholly inside the known prompt
                digests, ints = known[0][:m], known[1][:m]
                break
        fresh = self.hasher.hash_blocks(token_ids, len(digests), digests[-1] if digests else None)
        self.blocks_reused += len(digests)
        self.blocks_hashed += len(fresh)
        digests += fresh
        ints += [block_hash_to_int(d) for d in fresh]
        memo[runs] = (digests, ints)
        self.blocks += len(digests)
        while self.blocks > self.capacity_blocks and len(memo) > 1:
            self.blocks -= len(memo.popitem(last=False)[1][0])
        return digests, ints
