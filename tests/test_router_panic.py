"""Envoy's panic threshold in the router: outlier ejections for timeouts and 5xx never leave
clients with too few endpoints; below --healthy-panic-threshold percent in rotation, requests
go to every endpoint that answers, ejected or not, but never to one refusing connections."""

from __future__ import annotations

import time

from kvmesh.cli import build_parser, main
from kvmesh.commands.router import router_config_from
from kvmesh.router.endpoints import Endpoint, EndpointPool
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.outlier import OutlierDetection
from tests.test_router_proxy import Engine, exchange, post, routed
from tests.test_router_resilience import status


def fleet_of(n: int, panic: float = 50.0) -> tuple[list[Endpoint], EndpointPool]:
    eps = [Endpoint(f"http://e{i}:1") for i in range(n)]
    pool = EndpointPool(eps, outlier=OutlierDetection(1, 30.0, 300.0, 100.0, panic))
    pool.metrics = RouterMetrics()
    return eps, pool


def names(endpoints: list[Endpoint]) -> list[str]:
    return sorted(e.name[-4:-2] for e in endpoints)


def test_below_the_threshold_every_endpoint_that_answers_is_routed_to() -> None:
    eps, pool = fleet_of(4)
    for e in eps[:2]:
        pool.request_failed(e, "timeout")
    assert names(pool.candidates()) == ["e2", "e3"]  # half in rotation: not yet panic
    assert not pool.panic
    pool.request_failed(eps[2], "timeout")
    assert all(e.ejected for e in eps[:3])
    # one of four in rotation: the ejected serve again rather than leave one alone
    assert names(pool.candidates()) == ["e0", "e1", "e2", "e3"]
    assert pool.panic and b"kvmesh_router_healthy_panic 1.0" in pool.metrics.render()
    pool.unreachable(eps[0])  # refused its connection: never routed to, panic or not
    pool.unreachable(eps[1], timed_out=True)  # too busy to answer a scrape: still a chance
    assert names(pool.candidates()) == ["e1", "e2", "e3"]
    for e in eps[:3]:
        e.ejected_until = 0.0
    eps[0].mark_success()
    eps[1].mark_success()
    assert names(pool.candidates()) == ["e0", "e1", "e2", "e3"] and not pool.panic
    assert b"kvmesh_router_healthy_panic 0.0" in pool.metrics.render()


def test_no_panic_when_it_would_add_no_endpoint() -> None:
    eps, pool = fleet_of(2)
    for e in eps:
        pool.unreachable(e)  # both refuse: nothing to spread over
    assert pool.candidates() == [] and not pool.panic


def test_a_threshold_of_0_never_panics() -> None:
    eps, pool = fleet_of(2, panic=0.0)
    pool.request_failed(eps[0], "5xx")
    assert names(pool.candidates()) == ["e1"] and not pool.panic


def test_the_threshold_is_a_router_flag_checked_before_start(capsys) -> None:
    args = build_parser().parse_args(
        ["router", "--endpoint", "http://x:1", "--healthy-panic-threshold", "30"]
    )
    config = router_config_from(args, args.endpoint)
    assert config.healthy_panic_threshold == 30.0
    assert config.outlier_detection().healthy_panic_threshold == 30.0
    up = build_parser().parse_args(["up", "--healthy-panic-threshold", "20"])
    assert up.healthy_panic_threshold == 20.0  # `kvmesh up` passes it on to its router
    assert main(["router", "--endpoint", "http://x:1", "--healthy-panic-threshold", "150"]) == 2
    assert "--healthy-panic-threshold" in capsys.readouterr().err


async def test_ejected_engines_serve_when_the_last_in_rotation_fails(tokenizer) -> None:
    """Two engines ejected after a 5xx each, then back to health while still ejected; the one
    left in rotation starts failing: the client is served by an ejected one, not given 503."""
    a, b, c = Engine("503"), Engine("503"), Engine("ok")
    config = {
        "outlier_consecutive_errors": 1,
        "outlier_max_ejection_percent": 100.0,
        "max_retries": 2,
    }
    async with routed(tokenizer, [a, b, c], **config) as (router, port):
        pool = router.pool
        ejected = [pool.endpoints[a.url], pool.endpoints[b.url]]
        deadline = time.monotonic() + 30
        while not all(e.ejected for e in ejected):
            assert time.monotonic() < deadline, "a and b never ejected"
            raw = await exchange(port, post("/v1/completions", {"prompt": "p"}))
            assert status(raw) == 200, raw  # c served what a and b failed
        a.mode = b.mode = "ok"
        c.mode = "503"
        for i in range(3):
            raw = await exchange(port, post("/v1/completions", {"prompt": f"q{i}"}))
            assert status(raw) == 200, raw
        assert all(e.ejected_until > time.monotonic() for e in ejected)  # still ejected
        assert b"kvmesh_router_healthy_panic 1.0" in router.render_metrics()
