"""The token ids and block hashes of the sim's prompts, made once per block for router and engine.

The HTTP router hashes a prompt's blocks (router.block_keys) and the engine hashes them again
(kv_cache_manager.update_block_hashes), both with `protocol.hashing.BlockHasher`: the same digests
by construction. The sim hashes each prompt once with that hasher, gives the router the digests'
event ints and the engine the digests (an engine Request whose `block_hashes` are filled hashes
only the blocks after them), and reuses the digests of an earlier prompt that this one extends
run by run (an agent's next turn extends its last prompt), so a turn hashes only its new blocks
and copies the token ids it shares with that prompt.

Invariant: `prepare(runs).digests` equals `BlockHasher.hash_blocks(tokens of runs, 0, None)`,
whatever is cached: a cached prompt p is reused only when p == runs[:k], and then only for the
blocks that lie wholly inside p's tokens (and all of p's token ids).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from kvmesh.protocol.hashing import BlockHasher, block_hash_to_int

Runs = tuple[tuple[int, int], ...]


class RunInts:
    """The token ids of runs (first id, count) as int objects shared by every prompt holding
    the same run: one list per run, in an LRU of at most `capacity_tokens` tokens. A run many
    prompts share (a system prompt, tool definitions, a repository) then has one int object per
    token in every engine's token lists, prefix cache and tiers, instead of one per prompt.
    Only memory changes: the ids are the same values."""

    def __init__(self, capacity_tokens: int = 1 << 22) -> None:
        self.capacity_tokens = capacity_tokens
        self.tokens = 0  # over the kept runs
        self._runs: OrderedDict[tuple[int, int], list[int]] = OrderedDict()

    def extend(self, runs: Runs, into: list[int]) -> list[int]:
        """`into` with the token ids of `runs` appended."""
        kept = self._runs
        for run in runs:
            ids = kept.get(run)
            if ids is None:
                first, n = run
                ids = kept[run] = list(range(first, first + n))
                self.tokens += n
                while self.tokens > self.capacity_tokens and len(kept) > 1:
                    self.tokens -= len(kept.popitem(last=False)[1])
            else:
                kept.move_to_end(run)
            into += ids
        return into


class Prompt(NamedTuple):
    """A prompt made ready for router and engine: its token ids (a fresh list the caller may
    extend), the digests of its full blocks and their event ints (shared with the cache)."""

    token_ids: list[int]
    digests: list[bytes]
    ints: list[int]


class PromptDigests:
    """Token ids, digests and event ints of prompts given as runs of token ids, with an LRU of
    the last prompts to extend, at most `capacity_blocks` blocks over all of them (entries share
    their digest objects: a block costs two list slots per entry that holds it, and its tokens'
    slots). A prompt that extends a cached one copies that one's token list (slots pointing at
    the same int objects) rather than making its ints again."""

    def __init__(self, hasher: BlockHasher, capacity_blocks: int = 1 << 22) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.capacity_blocks = capacity_blocks
        self.blocks = 0  # blocks over the cached entries
        self._memo: OrderedDict[Runs, Prompt] = OrderedDict()
        self.run_ints = RunInts()
        self.blocks_hashed = 0
        self.blocks_reused = 0

    def prepare(self, runs: Runs) -> Prompt:
        """The prompt of `runs`: a fresh token list, and the digests and event ints of its full
        blocks (shared with the cache: copy before changing them)."""
        memo, bs = self._memo, self.block_size
        hit = memo.get(runs)
        if hit is not None:
            memo.move_to_end(runs)
            self.blocks_reused += len(hit.digests)
            return Prompt(hit.token_ids.copy(), hit.digests, hit.ints)
        digests: list[bytes] = []
        ints: list[int] = []
        tokens: list[int] | None = None
        for k in range(len(runs) - 1, 0, -1):
            known = memo.get(runs[:k])
            if known is not None:
                m = len(known.token_ids) // bs  # blocks wholly inside the known prompt
                digests, ints = known.digests[:m], known.ints[:m]
                tokens = self.run_ints.extend(runs[k:], known.token_ids.copy())
                break
        if tokens is None:
            tokens = self.run_ints.extend(runs, [])
        fresh = self.hasher.hash_blocks(tokens, len(digests), digests[-1] if digests else None)
        self.blocks_reused += len(digests)
        self.blocks_hashed += len(fresh)
        digests += fresh
        ints += [block_hash_to_int(d) for d in fresh]
        memo[runs] = Prompt(tokens, digests, ints)
        self.blocks += len(digests)
        while self.blocks > self.capacity_blocks and len(memo) > 1:
            self.blocks -= len(memo.popitem(last=False)[1].digests)
        return Prompt(tokens.copy(), digests, ints)
