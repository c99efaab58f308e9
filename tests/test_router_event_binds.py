"""A publisher that connects (vLLM's rule: a named tcp:// address) reaches one bound SUB socket.
A second router replica on the same host, or a second endpoint naming the same address, cannot
take its events: the subscription is refused, with the reason in the log, a metric and /health
(503), instead of serving with an index that stays empty. It binds once the address is free."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import pytest

from kvmesh.router import events as events_module
from kvmesh.router.endpoints import Endpoint
from kvmesh.router.events import EventIngest
from kvmesh.router.index import PreciseIndex
from tests.helpers import free_port, free_ports

PROMPT = "a long enough prompt to fill some blocks " * 20


async def until(condition, timeout: float = 20.0) -> None:
    """Poll condition() until it holds; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.02)


async def test_second_subscriber_on_a_connect_address_is_refused_until_it_is_free(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(events_module, "REBIND_AFTER", 0.05)
    address = f"tcp://127.0.0.1:{free_ports(1)}"  # where a connecting publisher sends
    first, second = EventIngest(PreciseIndex(), None), EventIngest(PreciseIndex(), None)
    try:
        first.watch(Endpoint("http://127.0.0.1:9", "engine-0", kv_events=address))
        await until(lambda: "engine-0" in first.feeds and first.feeds["engine-0"].warm)
        attempts = []
        attach = second.binds.attach
        second.binds.attach = lambda *args: (attempts.append(args), attach(*args))
        with caplog.at_level(logging.ERROR, logger="kvmesh.router"):
            second.watch(Endpoint("http://127.0.0.1:9", "engine-0", kv_events=address))
            await until(lambda: len(attempts) >= 4)  # retried, each failure logged once only
        assert "address already in use" in second.refused["engine-0"]
        assert "tcp://*:PORT" in second.refused["engine-0"]  # what to configure instead
        assert not first.refused
        assert len([r for r in caplog.records if "engine-0" in r.getMessage()]) == 1
        assert not second.tasks["engine-0"].done()  # still trying

        await first.stop()  # the replica holding the address goes away
        await until(lambda: not second.refused and second.feeds["engine-0"].warm)
    finally:
        await first.stop()
        await second.stop()


async def test_two_endpoints_naming_one_connect_address_are_not_mixed() -> None:
    address = f"tcp://127.0.0.1:{free_ports(1)}"
    ingest = EventIngest(PreciseIndex(), None)
    try:
        ingest.watch(Endpoint("http://127.0.0.1:9", "engine-0", kv_events=address))
        await until(lambda: ingest.feeds["engine-0"].warm)
        ingest.watch(Endpoint("http://127.0.0.1:8", "engine-1", kv_events=address))
        await until(lambda: "engine-1" in ingest.refused)
        assert "bound already for the KV events of engine-0" in ingest.refused["engine-1"]
        assert "engine-0" not in ingest.refused

        ingest.forget("engine-0")  # the address is free for the other endpoint
        await until(lambda: not ingest.refused and ingest.feeds["engine-1"].warm)
    finally:
        await ingest.stop()


async def test_address_not_of_this_host_is_refused_with_the_remedy() -> None:
    ingest = EventIngest(PreciseIndex(), None)
    try:  # a publisher that connects to a Service's name: the router cannot bind a DNS name
        ingest.watch(Endpoint("http://127.0.0.1:9", "e", kv_events="tcp://router.invalid:5557"))
        await until(lambda: "e" in ingest.refused)
        assert "bind:tcp://*:PORT" in ingest.refused["e"]
    finally:
        await ingest.stop()


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.text()


async def test_second_router_replica_is_not_ready_while_it_cannot_take_the_events(
    tokenizer,
) -> None:
    """Two real routers on one host in front of an engine whose publisher connects: the first
    indexes its events; the second answers /health 503 with the reason and sets the metric."""
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.emulation.builder import EmulationConfig
    from kvmesh.engine.emulation.host import EmulatedFleet
    from kvmesh.router.app import Router, RouterConfig, start_router

    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_ports(1)}"}
    config = EngineConfig(kv_events_config=json.dumps(events), num_gpu_blocks=512)
    emu = EmulationConfig(emulate_ttft_ms=5.0, emulate_itl_ms=1.0)
    fleet = EmulatedFleet(config, emu, tokenizer, 1)
    urls = await fleet.start("127.0.0.1", 0)
    routers, servers, ports = [], [], []
    try:
        for _ in range(2):
            router = Router(RouterConfig(endpoints=urls, preset="precise-prefix"), tokenizer)
            ports.append(free_port())
            servers.append(await start_router(router, "127.0.0.1", ports[-1]))
            routers.append(router)
        first, second = routers
        await until(lambda: second.events.refused)
        status, reason = await get(f"http://127.0.0.1:{ports[1]}/health")
        assert status == 503 and "address already in use" in reason
        assert (await get(f"http://127.0.0.1:{ports[0]}/health"))[0] == 200
        metrics = (await get(f"http://127.0.0.1:{ports[1]}/metrics"))[1]
        assert 'kvmesh_router_kv_events_refused{endpoint="' in metrics
        refused = [ln for ln in metrics.splitlines() if ln.startswith("kvmesh_router_kv_events_r")]
        assert refused and all(ln.endswith(" 1.0") for ln in refused)

        await until(lambda: all(f.warm for f in first.events.feeds.values()))
        url = f"http://127.0.0.1:{ports[0]}/v1/completions"
        async with aiohttp.ClientSession() as session:  # a PUB that connects can lose its
            for turn in range(50):  # first batch while it takes the subscription: ask again
                body = {"prompt": f"turn {turn}: {PROMPT}", "max_tokens": 2}
                async with session.post(url, json=body) as resp:
                    assert resp.status == 200
                if first.precise_index.num_entries() > 0:
                    break
                await asyncio.sleep(0.1)
        assert first.precise_index.num_entries() > 0
        assert second.precise_index.num_entries() == 0  # and it says so: not ready
        assert (await get(f"http://127.0.0.1:{ports[1]}/health"))[0] == 503
    finally:
        for server in servers:
            await server.cleanup()
        await fleet.stop()
