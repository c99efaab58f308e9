"""The router keys prompts in the engines' KV block size: learned from their /metrics
(vllm:cache_config_info) or given, refused at start when they disagree, an engine of another
size kept out of rotation later, and BlockStored events of another size kept out of the index."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import pytest
import yaml
from aiohttp import web

from kvmesh.protocol.hashing import BlockHasher, block_hash_to_int
from kvmesh.protocol.kv_events import BlockStored
from kvmesh.protocol.prom import parse_block_size
from kvmesh.protocol.zmq_events import KVEventsConfig, ZmqEventPublisher
from kvmesh.router.app import Router, RouterConfig, start_router
from kvmesh.router.block_size import BlockSizeMismatch
from tests.helpers import loop_thread


def cache_page(block_size: int | None) -> str:
    """A /metrics page as vLLM writes it, declaring `block_size` (None: no cache_config_info)."""
    page = 'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
    if block_size is not None:
        page += (
            "# HELP vllm:cache_config_info Information of the cache config.\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",'
            f'engine="0",prefix_caching_hash_algo="sha256"}} 1.0\n'
        )
    return page


class MetricsServer:
    """An engine as the router's scrape sees it: /metrics only, its page changeable."""

    def __init__(self, block_size: int | None) -> None:
        self.page = cache_page(block_size)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> MetricsServer:
        app = web.Application()

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=self.page)

        app.router.add_get("/metrics", metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()


async def until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def router_for(tokenizer, urls: list[str], **config) -> Router:
    cfg = {"preset": "round-robin", "kv_events": None, "scrape_interval": 0.02, **config}
    return Router(RouterConfig(urls, **cfg), tokenizer)


def test_block_size_is_read_from_cache_config_info() -> None:
    assert parse_block_size(cache_page(128)) == 128
    assert parse_block_size(cache_page(None)) is None
    assert parse_block_size('vllm:cache_config_info{block_size="auto"} 1.0') is None
    assert parse_block_size('vllm:cache_config_info{block_size="32"} 0.0') is None


async def test_learned_block_size_keys_prompts_in_its_blocks(tokenizer) -> None:
    engine = await MetricsServer(32).start()
    router = router_for(tokenizer, [engine.url], preset="approx-prefix")
    server = await start_router(router, "127.0.0.1", 0)
    try:
        assert router.block_size.value == 32
        ids = list(range(100, 200))  # 100 tokens: 3 full blocks of 32
        body = json.dumps({"model": "m", "prompt": ids}).encode()
        req = router.scheduling_request(body, "/v1/completions", {})
        expected = BlockHasher("sha256", 32).hash_blocks(ids, 0, None)
        assert req.block_size == 32
        assert req.block_keys == [block_hash_to_int(d) for d in expected]
        assert b"kvmesh_router_block_size 32.0" in router.render_metrics()
    finally:
        await server.cleanup()
        await engine.stop()


@pytest.mark.parametrize(
    ("sizes", "given", "words"),
    [
        ((128,), 16, ["uses block size 128 but --block-size is 16", "set 128"]),
        ((16, 128), None, ["disagree", "uses 16", "uses 128"]),
    ],
)
async def test_start_is_refused_when_sizes_cannot_match(tokenizer, sizes, given, words) -> None:
    engines = [await MetricsServer(size).start() for size in sizes]
    router = router_for(tokenizer, [e.url for e in engines], block_size=given)
    try:
        with pytest.raises(BlockSizeMismatch) as refused:
            await router.start()
        message = str(refused.value)
        for word in [engines[-1].url, *words]:
            assert word in message
        assert router.session.closed and not router.pool._tasks
    finally:
        for e in engines:
            await e.stop()


def test_kvmesh_router_exits_2_naming_the_engine_and_the_fix(tokenizer, monkeypatch, capsys):
    from kvmesh import cli
    from kvmesh.commands import router as router_cmd
    from kvmesh.engine import tokenizer as tokenizer_mod

    async def started_never_waits() -> None:  # were the start accepted, main() returns 0
        return None

    monkeypatch.setattr(tokenizer_mod, "load_tokenizer", lambda name: (tokenizer, None))
    monkeypatch.setattr(router_cmd, "wait_for_shutdown", started_never_waits)
    with loop_thread(MetricsServer(128).start, MetricsServer.stop) as (engine, _):
        argv = ["router", "--endpoint", engine.url, "--block-size", "16", "--port", "0"]
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"engine {engine.url} uses block size 128 but --block-size is 16" in err
    assert "drop --block-size to learn it or set 128" in err


async def test_an_engine_of_another_size_is_kept_out_of_rotation(tokenizer, tmp_path) -> None:
    first, joiner = await MetricsServer(16).start(), await MetricsServer(128).start()
    path = tmp_path / "endpoints.yaml"
    path.write_text(yaml.safe_dump([first.url]))
    router = router_for(tokenizer, [], endpoints_file=str(path))
    server = await start_router(router, "127.0.0.1", 0)
    try:
        assert router.block_size.value == 16
        path.write_text(yaml.safe_dump([first.url, joiner.url]))
        os.utime(path, (time.time() + 5, time.time() + 5))
        router.pool._reload_file()  # as the file watcher does within a second
        late = router.pool.endpoints[joiner.url]
        await until(lambda: late.block_size == 128)
        assert late.block_size_mismatch and late.healthy
        assert [e.url for e in router.pool.candidates()] == [first.url]
        flag = 'kvmesh_router_endpoint_block_size_mismatch{endpoint="%s"} %s'
        page = router.render_metrics().decode()
        assert flag % (joiner.url, "1.0") in page and flag % (first.url, "0.0") in page
        assert router.block_size.value == 16

        first.page = cache_page(128)  # the fleet moved: the learned size follows it
        await until(lambda: router.block_size.value == 128 and not late.block_size_mismatch)
        assert sorted(e.url for e in router.pool.candidates()) == sorted([first.url, joiner.url])
        assert router.tokens.block_size == 128
    finally:
        await server.cleanup()
        await first.stop()
        await joiner.stop()


async def test_a_given_size_stays_and_a_restarted_engine_is_excluded(tokenizer) -> None:
    engine = await MetricsServer(16).start()
    router = router_for(tokenizer, [engine.url], block_size=16)
    server = await start_router(router, "127.0.0.1", 0)
    try:
        engine.page = cache_page(64)  # restarted with another --block-size
        ep = router.pool.endpoints[engine.url]
        await until(lambda: ep.block_size_mismatch)
        assert router.block_size.value == 16 and router.pool.candidates() == []
        # failing open (no healthy endpoint) never reaches one of another block size
        assert (
            router.pick(
                router.scheduling_request(b'{"prompt": "hi"}', "/v1/completions", {}), set()
            )
            is None
        )
        engine.page = cache_page(16)
        await until(lambda: not ep.block_size_mismatch)
        assert router.pool.candidates() == [ep]
    finally:
        await server.cleanup()
        await engine.stop()


async def test_the_first_size_learned_after_start_is_adopted(tokenizer, caplog) -> None:
    engine = await MetricsServer(None).start()
    router = router_for(tokenizer, [engine.url])
    with caplog.at_level(logging.WARNING, "kvmesh.router.block_size"):
        server = await start_router(router, "127.0.0.1", 0)
    try:
        assert router.block_size.value == 16 and "no engine reported" in caplog.text
        router.approximate_index.record(engine.url, [1, 2, 3])  # keyed in 16-token blocks
        engine.page = cache_page(128)
        await until(lambda: router.block_size.value == 128)
        assert router.tokens.block_size == router.parser.block_size == 128
        assert router.approximate_index.num_entries() == 0
        assert router.pool.candidates() == [router.pool.endpoints[engine.url]]
    finally:
        await server.cleanup()
        await engine.stop()


def stored(hashes: list[int], block_size: int) -> BlockStored:
    return BlockStored(hashes, None, [], block_size, None, "GPU", None)


async def test_block_stored_of_another_size_is_dropped(tokenizer, tmp_path) -> None:
    engine = await MetricsServer(16).start()
    events = f"ipc://{tmp_path}/kv"
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=events))
    router = router_for(tokenizer, [engine.url], preset="precise-prefix", kv_events=events)
    server = await start_router(router, "127.0.0.1", 0)
    name, index = engine.url, router.precise_index
    try:

        def indexed(key: int) -> bool:
            return bool(index.longest_match([key], [name]).get(name))

        def live() -> bool:
            pub.publish([stored([1], 16)])  # again until the subscription is live
            return indexed(1)

        await until(live)
        # a placeholder of an old offload connector (block size 0) is kept, 128 is not
        pub.publish([stored([2], 128), stored([3], 0), stored([4], 16)])
        await until(lambda: indexed(4))
        assert indexed(3) and not indexed(2)
        dropped = 'kvmesh_router_kv_events_dropped_total{endpoint="%s",reason="block_size"} 1.0'
        assert dropped % name in router.render_metrics().decode()
    finally:
        await server.cleanup()
        pub.close()
        await engine.stop()
