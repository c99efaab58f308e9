"""Load and affinity scorers: each maps every candidate endpoint to a score in [0, 1] (a list,
in the order of the endpoints given). Plain loops, no builtin call per endpoint: run for every
request over every candidate, they are the router's hot path (a conditional stands for each
min/max, with its tie and NaN rules). On Python 3.11 a comprehension is a function call of its
own, which costs more than its items over the few endpoints of most fleets, and a loop costs
no more than one over hundreds."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.router.plugins.base import Plugin, SchedulingRequest

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint

MAX_SESSIONS = 100_000  # session bindings kept, least recently bound dropped first


def spread(values: list[float]) -> list[float]:
    """(max - v) / (max - min) of each of `values` (lower is better); 1.0 for all when equal,
    as every request finds an idle fleet."""
    lo = hi = values[0]
    for v in values:  # (over a few endpoints a loop costs less than min and max)
        if v < lo:
            lo = v
        elif v > hi:
            hi = v
    if hi == lo:
        return [1.0] * len(values)
    span = hi - lo
    out = []
    for v in values:
        out.append((hi - v) / span)
    return out


def requests_in_flight(endpoints: list[Endpoint]) -> list[float]:
    """Each endpoint's requests in flight through this router, with the engine's running +
    waiting as a floor (other routers' requests, or counts this router lost)."""
    out = []
    for e in endpoints:
        f, engine = e.in_flight, e.running + e.waiting
        out.append(f if f > engine else engine)
    return out


@dataclass(slots=True)
class QueueScorer(Plugin):
    name: str

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        waiting = []
        for e in endpoints:
            waiting.append(e.waiting)
        return spread(waiting)


@dataclass(slots=True)
class KVCacheUtilizationScorer(Plugin):
    name: str

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        out = []
        for e in endpoints:
            free = 1.0 - e.kv_usage
            out.append(free if free > 0.0 else 0.0)
        return out


@dataclass(slots=True)
class ActiveRequestScorer(Plugin):
    """Fewest requests in flight through this router (engine-side running + waiting as floor)."""

    name: str

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        return spread(requests_in_flight(endpoints))


@dataclass(slots=True)
class TokenLoadScorer(Plugin):
    """Fewest prompt tokens in flight (counted from the prompts' token ids when forwarded)."""

    reads_tokens = True
    name: str
    threshold: int

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        t, out = self.threshold, []  # 1 - min(1, tokens / t)
        for e in endpoints:
            f = e.in_flight_tokens / t
            out.append(1.0 - f if f < 1.0 else 0.0)
        return out


@dataclass(slots=True)
class LoadAwareScorer(Plugin):
    name: str
    threshold: int

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        t = self.threshold  # 0.5 * max(0, 1 - waiting / t)
        return [0.5 * (f if (f := 1.0 - e.waiting / t) > 0.0 else 0.0) for e in endpoints]


@dataclass(slots=True)
class SessionAffinityScorer(Plugin):
    """Requests of one session (x-session-id header) stick to the endpoint that served it."""

    name: str
    header: str
    ttl: float
    bindings: OrderedDict = field(default_factory=OrderedDict)

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        session = req.headers.get(self.header)
        bound = self.bindings.get(session) if session else None
        if bound is None or bound[1] < time.monotonic():
            return [0.0] * len(endpoints)
        name = bound[0]
        return [1.0 if e.name == name else 0.0 for e in endpoints]

    def chosen(self, req: SchedulingRequest, endpoint: Endpoint) -> None:
        session = req.headers.get(self.header)
        if session:
            self.bindings[session] = (endpoint.name, time.monotonic() + self.ttl)
            self.bindings.move_to_end(session)
            while len(self.bindings) > MAX_SESSIONS:
                self.bindings.popitem(last=False)
