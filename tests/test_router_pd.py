"""Selective P/D through the router: the disagg profile handler, vLLM's NixlConnector protocol
between emulated engines, the threshold, and the fallback when prefill fails."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import threading
from pathlib import Path

import yaml

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.emulation.builder import EmulationConfig
from kvmesh.engine.emulation.host import EmulatedFleet
from kvmesh.router.app import Router, RouterConfig, start_router
from tests.helpers import free_port, http

PD_CONFIG = """
plugins:
- {type: disagg-profile-handler, parameters: {nonCachedTokens: 200}}
- {type: decode-filter}
- {type: prefill-filter}
- {type: prefix-cache-scorer}
- {type: queue-scorer}
schedulingProfiles:
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: prefix-cache-scorer, weight: 3},
            {pluginRef: queue-scorer}]
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: queue-scorer}]
"""


@contextlib.contextmanager
def pd_stack(tokenizer, prefill_faults: dict | None = None):
    """Engine 0 labelled prefill, engines 1-2 decode; the router reads roles from a file."""
    tmp = Path(tempfile.mkdtemp())
    engine = EngineConfig(
        num_gpu_blocks=2048,
        kv_transfer_config=json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"}),
    )
    emu = EmulationConfig(emulate_ttft_ms=30.0, emulate_itl_ms=5.0)
    fleet = EmulatedFleet(engine, emu, tokenizer, 3)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict = {}
    port = free_port()

    def run() -> None:
        asyncio.set_event_loop(loop)
        urls = loop.run_until_complete(fleet.start("127.0.0.1", 0))
        roles = ["prefill", "decode", "decode"]
        (tmp / "endpoints.yaml").write_text(
            yaml.safe_dump(
                [
                    {"url": u, "labels": {"llm-d.ai/role": r}}
                    for u, r in zip(urls, roles, strict=True)
                ]
            )
        )
        (tmp / "epp.yaml").write_text(PD_CONFIG)
        config = RouterConfig(
            endpoints_file=str(tmp / "endpoints.yaml"),
            scheduler_config=str(tmp / "epp.yaml"),
            kv_events=None,
        )
        router = Router(config, tokenizer)
        state["runner"] = loop.run_until_complete(start_router(router, "127.0.0.1", port))
        state.update(router=router, urls=urls)
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(60)
    if prefill_faults:
        http(state["urls"][0] + "/admin/faults", prefill_faults)
    try:
        yield f"http://127.0.0.1:{port}", state["router"], fleet, state["urls"]
    finally:
        asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(timeout=30)
        asyncio.run_coroutine_threadsafe(fleet.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def served(fleet, i: int) -> int:
    return fleet.bundles[i].faults.num_requests


def test_long_uncached_prompt_is_prefilled_remotely_then_decoded(tokenizer):
    with pd_stack(tokenizer) as (url, router, fleet, urls):
        prompt = "The repository layout is as follows. " * 60  # ~480 tokens, none cached
        code, headers, raw = http(
            url + "/v1/completions", {"prompt": prompt, "max_tokens": 8, "ignore_eos": True}
        )
        body = json.loads(raw)
        assert code == 200 and headers["x-kvmesh-endpoint"] in urls[1:]
        assert served(fleet, 0) == 1  # the prefill engine ran the one-token prefill
        n = body["usage"]["prompt_tokens"]
        # the decode engine imported the prefill's blocks: they count as cached prompt tokens
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
        assert body["usage"]["completion_tokens"] == 8
        assert not fleet.bundles[0].engine.core.held.held  # read and released
        # the next turn extends the context: mostly cached on its decode engine, no P/D
        code, headers2, _ = http(
            url + "/v1/completions", {"prompt": prompt + " And one more file.", "max_tokens": 4}
        )
        assert code == 200 and headers2["x-kvmesh-endpoint"] == headers["x-kvmesh-endpoint"]
        assert served(fleet, 0) == 1


def test_short_prompt_skips_prefill(tokenizer):
    with pd_stack(tokenizer) as (url, router, fleet, urls):
        code, headers, _ = http(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert code == 200 and headers["x-kvmesh-endpoint"] in urls[1:]
        assert served(fleet, 0) == 0


def test_prefill_failure_falls_back_to_decode_side_prefill(tokenizer):
    with pd_stack(tokenizer, prefill_faults={"error_rate": 1.0}) as (url, router, fleet, urls):
        prompt = "Another long and uncached context. " * 60
        code, headers, raw = http(
            url + "/v1/completions", {"prompt": prompt, "max_tokens": 4, "stream": True}
        )
        assert code == 200 and raw.endswith(b"data: [DONE]\n\n")
        assert headers["x-kvmesh-endpoint"] in urls[1:]
        text = http(url + "/metrics")[2].decode()
        assert 'outcome="prefill_failed"' in text
