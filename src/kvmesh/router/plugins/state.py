"""The per-request scheduling state (llm-d's CycleState): what the plugins of one scheduling pass
share. The pipeline fills the prefix matches once, before any filter, over every candidate
endpoint; profiles add their results under their own names.

This module is the one home of "blocks cached on an endpoint" and "prompt tokens an endpoint
would compute": scorers, the disagg handler's threshold, peer-source selection and the
forward's bookkeeping all read them here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint
    from kvmesh.router.plugins.base import SchedulingRequest

# "not looked up": shared, read-only; an index's answer, even an empty one, is another object
NO_MATCH: Mapping = MappingProxyType({})


class ProfileResult(NamedTuple):
    endpoint: Endpoint | None
    totals: dict[str, float]
    scores: dict[str, dict[str, float]]  # scorer name -> endpoint -> score in [0, 1]
    endpoints: Sequence[Endpoint] = ()  # the candidates its filters left


class SchedulingResult(NamedTuple):
    primary: Endpoint | None  # the endpoint that answers (decode, under P/D)
    profiles: dict[str, ProfileResult]  # by profile name: SchedulingState.profiles
    prefill: Endpoint | None = None  # set when the prompt is prefilled elsewhere first


@dataclass(slots=True)
class SchedulingState:
    """Invariant: `precise` and `approximate` are each NO_MATCH (not looked up) or the index's
    longest_match over every endpoint the pass started with (or, when a later reader such as
    peer-source selection filled it, over those it reads); an endpoint absent holds nothing.
    A match is replaced, never changed in place: what is derived from the pair (`held`) is
    recomputed when either is another object. No reference back to the request, so a request
    and its state are freed by refcount."""

    prompt_tokens: int
    block_size: int
    total_blocks: int  # full blocks of the prompt (its block keys)
    precise: Mapping[str, float]  # leading blocks, weighted by medium (KV events)
    approximate: Mapping[str, int]  # leading blocks the router sent there
    profiles: dict[str, ProfileResult] = field(default_factory=dict)
    # derived from (precise, approximate) as they were when `_basis` was taken
    _basis: tuple[Mapping, Mapping] | None = field(default=None, repr=False, compare=False)
    _held: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    _best: float = field(default=0.0, repr=False, compare=False)

    @classmethod
    def of(cls, req: SchedulingRequest) -> SchedulingState:
        keys = req.block_keys
        return cls(len(req.token_ids), req.block_size, len(keys), NO_MATCH, NO_MATCH, {})

    def look_up(
        self,
        keys: list[int],
        names: Iterable[str],
        precise_index: Any = None,
        approximate_index: Any = None,
    ) -> None:
        """Fill each match not filled yet from its index, when given (`keys`: the request's)."""
        if not keys:
            return
        names = names if isinstance(names, list) else list(names)
        if precise_index is not None and self.precise is NO_MATCH:
            self.precise = precise_index.longest_match(keys, names)
        if approximate_index is not None and self.approximate is NO_MATCH:
            self.approximate = approximate_index.longest_match(keys, names)

    def held(self) -> Mapping[str, float]:
        """blocks_cached of every endpoint with a match (absent: none), derived once per pair
        of matches. Read-only for callers."""
        p, a = self.precise, self.approximate
        basis = self._basis
        if basis is None or basis[0] is not p or basis[1] is not a:
            if not p and not a:  # nothing held anywhere (or not looked up): the common cold case
                self._held, self._basis, self._best = {}, (p, a), 0.0
                return self._held
            if not a:
                held = {k: max(v, 0) for k, v in p.items()}
            else:
                held = {k: max(p.get(k, 0.0), a.get(k, 0)) for k in (p.keys() | a.keys())}
            # an engine computes the prompt's last token whatever it holds (vLLM's rule, and
            # ours): a prompt of whole blocks gets at most all but its last block from cache
            servable = (self.prompt_tokens - 1) // self.block_size  # (no ids given: no cap)
            if 0 <= servable < self.total_blocks:
                held = {k: min(v, servable) for k, v in held.items()}
            self._held, self._basis = held, (p, a)
            self._best = max(held.values(), default=0.0)
        return self._held

    def blocks_cached(self, endpoint: str) -> float:
        """Leading prompt blocks `endpoint` is known to hold and would serve from cache: the
        longer of the precise match (tier-weighted) and the router's own past decisions, less
        the block of the prompt's last token (always computed)."""
        return self.held().get(endpoint, 0.0)

    def uncached_tokens(self, endpoint: str) -> int:
        """Prompt tokens `endpoint` would compute: the prompt less its cached prefix."""
        blocks = self.held().get(endpoint)
        if not blocks:
            return max(0, self.prompt_tokens)
        return max(0, self.prompt_tokens - int(blocks * self.block_size))

    def best_blocks(self) -> float:
        """The most leading blocks any endpoint is known to hold."""
        self.held()
        return self._best

    def best_fraction(self) -> float:
        """The largest fraction of the prompt's blocks any endpoint is known to hold."""
        return self.best_blocks() / self.total_blocks if self.total_blocks else 0.0
