"""Prefill backlog: the prompt tokens an endpoint still has to compute before it can answer.

The router knows, for every request it forwarded and that has not yet sent a first byte of its
answer, how many prompt tokens that endpoint lacked when it was chosen (the prompt less its
longest cached prefix there, from the precise or approximate index). Their sum is the
endpoint's pending prefill; a new request's time to first token there grows with that backlog
plus its own uncached tokens. The scorer ranks endpoints by that sum, so a request follows its
cached prefix unless the holder's queue of prefill work costs more than recomputing elsewhere,
and cold prompts go where the least prefill is waiting.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.router.endpoints import Endpoint
from kvmesh.router.plugins import SchedulingRequest, register


def uncached_tokens(req: SchedulingRequest, endpoint: str) -> int:
    """Prompt tokens `endpoint` would compute: the prompt less its longest known cached prefix
    (precise index, tier-weighted, or the router's own past decisions, whichever is longer)."""
    blocks = max((req.precise or {}).get(endpoint, 0.0), (req.approximate or {}).get(endpoint, 0))
    return max(0, len(req.token_ids) - int(blocks * req.block_size))


def fill_matches(req: SchedulingRequest, endpoints: list[Endpoint], precise, approximate) -> None:
    """Look up the prefix matches the scorers share, if no scorer has yet."""
    names = [e.name for e in endpoints]
    if req.precise is None:
        req.precise = precise.longest_match(req.block_keys, names) if req.block_keys else {}
    if req.approximate is None:
        req.approximate = approximate.longest_match(req.block_keys, names) if req.block_keys else {}


@dataclass(slots=True)
class PrefillBacklogScorer:
    """1 for the endpoint with the least prefill ahead of this request's first token (its
    pending prefill plus this request's uncached tokens there), falling linearly to 0 at
    `scale_tokens` more; a tie scores 1 everywhere."""

    name: str
    precise_index: object
    approximate_index: object
    scale_tokens: int = 4096  # a backlog this much larger than the best scores 0

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        fill_matches(req, endpoints, self.precise_index, self.approximate_index)
        cost = {e.name: e.pending_prefill_tokens + uncached_tokens(req, e.name) for e in endpoints}
        best = min(cost.values(), default=0)
        return {k: max(0.0, 1.0 - (c - best) / self.scale_tokens) for k, c in cost.items()}


def _build(name: str, params: dict, ctx) -> PrefillBacklogScorer:
    scale = int(params.get("scaleTokens", 4096))
    if scale <= 0:
        raise ValueError(f"{name}: scaleTokens must be positive, got {scale}")
    return PrefillBacklogScorer(name, ctx.precise_index, ctx.approximate_index, scale)


register("prefill-backlog-scorer")(_build)


@dataclass(slots=True)
class PlacementCostScorer:
    """What placing this request on an endpoint costs the fleet, in tokens of prefill: the
    endpoint's pending prefill (which this request waits behind) plus this request's uncached
    tokens there, which it waits for and which stall every request in flight there for as long
    (a chunked-prefill step carries the decode batch, so each decoder waits out the chunk).
    `decode_weight` prices one decoder's stall against the request's own wait. A request the
    engine reports waiting (its batch or KV limits bind) delays this one by at least a slot's
    turn, priced as computing this whole prompt again (`waiting_weight` prompts each).

    Scored (best + n) / (cost + n) for an n-token prompt: 1 for the cheapest endpoint, and a
    difference counts in proportion to the prompt's own size, so a few blocks more or less
    decide nothing while a long context recomputed beside a busy batch decides much."""

    name: str
    precise_index: object
    approximate_index: object
    decode_weight: float = 1.0
    waiting_weight: float = 1.0

    def cost(self, req: SchedulingRequest, e: Endpoint) -> float:
        batch = max(e.in_flight, e.running + e.waiting)
        stall = uncached_tokens(req, e.name) * (1.0 + self.decode_weight * batch)
        return (
            e.pending_prefill_tokens + stall + self.waiting_weight * e.waiting * len(req.token_ids)
        )

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        fill_matches(req, endpoints, self.precise_index, self.approximate_index)
        cost = {e.name: self.cost(req, e) for e in endpoints}
        n = max(1, len(req.token_ids))
        best = min(cost.values(), default=0.0)
        return {k: (best + n) / (c + n) for k, c in cost.items()}


def _build_placement(name: str, params: dict, ctx) -> PlacementCostScorer:
    weights = {k: float(params.get(k, 1.0)) for k in ("decodeWeight", "waitingWeight")}
    for key, value in weights.items():
        if value < 0:
            raise ValueError(f"{name}: {key} must be >= 0, got {value}")
    return PlacementCostScorer(
        name,
        ctx.precise_index,
        ctx.approximate_index,
        weights["decodeWeight"],
        weights["waitingWeight"],
    )


register("placement-cost-scorer")(_build_placement)
