"""Load and affinity scorers: each maps every candidate endpoint to a score in [0, 1], defined by
its term (plugins.terms: the source its profile's one function runs per endpoint)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.router.plugins.base import SchedulingRequest
from kvmesh.router.plugins.terms import Term, TermScorer, spread_term

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint

MAX_SESSIONS = 100_000  # session bindings kept, least recently bound dropped first

# an endpoint's requests in flight through this router, with the engine's running + waiting
# as a floor (other routers' requests, or counts this router lost)
IN_FLIGHT = "_f = e.in_flight\n_g = e.running + e.waiting\n_x = _f if _f > _g else _g"


@dataclass(slots=True)
class QueueScorer(TermScorer):
    """Fewest requests waiting on the engine."""

    term = spread_term("e.waiting")
    name: str


@dataclass(slots=True)
class KVCacheUtilizationScorer(TermScorer):
    """Most KV cache free: 1 - usage."""

    term = Term("_x if (_x := 1.0 - e.kv_usage) > 0.0 else 0.0")
    name: str


@dataclass(slots=True)
class ActiveRequestScorer(TermScorer):
    """Fewest requests in flight through this router (engine-side running + waiting as floor)."""

    term = spread_term(IN_FLIGHT)
    name: str


@dataclass(slots=True)
class TokenLoadScorer(TermScorer):
    """Fewest prompt tokens in flight (counted from the prompts' token ids when forwarded):
    1 - min(1, tokens / threshold)."""

    reads_tokens = True
    term = Term("1.0 - _x if (_x := e.in_flight_tokens / _t) < 1.0 else 0.0", "_t = me.threshold")
    name: str
    threshold: int


@dataclass(slots=True)
class LoadAwareScorer(TermScorer):
    """llm-d's load-aware scorer: 0.5 * max(0, 1 - waiting / threshold)."""

    term = Term("0.5 * (_x if (_x := 1.0 - e.waiting / _t) > 0.0 else 0.0)", "_t = me.threshold")
    name: str
    threshold: int


@dataclass(slots=True)
class SessionAffinityScorer(TermScorer):
    """Requests of one session (x-session-id header) stick to the endpoint that served it:
    1 there while the binding lives, 0 elsewhere."""

    term = Term(
        score="1.0 if name == _to else 0.0",
        setup="_to = me.bound_to(req)",
        uniform="0.0 if _to is None else None",
    )
    name: str
    header: str
    ttl: float
    bindings: OrderedDict = field(default_factory=OrderedDict)

    def bound_to(self, req: SchedulingRequest) -> str | None:
        """The endpoint the request's session is bound to (None: none, or it expired)."""
        session = req.headers.get(self.header)
        bound = self.bindings.get(session) if session else None
        if bound is None or bound[1] < time.monotonic():
            return None
        return bound[0]

    def chosen(self, req: SchedulingRequest, endpoint: Endpoint) -> None:
        session = req.headers.get(self.header)
        if session:
            self.bindings[session] = (endpoint.name, time.monotonic() + self.ttl)
            self.bindings.move_to_end(session)
            while len(self.bindings) > MAX_SESSIONS:
                self.bindings.popitem(last=False)
