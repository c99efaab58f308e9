"""Peer source selection: name an engine to pull prefix blocks from, as llm-d's P2P flow does.

After the picker has chosen where a request runs, the endpoint holding the longest prefix of it
is named as the source (header `x-kv-cache-source-host-port: host:port`) when its lead over the
chosen endpoint is at least `min_cached_token_delta` tokens. Among endpoints within one block of
the best, one is drawn with weight 1 / (1 + queue), so one hot source is not asked by everyone.
The chosen engine pulls the blocks it lacks and verifies them; a wrong name costs a miss only.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvmesh.protocol.hashing import DEFAULT_BLOCK_SIZE
from kvmesh.router.plugins.state import NO_MATCH, SchedulingState

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint
    from kvmesh.router.index import PreciseIndex
    from kvmesh.router.plugins import SchedulingRequest

PEER_HEADER = "x-kv-cache-source-host-port"


@dataclass(slots=True)
class PeerSourceConfig:
    min_cached_token_delta: int = 2048  # llm-d's minCachedTokenDelta as its P2P guide sets it
    block_size: int = DEFAULT_BLOCK_SIZE

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


@dataclass(slots=True, frozen=True)
class PeerSource:
    """The endpoint a request's KV prefix is pulled from: its host:port as the header names it,
    and the leading prompt tokens it was predicted to hold beyond the chosen endpoint."""

    endpoint: Endpoint
    address: str
    lead_tokens: int


def select_source(
    index: PreciseIndex,
    candidates: Iterable[Endpoint],
    chosen: Endpoint,
    req: SchedulingRequest,
    config: PeerSourceConfig,
    exclude: Collection[str] = (),
) -> PeerSource | None:
    """The healthy endpoint `chosen` should pull the request's prefix from, or None. Reads the
    precise match of the request's scheduling state (looked up there, over `chosen` and the
    candidates, when the pipeline did not); any medium counts, weighed as the precise scorer
    weighs it, so a lead held in lower tiers is understated, never overstated. Endpoints in
    `exclude` (those that failed this request) and other data-parallel ranks of the chosen
    server are not named."""
    if not req.block_keys:
        return None
    others = {e.name: e for e in candidates if e.name not in exclude and e.url != chosen.url}
    if not others:
        return None
    state = req.state
    if state is None:
        state = req.state = SchedulingState.of(req)
    if state.precise is NO_MATCH:
        state.look_up(req.block_keys, [chosen.name, *others], precise_index=index)
    held = state.precise  # over every candidate of the pass: narrowed to chosen and others
    matched = {n: held[n] for n in (chosen.name, *others) if n in held}
    queue = {name: e.in_flight + int(e.waiting) for name, e in others.items()}
    name = choose_peer_source(chosen.name, matched, config, queue)
    address = source_headers(others[name].url).get(PEER_HEADER) if name else None
    if name is None or address is None:  # no source, or its URL has no explicit port
        return None
    lead = (matched[name] - matched.get(chosen.name, 0.0)) * req.block_size
    return PeerSource(others[name], address, int(lead))
