"""The router finds and follows each engine's KV events over TCP, as a fleet publishes them
(``tcp://*:PORT`` on the engine, offset per engine), not only over ipc://."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from kvmesh.router.event_sources import subscribe_address
from tests.helpers import free_port, free_ports, http


def test_subscribe_address_connects_to_binding_publishers() -> None:
    assert subscribe_address("tcp://*:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert subscribe_address("ipc:///tmp/kv", "10.0.0.7") == "ipc:///tmp/kv"
    # a publisher that connects to a named address: the router binds it
    assert subscribe_address("tcp://10.0.0.2:5557", "10.0.0.7") == "bind:tcp://10.0.0.2:5557"


def test_router_indexes_events_published_on_tcp_wildcards(tokenizer) -> None:
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.emulation.builder import EmulationConfig
    from kvmesh.engine.emulation.host import EmulatedFleet
    from kvmesh.router.app import Router, RouterConfig, start_router

    base = free_ports(2)
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{base}"}
    config = EngineConfig(kv_events_config=json.dumps(events), num_gpu_blocks=512)
    emu = EmulationConfig(emulate_ttft_ms=5.0, emulate_itl_ms=1.0)
    fleet = EmulatedFleet(config, emu, tokenizer, 2)
    loop, ready, state, port = asyncio.new_event_loop(), threading.Event(), {}, free_port()

    def run() -> None:
        asyncio.set_event_loop(loop)
        urls = loop.run_until_complete(fleet.start("127.0.0.1", 0))
        router = Router(RouterConfig(endpoints=urls, preset="precise-prefix"), tokenizer)
        state["runner"] = loop.run_until_complete(start_router(router, "127.0.0.1", port))
        state["router"] = router
        ready.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    assert ready.wait(60)
    router = state["router"]
    try:
        time.sleep(1.0)  # subscriptions settle before the first event
        body = {"prompt": "a long enough prompt to fill some blocks " * 20, "max_tokens": 2}
        for _ in range(2):
            assert http(f"http://127.0.0.1:{port}/v1/completions", body)[0] == 200
        deadline = time.monotonic() + 10
        while router.precise_index.num_entries() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert router.precise_index.num_entries() > 0
        assert router.events.batches > 0 and all(not t.done() for t in router.events.tasks.values())
    finally:
        asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(timeout=30)
        asyncio.run_coroutine_threadsafe(fleet.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
