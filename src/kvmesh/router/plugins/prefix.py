"""Prefix scorers: what each endpoint holds of the prompt, read from the scheduling state
(looked up once per request over every candidate, never by a scorer)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.router.plugins.base import Plugin, PrefixReader, SchedulingRequest
from kvmesh.router.plugins.scorers import zeros

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint


def match_scores(
    hits: Mapping[str, float], endpoints: list[Endpoint], total: int, threshold: float
) -> dict[str, float]:
    """Each endpoint's held fraction of the prompt; all 0 when even the best of `endpoints` is
    below `threshold` (a match that short, e.g. a system prompt every session shares, is not
    worth following: placing the request by load spreads new contexts instead)."""
    if not hits or not total:  # nothing held anywhere (a short or cold prompt): all 0
        return zeros(endpoints)
    held = {e.name: hits.get(e.name, 0) for e in endpoints}
    if threshold > 0 and max(held.values(), default=0) < threshold * total:
        return dict.fromkeys(held, 0.0)
    return {name: h / total for name, h in held.items()}


@dataclass(slots=True)
class PrecisePrefixScorer(Plugin):
    """Consecutive leading blocks each endpoint holds (from KV events), weighted by medium."""

    reads_tokens = True
    reads_precise_index = True
    name: str
    threshold: float = 0.0  # matchThreshold: a best match below this fraction scores 0

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        state = req.state
        return match_scores(state.precise, endpoints, state.total_blocks, self.threshold)


@dataclass(slots=True)
class ApproxPrefixScorer(Plugin):
    """Consecutive leading blocks each endpoint was sent before (the router's own decisions)."""

    reads_tokens = True
    reads_approximate_index = True
    name: str
    threshold: float = 0.0  # matchThreshold, as the precise scorer's

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        state = req.state
        return match_scores(state.approximate, endpoints, state.total_blocks, self.threshold)


@dataclass(slots=True)
class NoHitLRUScorer(PrefixReader):
    """Cold requests (no endpoint holds more than `threshold` of the prompt; by default none of
    it) go to the least recently used endpoint for cold requests, spreading new contexts; warm
    requests get a neutral 0.5."""

    name: str
    threshold: float = 0.0  # matchThreshold: a best match at or below this fraction is cold
    # endpoint -> the count of cold picks when it was last chosen for one (absent: never)
    last_cold: dict[str, int] = field(default_factory=dict)
    cold_picks: int = 0

    def cold(self, req: SchedulingRequest) -> bool:
        if self.threshold > 0:
            return req.state.best_fraction() <= self.threshold
        return req.state.best_blocks() <= 0

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        out: dict[str, float] = {}
        if not self.cold(req):
            for e in endpoints:
                out[e.name] = 0.5
            return out
        last = self.last_cold.get
        # least recently chosen first (never chosen: before all, in the order given)
        stamps = []
        for e in endpoints:
            stamps.append((last(e.name, -1), len(stamps), e.name))
        stamps.sort()
        n = max(1, len(endpoints) - 1)
        for rank, (_, _, name) in enumerate(stamps):
            out[name] = 1.0 - rank / n
        return out

    def chosen(self, req: SchedulingRequest, endpoint: Endpoint) -> None:
        if self.cold(req):
            self.cold_picks += 1
            self.last_cold[endpoint.name] = self.cold_picks
