"""Scheduling plugins, llm-d style: each a type name, parameters and a factory, registered by name.

A filter narrows the candidate endpoints; a scorer maps each candidate to [0, 1] and does nothing
else; a picker chooses among weighted-score totals. Prefix-match data is computed once per
request by the SchedulingRequest (the producers' role) and shared by the scorers.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmesh.router.endpoints import Endpoint
from kvmesh.router.plugin_params import ReadParameters

ROLE_LABEL = "llm-d.ai/role"


@dataclass(slots=True)
class SchedulingRequest:
    request_id: str
    model: str | None
    token_ids: list[int]
    block_keys: list[int]  # the engines' block hashes (event ints) of the full blocks
    headers: dict[str, str]
    block_size: int = 16
    # filled lazily by the indexes; shared by every scorer of every profile
    precise: dict[str, float] | None = None
    approximate: dict[str, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Filter(Protocol):
    name: str

    def filter(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]: ...


class Scorer(Protocol):
    name: str

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]: ...


class Picker(Protocol):
    name: str

    def pick(self, totals: dict[str, float], endpoints: list[Endpoint]) -> Endpoint: ...


class PluginContext(Protocol):
    """What plugins may read: the indexes (see router.app.RouterState)."""

    precise_index: Any
    approximate_index: Any


Factory = Callable[[str, dict, PluginContext], Any]
REGISTRY: dict[str, Factory] = {}


def register(type_name: str) -> Callable[[Factory], Factory]:
    def deco(factory: Factory) -> Factory:
        REGISTRY[type_name] = factory
        return factory

    return deco


def build_plugin(type_name: str, name: str, params: dict, ctx: PluginContext):
    factory = REGISTRY.get(type_name)
    if factory is None:
        raise ValueError(f"unknown plugin type {type_name!r}; known: {sorted(REGISTRY)}")
    read = ReadParameters(params)
    plugin = factory(name, read, ctx)
    read.refuse_unread(f"plugin {name!r} ({type_name})")
    return plugin


def _spread(values: dict[str, float], higher_is_better: bool = False) -> dict[str, float]:
    """(max - v) / (max - min) over the candidates (or its mirror); 1.0 for all when equal."""
    lo, hi = min(values.values()), max(values.values())
    if hi == lo:
        return dict.fromkeys(values, 1.0)
    if higher_is_better:
        return {k: (v - lo) / (hi - lo) for k, v in values.items()}
    return {k: (hi - v) / (hi - lo) for k, v in values.items()}


# ---- filters -----------------------------------------------------------------------------


@dataclass(slots=True)
class RoleFilter:
    name: str
    roles: tuple[str, ...]  # endpoints without the label count as "both"

    def filter(self, req, endpoints):
        return [
            e
            for e in endpoints
            if e.labels.get(ROLE_LABEL, "both") in self.roles
            or e.labels.get(ROLE_LABEL, "both") == "both"
        ]


@dataclass(slots=True)
class LabelSelectorFilter:
    name: str
    match_labels: dict[str, str]

    def filter(self, req, endpoints):
        return [
            e for e in endpoints if all(e.labels.get(k) == v for k, v in self.match_labels.items())
        ]


@dataclass(slots=True)
class ModelFilter:
    name: str

    def filter(self, req, endpoints):
        if req.model is None:
            return endpoints
        return [e for e in endpoints if not e.models or req.model in e.models]


register("decode-filter")(lambda n, p, c: RoleFilter(n, ("decode",)))
register("prefill-filter")(lambda n, p, c: RoleFilter(n, ("prefill",)))
register("label-selector-filter")(
    lambda n, p, c: LabelSelectorFilter(n, dict(p.get("matchLabels", {})))
)
register("model-filter")(lambda n, p, c: ModelFilter(n))


# ---- scorers -----------------------------------------------------------------------------


def best_match_fraction(req) -> float:
    """The largest fraction of the prompt's blocks any endpoint is known to hold."""
    total = len(req.block_keys)
    best = max((max(h.values(), default=0) for h in (req.precise, req.approximate) if h), default=0)
    return best / total if total else 0.0


def _match_scores(hits: dict, endpoints, total: int, threshold: float) -> dict[str, float]:
    """Each endpoint's held fraction of the prompt; all 0 when even the best is below
    `threshold` (a match that short, e.g. a system prompt every session shares, is not worth
    following: placing the request by load spreads new contexts instead)."""
    if not total or (threshold > 0 and max(hits.values(), default=0) < threshold * total):
        return dict.fromkeys((e.name for e in endpoints), 0.0)
    return {e.name: hits.get(e.name, 0) / total for e in endpoints}


@dataclass(slots=True)
class PrecisePrefixScorer:
    """Consecutive leading blocks each endpoint holds (from KV events), weighted by medium."""

    name: str
    index: Any
    threshold: float = 0.0  # matchThreshold: a best match below this fraction scores 0

    def score(self, req, endpoints):
        total = len(req.block_keys)
        if req.precise is None:
            req.precise = (
                self.index.longest_match(req.block_keys, [e.name for e in endpoints])
                if total
                else {}
            )
        return _match_scores(req.precise, endpoints, total, self.threshold)


@dataclass(slots=True)
class ApproxPrefixScorer:
    """Consecutive leading blocks each endpoint was sent before (the router's own decisions)."""

    name: str
    index: Any
    threshold: float = 0.0  # matchThreshold, as the precise scorer's

    def score(self, req, endpoints):
        total = len(req.block_keys)
        if req.approximate is None:
            req.approximate = (
                self.index.longest_match(req.block_keys, [e.name for e in endpoints])
                if total
                else {}
            )
        return _match_scores(req.approximate, endpoints, total, self.threshold)


@dataclass(slots=True)
class QueueScorer:
    name: str

    def score(self, req, endpoints):
        return _spread({e.name: float(e.waiting) for e in endpoints})


@dataclass(slots=True)
class KVCacheUtilizationScorer:
    name: str

    def score(self, req, endpoints):
        return {e.name: max(0.0, 1.0 - e.kv_usage) for e in endpoints}


@dataclass(slots=True)
class ActiveRequestScorer:
    """Fewest requests in flight through this router (engine-side running + waiting as floor)."""

    name: str

    def score(self, req, endpoints):
        return _spread({e.name: float(max(e.in_flight, e.running + e.waiting)) for e in endpoints})


@dataclass(slots=True)
class TokenLoadScorer:
    name: str
    threshold: int = 32768

    def score(self, req, endpoints):
        return {e.name: 1.0 - min(1.0, e.in_flight_tokens / self.threshold) for e in endpoints}


@dataclass(slots=True)
class LoadAwareScorer:
    name: str
    threshold: int = 128

    def score(self, req, endpoints):
        return {e.name: 0.5 * max(0.0, 1.0 - e.waiting / self.threshold) for e in endpoints}


@dataclass(slots=True)
class SessionAffinityScorer:
    """Requests of one session (x-session-id header) stick to the endpoint that served it."""

    name: str
    header: str = "x-session-id"
    ttl: float = 300.0
    bindings: OrderedDict = field(default_factory=OrderedDict)

    def score(self, req, endpoints):
        session = req.headers.get(self.header)
        bound = self.bindings.get(session) if session else None
        if bound is None or bound[1] < time.monotonic():
            return dict.fromkeys((e.name for e in endpoints), 0.0)
        return {e.name: 1.0 if e.name == bound[0] else 0.0 for e in endpoints}

    def chosen(self, req, endpoint: Endpoint) -> None:
        session = req.headers.get(self.header)
        if session:
            self.bindings[session] = (endpoint.name, time.monotonic() + self.ttl)
            self.bindings.move_to_end(session)
            while len(self.bindings) > 100_000:
                self.bindings.popitem(last=False)


@dataclass(slots=True)
class NoHitLRUScorer:
    """Cold requests (no endpoint holds more than `threshold` of the prompt; by default none of
    it) go to the least recently used endpoint for cold requests, spreading new contexts; warm
    requests get a neutral 0.5."""

    name: str
    recent: OrderedDict = field(default_factory=OrderedDict)
    threshold: float = 0.0  # matchThreshold: a best match at or below this fraction is cold

    def _cold(self, req) -> bool:
        if self.threshold > 0:
            return best_match_fraction(req) <= self.threshold
        return not any(h and max(h.values()) > 0 for h in (req.precise, req.approximate))

    def score(self, req, endpoints):
        if not self._cold(req):
            return dict.fromkeys((e.name for e in endpoints), 0.5)
        order = {name: i for i, name in enumerate(self.recent)}  # oldest first
        never = [e.name for e in endpoints if e.name not in order]
        ranked = never + sorted((e.name for e in endpoints if e.name in order), key=order.get)
        n = max(1, len(ranked) - 1)
        return {name: 1.0 - i / n for i, name in enumerate(ranked)}

    def chosen(self, req, endpoint: Endpoint) -> None:
        if self._cold(req):
            self.recent[endpoint.name] = None
            self.recent.move_to_end(endpoint.name)


register("precise-prefix-cache-scorer")(
    lambda n, p, c: PrecisePrefixScorer(n, c.precise_index, float(p.get("matchThreshold", 0)))
)
register("prefix-cache-scorer")(
    lambda n, p, c: ApproxPrefixScorer(n, c.approximate_index, float(p.get("matchThreshold", 0)))
)
register("queue-scorer")(lambda n, p, c: QueueScorer(n))
register("kv-cache-utilization-scorer")(lambda n, p, c: KVCacheUtilizationScorer(n))
register("active-request-scorer")(lambda n, p, c: ActiveRequestScorer(n))
register("token-load-scorer")(
    lambda n, p, c: TokenLoadScorer(n, int(p.get("queueThresholdTokens", 32768)))
)
register("load-aware-scorer")(lambda n, p, c: LoadAwareScorer(n, int(p.get("threshold", 128))))
register("session-affinity-scorer")(
    lambda n, p, c: SessionAffinityScorer(
        n, p.get("header", "x-session-id").lower(), float(p.get("ttlSeconds", 300))
    )
)
register("no-hit-lru-scorer")(
    lambda n, p, c: NoHitLRUScorer(n, threshold=float(p.get("matchThreshold", 0)))
)


# ---- pickers -----------------------------------------------------------------------------


@dataclass(slots=True)
class MaxScorePicker:
    name: str
    rng: random.Random = field(default_factory=random.Random)

    def pick(self, totals, endpoints):
        best = max(totals.values())
        top = [e for e in endpoints if totals[e.name] >= best - 1e-9]
        return top[0] if len(top) == 1 else self.rng.choice(top)


@dataclass(slots=True)
class WeightedRandomPicker:
    name: str
    rng: random.Random = field(default_factory=random.Random)

    def pick(self, totals, endpoints):
        weights = [max(totals[e.name], 0.0) for e in endpoints]
        if sum(weights) <= 0:
            return self.rng.choice(endpoints)
        return self.rng.choices(endpoints, weights=weights)[0]


@dataclass(slots=True)
class RandomPicker:
    name: str
    rng: random.Random = field(default_factory=random.Random)

    def pick(self, totals, endpoints):
        return self.rng.choice(endpoints)


@dataclass(slots=True)
class RoundRobinPicker:
    name: str
    counter: int = 0

    def pick(self, totals, endpoints):
        self.counter += 1
        return sorted(endpoints, key=lambda e: e.name)[self.counter % len(endpoints)]


def _rng(p: dict) -> random.Random:
    return random.Random(p.get("seed"))


register("max-score-picker")(lambda n, p, c: MaxScorePicker(n, _rng(p)))
register("weighted-random-picker")(lambda n, p, c: WeightedRandomPicker(n, _rng(p)))
register("random-picker")(lambda n, p, c: RandomPicker(n, _rng(p)))
register("round-robin-picker")(lambda n, p, c: RoundRobinPicker(n))


# plugins that read neither token ids nor block keys: a profile made of these alone (and a
# single-profile handler) lets the router skip tokenizing
TOKEN_FREE = (RoleFilter, LabelSelectorFilter, ModelFilter, QueueScorer, KVCacheUtilizationScorer,
              ActiveRequestScorer, LoadAwareScorer, SessionAffinityScorer, MaxScorePicker,
              WeightedRandomPicker, RandomPicker, RoundRobinPicker)  # fmt: skip


def needs_tokens(pipeline: Any) -> bool:
    """Whether scheduling with this pipeline reads the request's token ids or block keys."""
    if type(pipeline.handler).__name__ != "SingleProfileHandler":
        return True
    return not all(isinstance(p, TOKEN_FREE) for p in pipeline.plugins.values())


def reads_precise_index(pipeline: Any) -> bool:
    """Whether scheduling with this pipeline reads the KV-event index (else no subscriptions)."""
    if type(pipeline.handler).__name__ != "SingleProfileHandler":
        return True
    return any(isinstance(p, PrecisePrefixScorer) for p in pipeline.plugins.values())
