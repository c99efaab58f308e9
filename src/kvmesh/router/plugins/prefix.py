"""Prefix scorers: what each endpoint holds of the prompt, read from the scheduling state
(looked up once per request over every candidate, never by a scorer)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.router.plugins.base import Plugin, PrefixReader, SchedulingRequest

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint


def match_scores(
    hits: Mapping[str, float], endpoints: list[Endpoint], total: int, threshold: float
) -> dict[str, float]:
    """Each endpoint's held fraction of the prompt; all 0 when even the best of `endpoints` is
    below `threshold` (a match that short, e.g. a system prompt every session shares, is not
    worth following: placing the request by load spreads new contexts instead)."""
    if not hits or not total:  # nothing held anywhere (a short or cold prompt): all 0
        return dict.fromkeys([e.name for e in endpoints], 0.0)
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
    recent: OrderedDict = field(default_factory=OrderedDict)

    def cold(self, req: SchedulingRequest) -> bool:
        if self.threshold > 0:
            return req.state.best_fraction() <= self.threshold
        return req.state.best_blocks() <= 0

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        if not self.cold(req):
            return dict.fromkeys([e.name for e in endpoints], 0.5)
        recent = self.recent  # oldest first
        names = [e.name for e in endpoints]
        ranked = [name for name in names if name not in recent]  # never chosen: first
        if len(ranked) < len(names):
            candidates = set(names)
            ranked += [name for name in recent if name in candidates]
        n = max(1, len(ranked) - 1)
        return {name: 1.0 - i / n for i, name in enumerate(ranked)}

    def chosen(self, req: SchedulingRequest, endpoint: Endpoint) -> None:
        if self.cold(req):
            self.recent[endpoint.name] = None
            self.recent.move_to_end(endpoint.name)
