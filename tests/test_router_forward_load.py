"""One bookkeeping of a forward (router.forward_load), for the HTTP router and the simulator."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvmesh.router import forward_load
from kvmesh.router.approx_index import ApproximateIndex
from kvmesh.router.endpoints import Endpoint
from kvmesh.router.plugins import NO_MATCH, SchedulingRequest, SchedulingState


def scheduled(blocks_cached: dict[str, int]) -> SchedulingRequest:
    """A 64-token, 4-block request as a pass leaves it (the approximate match given)."""
    req = SchedulingRequest("r", None, list(range(64)), [11, 12, 13, 14], {}, 16)
    req.state = SchedulingState(64, 16, 4, NO_MATCH, blocks_cached)
    return req


def counters(e: Endpoint) -> tuple[int, int, int]:
    return e.in_flight, e.in_flight_tokens, e.pending_prefill_tokens


def test_a_forward_charges_its_endpoint_until_prefilled_and_finished():
    e, index = Endpoint("http://a:1"), ApproximateIndex()
    load = forward_load.sent(e, scheduled({e.name: 1}), index)
    assert counters(e) == (1, 64, 48)  # one of four blocks cached: 48 tokens to compute
    assert index.longest_match([11, 12, 13, 14], [e.name]) == {e.name: 4}  # recorded at send
    forward_load.prefilled(load)
    forward_load.prefilled(load)  # once only
    assert counters(e) == (1, 64, 0)
    forward_load.finished(load)
    forward_load.finished(load)  # once only, whichever path ends it
    assert counters(e) == (0, 0, 0)


def test_a_forward_ended_before_its_first_token_releases_its_prefill_too():
    e = Endpoint("http://a:1")
    forward_load.finished(forward_load.sent(e, scheduled({}), ApproximateIndex()))
    assert counters(e) == (0, 0, 0)


def test_a_decode_leg_that_imports_the_prompt_kv_has_no_prefill_pending():
    e = Endpoint("http://d:1")
    load = forward_load.sent(e, scheduled({}), ApproximateIndex(), computes_prompt=False)
    assert counters(e) == (1, 64, 0)
    forward_load.finished(load)
    assert counters(e) == (0, 0, 0)


def test_the_http_router_charge_keeps_its_books_through_forward_load():
    from kvmesh.router.handlers import Charge

    e = Endpoint("http://a:1")
    router = SimpleNamespace(approximate_index=ApproximateIndex())
    charge = Charge(router, scheduled({e.name: 2}), e, None)
    assert counters(e) == (1, 64, 32)
    charge.first_byte()
    assert counters(e) == (1, 64, 0)
    charge.release()
    assert counters(e) == (0, 0, 0)
    assert router.approximate_index.longest_match([11, 12, 13, 14], [e.name]) == {e.name: 4}


def test_the_simulator_keeps_its_books_through_forward_load(monkeypatch, tokenizer):
    from kvmesh.sim import replay
    from kvmesh.sim.fleet import FleetSim, SimRequest

    sent = []
    real = forward_load.sent
    monkeypatch.setattr(
        forward_load, "sent", lambda *a, **k: sent.append(a[0].name) or real(*a, **k)
    )
    sim = FleetSim(replay._configs("", 2, 0.1), "kvmesh", tokenizer)
    requests = [SimRequest(i, 0.1 * i, ((0, 300), (1000 * i, 40)), 3) for i in range(4)]
    records = sim.run(requests)
    assert len(sent) == len(records) == 4
    assert [f"engine-{r.engine}" for r in records] == sent
    for engine in sim.engines:
        assert counters(engine.endpoint) == (0, 0, 0)
    # the 300 shared tokens were predicted cached on the engine that took the first request
    later = [r for r in records[1:] if r.engine == records[0].engine]
    assert later and all(r.chosen_known_tokens >= 288 for r in later)


@pytest.mark.parametrize("flag", [True, False])
def test_prefill_counts_follow_the_state_rounding(flag):
    """The charge is the state's uncached-token count: weighted precise blocks included (a
    65-token prompt, so all four of its full blocks may come from cache)."""
    e = Endpoint("http://a:1")
    req = SchedulingRequest("r", None, list(range(65)), [11, 12, 13, 14], {}, 16)
    req.state = SchedulingState(65, 16, 4, {e.name: 3.8} if flag else {}, NO_MATCH)
    forward_load.sent(e, req, ApproximateIndex())
    assert e.pending_prefill_tokens == (5 if flag else 65)
