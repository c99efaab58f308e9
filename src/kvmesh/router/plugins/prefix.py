"""Prefix scorers: what each endpoint holds of the prompt, read from the scheduling state
(looked up once per request over every candidate, never by a scorer). Each returns a score in
[0, 1] per endpoint, in the order given."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.router.plugins.base import PrefixReader, SchedulingRequest
from kvmesh.router.plugins.terms import Term, TermScorer

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint


def reaches(held: Mapping[str, float], endpoints: list[Endpoint], threshold: float) -> bool:
    """Whether a match is worth following: the best of the endpoints' held blocks reaches
    ``threshold`` blocks (a match that short, e.g. a system prompt every session shares, is
    not: placing the request by load spreads new contexts)."""
    best = 0
    for e in endpoints:
        h = held.get(e.name, 0)
        if h > best:
            best = h
    return not best < threshold


def match_term(match: str) -> Term:
    """The held fraction of the prompt of each endpoint, from the state's ``match``: all 0
    when nothing is held anywhere (a short or cold prompt) or when even the best holds less
    than the scorer's ``threshold`` of it."""
    return Term(
        setup=f"""_m = state.{match}
_tot = state.total_blocks
_on = bool(_m) and bool(_tot)
if _on and me.threshold > 0:
    _on = reaches(_m, endpoints, me.threshold * _tot)
_g = _m.get""",
        uniform="None if _on else 0.0",
        score="_g(name, 0) / _tot",
        helpers=(reaches,),
    )


@dataclass(slots=True)
class PrecisePrefixScorer(TermScorer):
    """Consecutive leading blocks each endpoint holds (from KV events), weighted by medium."""

    reads_tokens = True
    reads_precise_index = True
    term = match_term("precise")
    name: str
    threshold: float = 0.0  # matchThreshold: a best match below this fraction scores 0


@dataclass(slots=True)
class ApproxPrefixScorer(TermScorer):
    """Consecutive leading blocks each endpoint was sent before (the router's own decisions)."""

    reads_tokens = True
    reads_approximate_index = True
    term = match_term("approximate")
    name: str
    threshold: float = 0.0  # matchThreshold, as the precise scorer's


@dataclass(slots=True)
class NoHitLRUScorer(PrefixReader, TermScorer):
    """Cold requests (no endpoint holds more than `threshold` of the prompt; by default none of
    it) go to the least recently used endpoint for cold requests, spreading new contexts; warm
    requests get a neutral 0.5."""

    term = Term(
        score="_r[i]",
        setup="_r = me.cold_scores(state.names(endpoints)) if me.cold(req) else None",
        uniform="0.5 if _r is None else None",
    )
    name: str
    threshold: float = 0.0  # matchThreshold: a best match at or below this fraction is cold
    # endpoint -> the count of cold picks when it was last chosen for one (absent: never)
    last_cold: dict[str, int] = field(default_factory=dict)
    cold_picks: int = 0

    def cold(self, req: SchedulingRequest) -> bool:
        if self.threshold > 0:
            return req.state.best_fraction() <= self.threshold
        return req.state.best_blocks() <= 0

    def cold_scores(self, names: list[str]) -> list[float]:
        """Least recently chosen for a cold request first (never chosen: before all): 1 down
        to 0 by rank; a stable order keeps the order given among equals."""
        last_cold = self.last_cold
        if len(names) == 2:  # the common pair: the older first (the first of equals)
            a, b = last_cold.get(names[0], -1), last_cold.get(names[1], -1)
            return [0.0, 1.0] if b < a else [1.0, 0.0]
        stamps = []
        for name in names:
            stamps.append(last_cold.get(name, -1))
        n = max(1, len(names) - 1)
        if n < 4:  # a few endpoints: each one's rank counted, cheaper than a sort
            out = []
            for i, s in enumerate(stamps):
                rank = 0
                for j, t in enumerate(stamps):
                    if t < s or (t == s and j < i):
                        rank += 1
                out.append(1.0 - rank / n)
            return out
        out = [0.0] * len(names)
        for rank, i in enumerate(sorted(range(len(stamps)), key=stamps.__getitem__)):
            out[i] = 1.0 - rank / n
        return out

    def chosen(self, req: SchedulingRequest, endpoint: Endpoint) -> None:
        if self.cold(req):
            self.cold_picks += 1
            self.last_cold[endpoint.name] = self.cold_picks
