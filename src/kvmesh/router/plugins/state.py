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
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint


class RequestShape(Protocol):
    """What a state is sized from (router.plugins.base.SchedulingRequest): the prompt's tokens,
    the block size and the keys of its full blocks."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def block_size(self) -> int: ...
    @property
    def block_keys(self) -> list[int]: ...


# "not looked up": shared, read-only; an index's answer, even an empty one, is another object
NO_MATCH: Mapping = MappingProxyType({})


class ProfileResult(NamedTuple):
    """One profile's pick. A pass keeps its scores as lists aligned with `endpoints` (the
    candidates its filters left, in order); `totals` and `scores` key them by endpoint name
    when read (debug logs, tests), so a pass over hundreds of endpoints builds no dicts."""

    endpoint: Endpoint | None
    endpoints: Sequence[Endpoint]
    total_values: Sequence[float]  # the weighted total of each of `endpoints`
    score_values: Mapping[str, Sequence[float]]  # scorer name -> score of each, in [0, 1]

    @property
    def totals(self) -> dict[str, float]:
        """Endpoint name -> weighted total."""
        return dict(zip([e.name for e in self.endpoints], self.total_values, strict=True))

    @property
    def scores(self) -> dict[str, dict[str, float]]:
        """Scorer name -> endpoint name -> score in [0, 1]."""
        names = [e.name for e in self.endpoints]
        return {k: dict(zip(names, v, strict=True)) for k, v in self.score_values.items()}


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
    # the chosen endpoint's features for a scorer that learns from the forward's first token
    # (plugins.latency.Probe; router.forward_load reports it), None: no such scorer chose
    probe: Any = None
    # derived from (precise, approximate) as they were when `_basis` was taken
    _basis: tuple[Mapping, Mapping] | None = field(default=None, repr=False, compare=False)
    _held: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    _best: float = field(default=0.0, repr=False, compare=False)
    # the names of the candidate list `_names_for` (every plugin reads them)
    _names_for: Sequence | None = field(default=None, init=False, repr=False, compare=False)
    _names: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, req: RequestShape) -> SchedulingState:
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
        precise = precise_index is not None and self.precise is NO_MATCH
        approximate = approximate_index is not None and self.approximate is NO_MATCH
        if not (precise or approximate):
            return
        names = set(names)  # each index reads a set as given: built once for both
        if precise:
            self.precise = precise_index.longest_match(keys, names)
        if approximate:
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
            # max(precise, 0, approximate) per endpoint; C-level copy and max where no precise
            # match is below 0 (so always, with medium weights in [0, 1])
            if not p or min(p.values()) >= 0:  # (matches are never changed: p may be shared)
                held = dict(p) if a else p
                for k, w in a.items():
                    v = held.get(k, 0.0)
                    held[k] = w if w > v else v
            elif not a:
                held = {k: max(v, 0) for k, v in p.items()}
            else:
                held = {k: max(p.get(k, 0.0), a.get(k, 0)) for k in (p.keys() | a.keys())}
            best = max(held.values(), default=0.0)
            # an engine computes the prompt's last token whatever it holds (vLLM's rule, and
            # ours): a prompt of whole blocks gets at most all but its last block from cache
            servable = (self.prompt_tokens - 1) // self.block_size  # (no ids given: no cap)
            if 0 <= servable < self.total_blocks and not best <= servable:
                held = {k: min(v, servable) for k, v in held.items()}
                best = max(held.values())
            self._held, self._basis, self._best = held, (p, a), best
        return self._held

    def names(self, endpoints: Sequence[Endpoint]) -> list[str]:
        """The names of `endpoints`, in order, listed once per candidate list of the pass (a
        profile gives all its plugins one list). Read-only for callers."""
        if endpoints is not self._names_for:
            self._names_for, self._names = endpoints, [e.name for e in endpoints]
        return self._names

    def uncached_of(self, endpoints: Sequence[Endpoint]) -> list[int]:
        """uncached_tokens of each of `endpoints`, in order."""
        held = self.held()
        if not held:
            return [max(0, self.prompt_tokens)] * len(endpoints)
        names, uncached = self.names(endpoints), self._uncached
        if len(names) <= 8:
            out = []
            for name in names:
                out.append(uncached(held.get(name)))
            return out
        # once per distinct match: many endpoints hold the same prefix (a system prompt)
        of = {b: uncached(b) for b in set(held.values())}
        of[None] = uncached(None)
        return list(map(of.__getitem__, map(held.get, names)))

    def _uncached(self, blocks: float | None) -> int:
        """Prompt tokens an endpoint holding `blocks` leading blocks (None: none) computes."""
        if not blocks:
            return max(0, self.prompt_tokens)
        return max(0, self.prompt_tokens - int(blocks * self.block_size))

    def blocks_cached(self, endpoint: str) -> float:
        """Leading prompt blocks `endpoint` is known to hold and would serve from cache: the
        longer of the precise match (tier-weighted) and the router's own past decisions, less
        the block of the prompt's last token (always computed)."""
        return self.held().get(endpoint, 0.0)

    def uncached_tokens(self, endpoint: str) -> int:
        """Prompt tokens `endpoint` would compute: the prompt less its cached prefix."""
        return self._uncached(self.held().get(endpoint))

    def best_blocks(self) -> float:
        """The most leading blocks any endpoint is known to hold."""
        self.held()
        return self._best

    def best_fraction(self) -> float:
        """The largest fraction of the prompt's blocks any endpoint is known to hold."""
        return self.best_blocks() / self.total_blocks if self.total_blocks else 0.0
