"""Peer sharing through the router: two real SmolLM2 engines, the router forced to place a request
on the engine that lacks its prefix; with --kv-peer-min-cached-token-delta it names the holder and
the engine pulls the blocks (same output as the holder's), without it nothing is named."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kvmesh.router.app import Router, RouterConfig, start_router
from tests.conftest import engine_server
from tests.helpers import bound_port, http, loop_thread

# every request goes to the engine labelled "b", whatever the other holds
ONLY_B = """
plugins:
- {type: label-selector-filter, name: only-b, parameters: {matchLabels: {role: b}}}
- {type: precise-prefix-cache-scorer, name: prefix}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: only-b}, {pluginRef: prefix, weight: 1}]
"""
SENTENCE = "The lighthouse keeper logged every ship that passed the {} reef after midnight. "


def events_config(folder: Path, name: str) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"ipc://{folder}/{name}-kv",
            "replay_endpoint": f"ipc://{folder}/{name}-replay",
        }
    )


@contextlib.contextmanager
def running_router(config: RouterConfig, tokenizer):

    async def start() -> tuple:
        router = Router(config, tokenizer)
        return router, await start_router(router, "127.0.0.1", 0)

    async def stop(state: tuple) -> None:
        await state[1].cleanup()

    with loop_thread(start, stop) as ((router, server), _loop):
        yield f"http://127.0.0.1:{bound_port(server)}", router


@pytest.fixture(scope="module")
def fleet(smollm2, tmp_path_factory):
    folder = tmp_path_factory.mktemp("peer-router")
    with engine_server(smollm2, kv_events_config=events_config(folder, "a")) as (a_url, a):
        allow = urlsplit(a_url).netloc
        with engine_server(
            smollm2, kv_events_config=events_config(folder, "b"), kv_peer_allowlist=allow
        ) as (b_url, b):
            endpoints = folder / "endpoints.yaml"
            endpoints.write_text(
                json.dumps(
                    [
                        {"url": a_url, "labels": {"role": "a"}},
                        {"url": b_url, "labels": {"role": "b"}},
                    ]
                )
            )
            scheduler = folder / "only-b.yaml"
            scheduler.write_text(ONLY_B)
            yield a_url, a, b_url, b, str(endpoints), str(scheduler)


def complete(url: str, text: str) -> dict:
    body = {"prompt": text, "max_tokens": 8, "temperature": 0}
    code, _, raw = http(url + "/v1/completions", body)
    assert code == 200, raw
    return json.loads(raw)


def pulls(bundle) -> dict[str, float]:
    m = bundle.metrics
    return {
        o: m.peer_pulls.labels(**m.labels, outcome=o)._value.get()
        for o in ("ok", "miss", "failed", "refused")
    }


def subscribed(router: Router, a_url: str) -> None:
    """Until the router receives engine A's KV events (a SUB socket misses what was published
    before it joined, so probe with fresh prompts until one is indexed)."""
    deadline = time.time() + 30
    while len(router.events.tasks) < 2 and time.time() < deadline:
        time.sleep(0.05)
    for probe in range(200):
        complete(a_url, f"Probe {probe}: " + "a short warm-up sentence for the index. " * 3)
        if router.precise_index.num_entries() > 0:
            return
        time.sleep(0.1)
    raise AssertionError("the router never received engine A's KV events")


def wait_indexed(router: Router, text: str, a_url: str) -> None:
    """Until the router's precise index holds the prompt's blocks at engine A."""
    body = json.dumps({"prompt": text}).encode()
    keys = router.scheduling_request(body, "/v1/completions", {}).block_keys
    deadline = time.time() + 20
    while time.time() < deadline:
        if router.precise_index.longest_match(keys, [a_url]).get(a_url, 0) >= len(keys):
            return
        time.sleep(0.05)
    raise AssertionError("the router never learnt what engine A caches")


def config(endpoints: str, scheduler: str, delta: int) -> RouterConfig:
    return RouterConfig(
        endpoints_file=endpoints,
        scheduler_config=scheduler,
        scrape_interval=0.05,
        kv_peer_min_cached_token_delta=delta,
    )


def test_router_names_the_holder_and_the_engine_pulls_from_it(fleet, smollm2):
    a_url, a, b_url, b, endpoints, scheduler = fleet
    text = SENTENCE.format("northern") * 8
    with running_router(config(endpoints, scheduler, 64), smollm2.tokenizer) as (url, router):
        subscribed(router, a_url)
        held = complete(a_url, text)  # engine A computes and caches the prompt
        wait_indexed(router, text, a_url)
        before = pulls(b)
        out = complete(url, text)
        assert out["choices"][0]["text"] == held["choices"][0]["text"]
        tokens = out["usage"]["prompt_tokens"]
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == (tokens - 1) // 16 * 16
        assert pulls(b)["ok"] == before["ok"] + 1
        counter = router.metrics.peer_sourced.labels(a_url)._value
        deadline = time.monotonic() + 10  # counted on the router's loop, maybe after the reply
        while counter.get() < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert counter.get() == 1 and router.metrics.peer_lead_tokens.value >= 64
        b.engine.core.kv.pool.check_invariants()


def test_no_source_is_named_when_off_or_when_the_lead_is_short(fleet, smollm2):
    a_url, a, b_url, b, endpoints, scheduler = fleet
    off, short = SENTENCE.format("southern") * 8, SENTENCE.format("eastern") * 8
    with running_router(config(endpoints, scheduler, 0), smollm2.tokenizer) as (url, router):
        subscribed(router, a_url)
        complete(a_url, off)
        wait_indexed(router, off, a_url)
        before = pulls(b)
        out = complete(url, off)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert pulls(b) == before  # no source named: nothing pulled, nothing refused
    with running_router(config(endpoints, scheduler, 4096), smollm2.tokenizer) as (url, router):
        subscribed(router, a_url)
        complete(a_url, short)
        wait_indexed(router, short, a_url)
        before = pulls(b)
        complete(url, short)
        assert pulls(b) == before
        assert not router.metrics.peer_sourced._metrics


def test_negative_threshold_is_refused():
    with pytest.raises(ValueError, match="kv-peer-min-cached-token-delta"):
        RouterConfig(kv_peer_min_cached_token_delta=-1)
