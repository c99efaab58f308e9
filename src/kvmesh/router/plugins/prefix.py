"""Prefix scorers: what each endpoint holds of the prompt, read from the scheduling state
(looked up once per request over every candidate, never by a scorer). Each returns a score in
[0, 1] per endpoint, in the order given."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.router.plugins.base import Plugin, PrefixReader, SchedulingRequest

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint


def match_scores(
    hits: Mapping[str, float], names: list[str], total: int, threshold: float
) -> list[float]:
    """The held fraction of the prompt of each endpoint (named, in order); all 0 when even the
    best of them is below `threshold` (a match that short, e.g. a system prompt every session
    shares, is not worth following: placing the request by load spreads new contexts)."""
    if not hits or not total:  # nothing held anywhere (a short or cold prompt): all 0
        return [0.0] * len(names)
    held = hits.get
    if threshold <= 0:
        return [held(name, 0) / total for name in names]
    blocks = [held(name, 0) for name in names]
    if max(blocks, default=0) < threshold * total:
        return [0.0] * len(names)
    return [h / total for h in blocks]


@dataclass(slots=True)
class PrecisePrefixScorer(Plugin):
    """Consecutive leading blocks each endpoint holds (from KV events), weighted by medium."""

    reads_tokens = True
    reads_precise_index = True
    name: str
    threshold: float = 0.0  # matchThreshold: a best match below this fraction scores 0

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        state = req.state
        names = state.names(endpoints)
        return match_scores(state.precise, names, state.total_blocks, self.threshold)


@dataclass(slots=True)
class ApproxPrefixScorer(Plugin):
    """Consecutive leading blocks each endpoint was sent before (the router's own decisions)."""

    reads_tokens = True
    reads_approximate_index = True
    name: str
    threshold: float = 0.0  # matchThreshold, as the precise scorer's

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        state = req.state
        names = state.names(endpoints)
        return match_scores(state.approximate, names, state.total_blocks, self.threshold)


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

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        if not self.cold(req):
            return [0.5] * len(endpoints)
        # least recently chosen first (never chosen: before all); a stable sort keeps the
        # order given among equals
        last_cold, stamps = self.last_cold, []
        for name in req.state.names(endpoints):
            stamps.append(last_cold.get(name, -1))
        n = max(1, len(endpoints) - 1)
        if n < 4:  # a few endpoints: each one's rank counted, cheaper than a sort
            out = []
            for i, s in enumerate(stamps):
                rank = 0
                for j, t in enumerate(stamps):
                    if t < s or (t == s and j < i):
                        rank += 1
                out.append(1.0 - rank / n)
            return out
        out = [0.0] * len(endpoints)
        for rank, i in enumerate(sorted(range(len(stamps)), key=stamps.__getitem__)):
            out[i] = 1.0 - rank / n
        return out

    def chosen(self, req: SchedulingRequest, endpoint: Endpoint) -> None:
        if self.cold(req):
            self.cold_picks += 1
            self.last_cold[endpoint.name] = self.cold_picks
