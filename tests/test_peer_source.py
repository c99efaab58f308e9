"""Router-side peer source selection: a pure function of matches, queues and a threshold."""

from __future__ import annotations

import random

import pytest

from kvmesh.router.peer_source import (
    PEER_HEADER,
    PeerSourceConfig,
    choose_peer_source,
    source_headers,
)

CFG = PeerSourceConfig(min_cached_token_delta=64, block_size=16)


def test_names_the_endpoint_with_a_long_enough_lead():
    matched = {"http://a:1": 2, "http://b:2": 10}
    assert choose_peer_source("http://a:1", matched, CFG) == "http://b:2"


def test_no_source_when_the_lead_is_short_or_nobody_else_holds_it():
    assert choose_peer_source("http://a:1", {"http://a:1": 8, "http://b:2": 11}, CFG) is None
    assert choose_peer_source("http://a:1", {"http://a:1": 8}, CFG) is None
    assert choose_peer_source("http://a:1", {}, CFG) is None


def test_ties_prefer_the_less_loaded_source():
    matched = {"http://b:2": 10, "http://c:3": 10}
    queue = {"http://b:2": 50, "http://c:3": 0}
    rng = random.Random(0)
    picks = [choose_peer_source("http://a:1", matched, CFG, queue, rng) for _ in range(200)]
    assert picks.count("http://c:3") > 150


def test_header_is_host_port():
    assert source_headers("http://10.0.0.7:8001") == {PEER_HEADER: "10.0.0.7:8001"}
    assert source_headers(None) == {} and source_headers("nohost") == {}


def test_bad_config_is_refused():
    with pytest.raises(ValueError):
        PeerSourceConfig(min_cached_token_delta=0)


class FakeIndex:
    def __init__(self, matched: dict[str, float]) -> None:
        self.matched = matched

    def longest_match(self, keys, endpoints):
        return {e: m for e, m in self.matched.items() if e in set(endpoints)}


def test_select_source_skips_failed_endpoints_and_ranks_of_the_chosen_server():
    from kvmesh.router.endpoints import Endpoint
    from kvmesh.router.peer_source import select_source
    from kvmesh.router.plugins import SchedulingRequest

    chosen = Endpoint("http://a:1", "a#dp0", dp_rank=0)
    sibling = Endpoint("http://a:1", "a#dp1", dp_rank=1)
    b, c = Endpoint("http://b:2"), Endpoint("http://c:3")
    req = SchedulingRequest("r", None, list(range(320)), list(range(20)), {})
    index = FakeIndex({"a#dp1": 20, "http://b:2": 12, "http://c:3": 10})
    source = select_source(index, [chosen, sibling, b, c], chosen, req, CFG)
    assert source is not None and source.address == "b:2" and source.lead_tokens == 192
    source = select_source(index, [chosen, sibling, b, c], chosen, req, CFG, {"http://b:2"})
    assert source is not None and source.endpoint is c
    assert select_source(index, [chosen, sibling], chosen, req, CFG) is None
