"""The hit-rate ceiling of a request sequence: the prompt tokens an infinite prefix cache on one
engine would serve, with vLLM's prefix-caching rules. Bench and sim both report it, and compare
their hit rates with it, so it has one definition here.

vLLM's rules, which the kvmesh engine follows:
- only whole blocks are cached and matched, each known by its tokens and everything before it;
- a request matches at most (n - 1) // block_size blocks of its n prompt tokens: the last
  prompt token is always computed, to produce the first output's logits, so a prompt that is an
  exact multiple of the block size can reuse all but its last block;
- after a request, all n // block_size full blocks of its prompt are cached.
Requests are taken in list order (arrival order); eviction never happens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Runs = Sequence[tuple[int, int]]  # (first token id, count): runs of consecutive token ids


@dataclass(frozen=True, slots=True)
class Ceiling:
    hit_tokens: int
    prompt_tokens: int
    block_size: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "hit_rate": self.hit_rate,
            "block_size": self.block_size,
        }


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """The most blocks of an n-token prompt a prefix cache can serve: never its last token."""
    return max(0, (num_tokens - 1) // block_size)


def runs_of(token_ids: Sequence[int]) -> list[tuple[int, int]]:
    """A token-id list as runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for t in token_ids:
        if runs and runs[-1][0] + runs[-1][1] == t:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((t, 1))
    return runs


def block_contents(runs: Runs, block_size: int) -> list[tuple[tuple[int, int], ...]]:
    """Each full block of the prompt as its maximal runs of consecutive ids: a function of the
    block's tokens alone (however the prompt was cut into runs), so equal tuples mean equal
    blocks."""
    merged: list[tuple[int, int]] = []
    for first, n in runs:  # join runs that continue each other: runs become maximal
        if n <= 0:
            continue
        if merged and merged[-1][0] + merged[-1][1] == first:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((first, n))
    blocks: list[tuple[tuple[int, int], ...]] = []
    pieces: list[tuple[int, int]] = []
    fill = 0
    for first, n in merged:
        pos = 0
        while pos < n:
            take = min(block_size - fill, n - pos)
            pieces.append((first + pos, take))
            pos, fill = pos + take, fill + take
            if fill == block_size:
                blocks.append(tuple(pieces))
                pieces, fill = [], 0
    return blocks


def hit_ceiling(prompts: Iterable[Runs], block_size: int) -> Ceiling:
    """The ceiling of these prompts (runs of token ids), in order. A block is known by its
    tokens and its whole prefix (a chained hash, as vLLM's block hashes)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    seen: set[int] = set()
    hit = total = 0
    for runs in prompts:
        n = sum(count for _, count in runs)
        total += n
        keys, parent = [], 0
        for content in block_contents(runs, block_size):
            parent = hash((parent, content))
            keys.append(parent)
        limit, run = max_hit_blocks(n, block_size), 0
        while run < limit and keys[run] in seen:
            run += 1
        hit += run * block_size
        seen.update(keys)
    return Ceiling(hit, total, block_size)
