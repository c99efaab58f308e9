"""Placement scorers: what a request costs in prefill on each endpoint.

The router knows, for every request it forwarded and that has not yet sent a first byte of its
answer, how many prompt tokens that endpoint lacked when it was chosen (router.forward_load keeps
the count). Their sum is the endpoint's pending prefill; a new request's time to first token
there grows with that backlog plus its own uncached tokens (SchedulingState.uncached_tokens).
So a request follows its cached prefix unless the holder's queue of prefill work costs more
than recomputing elsewhere, and cold prompts go where the least prefill is waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.router.plugins.base import PrefixReader, SchedulingRequest

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint


@dataclass(slots=True)
class PrefillBacklogScorer(PrefixReader):
    """1 for the endpoint with the least prefill ahead of this request's first token (its
    pending prefill plus this request's uncached tokens there), falling linearly to 0 at
    `scale_tokens` more; a tie scores 1 everywhere."""

    name: str
    scale_tokens: int  # a backlog this much larger than the best scores 0

    def __post_init__(self) -> None:
        if self.scale_tokens <= 0:
            raise ValueError(f"{self.name}: scaleTokens must be positive, got {self.scale_tokens}")

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        uncached = req.state.uncached_tokens
        cost = {e.name: e.pending_prefill_tokens + uncached(e.name) for e in endpoints}
        best = min(cost.values(), default=0)
        return {k: max(0.0, 1.0 - (c - best) / self.scale_tokens) for k, c in cost.items()}


@dataclass(slots=True)
class PlacementCostScorer(PrefixReader):
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
    decode_weight: float = 1.0
    waiting_weight: float = 1.0

    def __post_init__(self) -> None:
        for key, value in (
            ("decodeWeight", self.decode_weight),
            ("waitingWeight", self.waiting_weight),
        ):
            if value < 0:
                raise ValueError(f"{self.name}: {key} must be >= 0, got {value}")

    def costs(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        """Each endpoint's placement cost, in tokens of prefill, in the order given (one pass,
        no call per endpoint: the router's hottest scorer)."""
        state, prompt = req.state, len(req.token_ids)
        held, whole, block = state.held(), max(0, state.prompt_tokens), state.block_size
        decode_weight, waiting_weight = self.decode_weight, self.waiting_weight
        cost: list[float] = []
        for e in endpoints:
            blocks = held.get(e.name) if held else None  # as state.uncached_tokens
            uncached = max(0, whole - int(blocks * block)) if blocks else whole
            waiting = e.waiting
            engine_side = e.running + waiting
            batch = e.in_flight if e.in_flight > engine_side else engine_side
            cost.append(
                e.pending_prefill_tokens
                + uncached * (1.0 + decode_weight * batch)
                + waiting_weight * waiting * prompt
            )
        return cost

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        cost = self.costs(req, endpoints)
        n = max(1, len(req.token_ids))
        best = cost[0] if cost else 0.0
        for c in cost:
            if c < best:
                best = c
        best += n
        out = {}
        for i, e in enumerate(endpoints):
            out[e.name] = best / (cost[i] + n)
        return out
