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

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        uncached = req.state.uncached_of(endpoints)
        cost = [e.pending_prefill_tokens + u for e, u in zip(endpoints, uncached, strict=True)]
        best = min(cost, default=0)
        return [max(0.0, 1.0 - (c - best) / self.scale_tokens) for c in cost]


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

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        """Each endpoint's cost (tokens of prefill), then (best + n) / (cost + n). The batch an
        endpoint's stall holds up is scorers.requests_in_flight, inline: one loop over the
        endpoints for the costs, the router's hottest scorer."""
        prompt = len(req.token_ids)
        decode_weight, waiting_weight = self.decode_weight, self.waiting_weight
        cost = []
        for e, uncached in zip(endpoints, req.state.uncached_of(endpoints), strict=True):
            f, waiting = e.in_flight, e.waiting
            g = e.running + waiting
            cost.append(
                e.pending_prefill_tokens
                + uncached * (1.0 + decode_weight * (f if f > g else g))
                + waiting_weight * waiting * prompt
            )
        n = prompt or 1
        best = cost[0] if cost else 0.0
        for c in cost:
            if c < best:
                best = c
        best += n
        out = []
        for c in cost:
            out.append(best / (c + n))
        return out
