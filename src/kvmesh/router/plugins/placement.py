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

from kvmesh.router.plugins.base import PrefixReader
from kvmesh.router.plugins.scorers import IN_FLIGHT
from kvmesh.router.plugins.terms import Term, TermScorer


@dataclass(slots=True)
class PrefillBacklogScorer(PrefixReader, TermScorer):
    """1 for the endpoint with the least prefill ahead of this request's first token (its
    pending prefill plus this request's uncached tokens there), falling linearly to 0 at
    `scale_tokens` more; a tie scores 1 everywhere."""

    term = Term(
        setup="_u = state.uncached_of(endpoints)\n_c = []",
        gather="_c.append(e.pending_prefill_tokens + _u[i])",
        finish="_b = min(_c)",
        score="max(0.0, 1.0 - (_c[i] - _b) / me.scale_tokens)",
    )

    name: str
    scale_tokens: int  # a backlog this much larger than the best scores 0

    def __post_init__(self) -> None:
        if self.scale_tokens <= 0:
            raise ValueError(f"{self.name}: scaleTokens must be positive, got {self.scale_tokens}")


@dataclass(slots=True)
class PlacementCostScorer(PrefixReader, TermScorer):
    """What placing this request on an endpoint costs the fleet, in tokens of prefill: the
    endpoint's pending prefill (which this request waits behind) plus this request's uncached
    tokens there, which it waits for and which stall every request in flight there for as long
    (a chunked-prefill step carries the decode batch, so each decoder waits out the chunk).
    `decode_weight` prices one decoder's stall against the request's own wait. A request the
    engine reports waiting (its batch or KV limits bind) delays this one by at least a slot's
    turn, priced as computing this whole prompt again (`waiting_weight` prompts each).

    Scored (best + n) / (cost + n) for an n-token prompt: 1 for the cheapest endpoint, and a
    difference counts in proportion to the prompt's own size, so a few blocks more or less
    decide nothing while a long context recomputed beside a busy batch decides much. The
    batch an endpoint's stall holds up is its requests in flight (scorers.IN_FLIGHT, in _x)."""

    term = Term(
        setup="""_u = state.uncached_of(endpoints)
_p = len(req.token_ids)
_dw = me.decode_weight
_ww = me.waiting_weight
_c = []""",
        gather=f"""{IN_FLIGHT}
_c.append(e.pending_prefill_tokens + _u[i] * (1.0 + _dw * _x) + _ww * e.waiting * _p)""",
        finish="_n = _p or 1\n_b = min(_c) + _n",
        score="_b / (_c[i] + _n)",
    )

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
