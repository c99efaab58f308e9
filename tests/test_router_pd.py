"""Selective P/D through the router: the disagg profile handler, vLLM's NixlConnector protocol
between emulated engines, the threshold, and the fallback when prefill fails."""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from pathlib import Path

import yaml

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.emulation.builder import EmulationConfig
from kvmesh.engine.emulation.host import EmulatedFleet
from kvmesh.router.app import Router, RouterConfig, start_router
from tests.helpers import bound_port, http, loop_thread

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
        admin_api_key="admin-secret",  # for /admin/faults
    )
    emu = EmulationConfig(emulate_ttft_ms=30.0, emulate_itl_ms=5.0)
    fleet = EmulatedFleet(engine, emu, tokenizer, 3)

    async def start() -> tuple:
        urls = await fleet.start("127.0.0.1", 0)
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
        return router, await start_router(router, "127.0.0.1", 0), urls

    async def stop(state: tuple) -> None:
        await state[1].cleanup()
        await fleet.stop()

    with loop_thread(start, stop) as ((router, server, urls), _loop):
        if prefill_faults:
            auth = {"Authorization": "Bearer admin-secret"}
            assert http(urls[0] + "/admin/faults", prefill_faults, auth)[0] == 200
        yield f"http://127.0.0.1:{bound_port(server)}", router, fleet, urls


def settled_loads(router, timeout: float = 5.0) -> list[tuple[int, int]]:
    """Each endpoint's (in flight, pending prefill) once the router has released its forwards
    (the client can have the last byte just before the router's task ends)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = [(e.in_flight, e.pending_prefill_tokens) for e in router.pool.endpoints.values()]
        if not any(f or p for f, p in loads) or time.monotonic() > deadline:
            return loads
        time.sleep(0.01)


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


def test_the_decode_endpoint_is_charged_while_the_prefill_leg_runs(tokenizer, monkeypatch):
    """Picks made while a prefill leg runs see the request its decode endpoint will decode, so
    a burst of long prompts does not all pick the same idle decode endpoint; it is charged no
    prefill (its prompt's KV comes from the prefill endpoint) and released at the end."""
    from kvmesh.router import handlers

    seen = []
    real = handlers.prefill_remotely

    async def watched(router, path, body, req, p):
        decode = {e.name: e for e in router.pool.endpoints.values() if e is not p}
        seen.append({n: (e.in_flight, e.pending_prefill_tokens) for n, e in decode.items()})
        return await real(router, path, body, req, p)

    monkeypatch.setattr(handlers, "prefill_remotely", watched)
    with pd_stack(tokenizer) as (url, router, fleet, urls):
        prompt = "The repository layout is as follows. " * 60
        code, headers, _ = http(url + "/v1/completions", {"prompt": prompt, "max_tokens": 4})
        assert code == 200 and served(fleet, 0) == 1
        (during,) = seen
        chosen = headers["x-kvmesh-endpoint"]
        assert during[chosen] == (1, 0)
        assert all(v == (0, 0) for n, v in during.items() if n != chosen)
        assert settled_loads(router) == [(0, 0)] * 3


def test_a_failed_prefill_leaves_no_load_behind(tokenizer):
    with pd_stack(tokenizer, prefill_faults={"error_rate": 1.0}) as (url, router, fleet, urls):
        prompt = "Another long and uncached context. " * 60
        assert http(url + "/v1/completions", {"prompt": prompt, "max_tokens": 4})[0] == 200
        assert settled_loads(router) == [(0, 0)] * 3
