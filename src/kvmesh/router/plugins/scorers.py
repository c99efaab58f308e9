"""Load and affinity scorers: each maps every candidate endpoint to a score in [0, 1]."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.router.plugins.base import Plugin, SchedulingRequest

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint

MAX_SESSIONS = 100_000  # session bindings kept, least recently bound dropped first


def zeros(endpoints: list[Endpoint]) -> dict[str, float]:
    """0.0 for every endpoint."""
    out = {}
    for e in endpoints:
        out[e.name] = 0.0
    return out


def spread(endpoints: list[Endpoint], values: list[float]) -> dict[str, float]:
    """(max - v) / (max - min) of `values` (one per endpoint, in order: lower is better); 1.0
    for all when equal, as every request finds an idle fleet. Plain loops: per request, on the
    router's hot path, they cost a third of min/max/zip and comprehensions."""
    lo = hi = values[0]
    for v in values:
        if v < lo:
            lo = v
        elif v > hi:
            hi = v
    out = {}
    if hi == lo:
        for e in endpoints:
            out[e.name] = 1.0
        return out
    span = hi - lo
    for i, e in enumerate(endpoints):
        out[e.name] = (hi - values[i]) / span
    return out


@dataclass(slots=True)
class QueueScorer(Plugin):
    name: str

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        return spread(endpoints, [e.waiting for e in endpoints])


@dataclass(slots=True)
class KVCacheUtilizationScorer(Plugin):
    name: str

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        out = {}
        for e in endpoints:
            free = 1.0 - e.kv_usage
            out[e.name] = free if free > 0.0 else 0.0
        return out


@dataclass(slots=True)
class ActiveRequestScorer(Plugin):
    """Fewest requests in flight through this router (engine-side running + waiting as floor)."""

    name: str

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        values = []
        for e in endpoints:
            engine_side = e.running + e.waiting
            values.append(e.in_flight if e.in_flight > engine_side else engine_side)
        return spread(endpoints, values)


@dataclass(slots=True)
class TokenLoadScorer(Plugin):
    """Fewest prompt tokens in flight (counted from the prompts' token ids when forwarded)."""

    reads_tokens = True
    name: str
    threshold: int

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        return {e.name: 1.0 - min(1.0, e.in_flight_tokens / self.threshold) for e in endpoints}


@dataclass(slots=True)
class LoadAwareScorer(Plugin):
    name: str
    threshold: int

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        return {e.name: 0.5 * max(0.0, 1.0 - e.waiting / self.threshold) for e in endpoints}


@dataclass(slots=True)
class SessionAffinityScorer(Plugin):
    """Requests of one session (x-session-id header) stick to the endpoint that served it."""

    name: str
    header: str
    ttl: float
    bindings: OrderedDict = field(default_factory=OrderedDict)

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        session = req.headers.get(self.header)
        bound = self.bindings.get(session) if session else None
        if bound is None or bound[1] < time.monotonic():
            return zeros(endpoints)
        return {e.name: 1.0 if e.name == bound[0] else 0.0 for e in endpoints}

    def chosen(self, req: SchedulingRequest, endpoint: Endpoint) -> None:
        session = req.headers.get(self.header)
        if session:
            self.bindings[session] = (endpoint.name, time.monotonic() + self.ttl)
            self.bindings.move_to_end(session)
            while len(self.bindings) > MAX_SESSIONS:
                self.bindings.popitem(last=False)
