"""Peer source selection: name an engine to pull prefix blocks from, as llm-d's P2P flow does.

After the picker has chosen where a request runs, the endpoint holding the longest prefix of it
is named as the source (header `x-kv-cache-source-host-port: host:port`) when its lead over the
chosen endpoint is at least `min_cached_token_delta` tokens. Among endpoints within one block of
the best, one is drawn with weight 1 / (1 + queue), so one hot source is not asked by everyone.
The chosen engine pulls the blocks it lacks and verifies them; a wrong name costs a miss only.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

PEER_HEADER = "x-kv-cache-source-host-port"


@dataclass(slots=True)
class PeerSourceConfig:
    min_cached_token_delta: int = 2048  # llm-d's minCachedTokenDelta as its P2P guide sets it
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.min_cached_token_delta < 1:
            raise ValueError("min_cached_token_delta must be at least 1 token")
        if self.block_size < 1:
            raise ValueError("block_size must be positive")


def choose_peer_source(
    chosen: str,
    matched_blocks: Mapping[str, float],
    config: PeerSourceConfig,
    queue: Mapping[str, int] | None = None,
    rng: random.Random | None = None,
) -> str | None:
    """The endpoint `chosen` should pull from, or None. `matched_blocks`: leading blocks of the
    request each endpoint holds (the precise index's longest_match; any medium counts)."""
    own = matched_blocks.get(chosen, 0.0)
    others = {e: m for e, m in matched_blocks.items() if e != chosen and m > 0}
    if not others:
        return None
    best = max(others.values())
    if (best - own) * config.block_size < config.min_cached_token_delta:
        return None
    near = sorted(e for e, m in others.items() if m >= best - 1)  # within one block of the best
    weights = [1.0 / (1 + max(0, (queue or {}).get(e, 0))) for e in near]
    return (rng or random).choices(near, weights=weights)[0]


def source_headers(source_url: str | None) -> dict[str, str]:
    """The header naming the source, host:port as llm-d sends it; empty without a source."""
    if not source_url:
        return {}
    parts = urlsplit(source_url if "//" in source_url else f"//{source_url}")
    if not parts.hostname or parts.port is None:
        return {}
    return {PEER_HEADER: f"{parts.hostname}:{parts.port}"}
