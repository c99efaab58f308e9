"""The endpoint picker behind a real Envoy when engines fail: fallback endpoints (the Inference
Extension's IP:PORT,IP:PORT list) that Envoy's retries walk, and an OpenAI-shaped 503 from the
gateway when no engine can serve."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("grpc")

from tests.helpers import http  # noqa: E402
from tests.test_ext_proc import address, envoy, picker, wait_for  # noqa: E402


@contextlib.contextmanager
def engines(tokenizer, count: int) -> Iterator[tuple[list[str], object, asyncio.AbstractEventLoop]]:
    """Emulated engines on their own loop thread: yields their URLs, the fleet and the loop
    (to stop one with)."""
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.emulation.builder import EmulationConfig
    from kvmesh.engine.emulation.host import EmulatedFleet

    emu = EmulationConfig(emulate_ttft_ms=5.0, emulate_itl_ms=1.0)
    fleet = EmulatedFleet(EngineConfig(), emu, tokenizer, count)
    loop = asyncio.new_event_loop()
    started = asyncio.run_coroutine_threadsafe(fleet.start("127.0.0.1", 0), loop)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield started.result(timeout=30), fleet, loop
    finally:
        asyncio.run_coroutine_threadsafe(fleet.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def stop_engine(fleet, loop, index: int) -> None:
    asyncio.run_coroutine_threadsafe(fleet.stop_engine(index), loop).result(timeout=10)


def test_envoy_walks_the_fallbacks_when_the_chosen_engine_is_gone(tokenizer) -> None:
    """The picker still believes a stopped engine serves (its scrapes are 30 s apart) and
    names it first in turn (round robin); Envoy's retry goes to the fallback the picker named
    after it, every request is answered, and the picker learns who served."""
    with engines(tokenizer, 2) as (urls, fleet, loop):
        config = {"preset": "round-robin", "kv_events": None, "scrape_interval": 30.0}
        config["ext_proc_fallback_endpoints"] = 1
        with (
            picker(tokenizer, urls, **config) as (router, port, _),
            envoy(port, endpoints=[address(u) for u in urls]) as url,
        ):
            wait_for(lambda: len(router.pool.candidates()) == 2)
            stop_engine(fleet, loop, 0)
            live = next(e.name for e in router.pool.endpoints.values() if e.url == urls[1])
            for i in range(4):  # two of them name the stopped engine first
                code, head, raw = http(
                    url + "/v1/completions", {"prompt": f"hi {i}", "max_tokens": 2}
                )
                assert code == 200, raw
                assert head["x-kvmesh-endpoint"] == live  # the endpoint that served


@pytest.mark.parametrize("body_mode", ["buffered", "full-duplex-streamed"])
def test_no_engine_left_is_an_openai_503_from_the_gateway(tokenizer, body_mode: str) -> None:
    """Every engine down: the picker names none (it cannot retry, so it never guesses one out
    of rotation) and Envoy answers the client the picker's 503 with an OpenAI error body."""
    with engines(tokenizer, 2) as (urls, fleet, loop):
        config = {"preset": "round-robin", "kv_events": None, "scrape_interval": 0.05}
        with picker(tokenizer, urls, **config) as (router, port, _), envoy(port, body_mode) as url:
            wait_for(lambda: len(router.pool.candidates()) == 2)
            stop_engine(fleet, loop, 0)
            stop_engine(fleet, loop, 1)
            wait_for(lambda: not router.pool.candidates())
            code, head, raw = http(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert code == 503 and head["content-type"] == "application/json"
            error = json.loads(raw)["error"]
            assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
            assert head["retry-after"] == "1"
