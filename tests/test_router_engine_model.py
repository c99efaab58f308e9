"""The router refuses engines that serve another model than it expects: a --served-model-name
they do not list, a model the endpoints file lists for them, or a tokenizer that splits text
into other ids. Refused at start (exit 2, naming the fix); an engine reached only later is kept
out of rotation instead; engines that say nothing are not judged; the override routes anyway."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import yaml
from aiohttp import web

from kvmesh.router.app import Router, RouterConfig, start_router
from kvmesh.router.engine_model import EngineModelMismatch
from tests.conftest import emulated_fleet
from tests.helpers import free_port, loop_thread

PAGE = 'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'


class FakeEngine:
    """/metrics, and as configured /v1/models (ids, root) and /tokenize (the router's own ids
    shifted by `shift`; None: no such route)."""

    def __init__(self, tokenizer, ids=("m",), root="/models/m", shift: int | None = 0) -> None:
        self.tokenizer, self.ids, self.root, self.shift = tokenizer, ids, root, shift
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.port = 0

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        if self.ids is not None:
            app.router.add_get("/v1/models", self._models)
        if self.shift is not None:
            app.router.add_post("/tokenize", self._tokenize)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=PAGE)

    async def _models(self, _: web.Request) -> web.Response:
        cards = [
            {"id": i, "object": "model", "root": self.root, "max_model_len": 8} for i in self.ids
        ]
        return web.json_response({"object": "list", "data": cards})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        ids = self.tokenizer.encode(body["prompt"], add_special_tokens=body["add_special_tokens"])
        return web.json_response({"count": len(ids), "tokens": [t + self.shift for t in ids]})

    async def stop(self) -> None:
        await self.runner.cleanup()


def router_for(tokenizer, urls: list[str], **config) -> Router:
    cfg = {"preset": "round-robin", "kv_events": None, "scrape_interval": 0.02, **config}
    return Router(RouterConfig(urls, **cfg), tokenizer)


async def until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def refusal(tokenizer, engine: FakeEngine, **config) -> str:
    router = router_for(tokenizer, [] if "endpoints_file" in config else [engine.url], **config)
    try:
        with pytest.raises(EngineModelMismatch) as refused:
            await router.start()
        assert router.session.closed and not router.pool._tasks
        return str(refused.value)
    finally:
        await engine.stop()


async def test_another_tokenizer_refuses_the_start_naming_the_fix(tokenizer) -> None:
    engine = await FakeEngine(tokenizer, root="/models/qwen3", shift=7).start()
    message = await refusal(tokenizer, engine)
    assert f"engine {engine.url} (/models/qwen3) tokenizes" in message
    assert "the embedded SmolLM2-135M-Instruct's" in message
    assert "--model set to a local copy of /models/qwen3" in message
    assert "--no-engine-model-check" in message


async def test_a_served_model_name_the_engine_does_not_list_refuses_the_start(tokenizer) -> None:
    engine = await FakeEngine(tokenizer, ids=("llama",)).start()
    message = await refusal(tokenizer, engine, served_model_name="qwen")
    assert f"engine {engine.url} serves 'llama' (GET /v1/models), not 'qwen'" in message
    assert "--served-model-name llama" in message


async def test_a_model_the_endpoints_file_lists_must_be_served(tokenizer, tmp_path) -> None:
    engine = await FakeEngine(tokenizer, ids=("llama",)).start()
    path = tmp_path / "endpoints.yaml"
    path.write_text(yaml.safe_dump([{"url": engine.url, "models": ["qwen"]}]))
    message = await refusal(tokenizer, engine, endpoints_file=str(path))
    assert "lists model 'qwen'" in message and "serves 'llama'" in message


@pytest.mark.parametrize("kind", ["agrees", "says nothing", "overridden"])
async def test_engines_that_agree_say_nothing_or_are_overridden_serve(tokenizer, kind) -> None:
    fake = {
        "agrees": {"ids": ("m",)},
        "says nothing": {"ids": None, "shift": None},
        "overridden": {"ids": ("llama",), "shift": 3},
    }[kind]
    engine = await FakeEngine(tokenizer, **fake).start()
    config = {"served_model_name": "m"} if kind != "says nothing" else {}
    if kind == "overridden":
        config["engine_model_check"] = False
    router = router_for(tokenizer, [engine.url], **config)
    server = await start_router(router, "127.0.0.1", 0)
    try:
        e = router.pool.endpoints[engine.url]
        assert e.model_checked and not e.model_mismatch
        assert router.pool.candidates() == [e]
    finally:
        await server.cleanup()
        await engine.stop()


async def test_an_engine_reached_later_with_another_tokenizer_stays_out(tokenizer, caplog) -> None:
    engine = FakeEngine(tokenizer, root="/models/qwen3", shift=7)
    engine.port = free_port()
    url = f"http://127.0.0.1:{engine.port}"
    router = router_for(tokenizer, [url])
    server = await start_router(router, "127.0.0.1", 0)  # nobody there yet: started
    e = router.pool.endpoints[url]
    try:
        assert not e.model_checked
        with caplog.at_level(logging.ERROR, logger="kvmesh.router.engine_model"):
            await engine.start()
            await until(lambda: e.model_checked)
        assert e.healthy and e.model_mismatch and router.pool.candidates() == []
        assert (
            router.pick(router.scheduling_request(b'{"prompt": "x"}', "/v1/completions", {}), set())
            is None
        )
        assert f"endpoint {url} out of rotation: engine {url} (/models/qwen3)" in caplog.text
    finally:
        await server.cleanup()
        await engine.stop()


def test_kvmesh_router_exits_2_with_the_refusal(tokenizer, monkeypatch, capsys) -> None:
    from kvmesh import cli
    from kvmesh.engine import tokenizer as tokenizer_mod

    monkeypatch.setattr(tokenizer_mod, "load_tokenizer", lambda name: (tokenizer, None))
    with loop_thread(FakeEngine(tokenizer, ids=("llama",)).start, FakeEngine.stop) as (fake, _):
        argv = ["router", "--endpoint", fake.url, "--served-model-name", "qwen", "--port", "0"]
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"kvmesh router: engine {fake.url} serves 'llama'" in err


async def test_real_emulated_engines_pass_the_check(tokenizer) -> None:
    """kvmesh's own engines answer /v1/models and /tokenize as the check reads them."""
    with emulated_fleet(tokenizer, 1, engine={"served_model_name": "m"}) as (urls, _):
        router = router_for(tokenizer, urls, served_model_name="m")
        server = await start_router(router, "127.0.0.1", 0)
        try:
            e = router.pool.endpoints[urls[0]]
            assert e.model_checked and not e.model_mismatch
        finally:
            await server.cleanup()
