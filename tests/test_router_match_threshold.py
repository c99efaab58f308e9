"""matchThreshold: a best prefix match under a fraction of the prompt is not followed (prefix
scorers give 0 everywhere) and counts as cold for the no-hit LRU scorer."""

from __future__ import annotations

from kvmesh.router.endpoints import Endpoint
from kvmesh.router.plugins import (
    ApproxPrefixScorer,
    NoHitLRUScorer,
    PrecisePrefixScorer,
    SchedulingRequest,
    SchedulingState,
)


class Index:
    def __init__(self, hits: dict[str, float]) -> None:
        self.hits = hits

    def longest_match(self, keys, names):
        return {n: h for n, h in self.hits.items() if n in names}


def request(index: Index, eps: list[Endpoint], blocks: int = 10) -> SchedulingRequest:
    """A request whose scheduling state holds `index`'s answer as both matches."""
    req = SchedulingRequest("r", None, [], list(range(blocks)), {})
    req.state = SchedulingState.of(req)
    req.state.look_up(req.block_keys, [e.name for e in eps], index, index)
    return req


def endpoints() -> list[Endpoint]:
    return [Endpoint("http://a"), Endpoint("http://b"), Endpoint("http://c")]


def test_short_shared_match_is_not_followed() -> None:
    eps = endpoints()
    a, b, c = (e.name for e in eps)
    shared = Index({a: 3, b: 3})  # 3 of 10 blocks: a system prompt every session shares
    req = request(shared, eps)
    assert PrecisePrefixScorer("p", 0.5).score(req, eps) == [0.0, 0.0, 0.0]
    assert ApproxPrefixScorer("x", 0.5).score(req, eps) == [0.0, 0.0, 0.0]
    assert req.state.best_fraction() == 0.3
    lru = NoHitLRUScorer("n", threshold=0.5)
    assert lru.cold(req) and set(lru.score(req, eps)) == {1.0, 0.5, 0.0}
    # without a threshold the same request is warm and its holders score by fraction
    assert PrecisePrefixScorer("p").score(req, eps) == [0.3, 0.3, 0.0]  # a, b, c
    assert not NoHitLRUScorer("n").cold(req)


def test_long_match_is_followed() -> None:
    eps = endpoints()
    a, b, c = (e.name for e in eps)
    req = request(Index({a: 8, b: 3}), eps)
    scores = PrecisePrefixScorer("p", 0.5).score(req, eps)
    assert scores == [0.8, 0.3, 0.0]  # a, b, c
    lru = NoHitLRUScorer("n", threshold=0.5)
    assert not lru.cold(req) and set(lru.score(req, eps)) == {0.5}
