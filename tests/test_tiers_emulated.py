"""Offload tiers on an emulated engine: the same bookkeeping as the real engine, with loads
taking the host link's modelled time: on the engine clock while the request waits (async), or
charged to the next step (sync)."""

from __future__ import annotations

import json

import pytest

from kvmesh.engine.emulation.runner import PCIE_BANDWIDTH
from tests.conftest import emulated_fleet
from tests.helpers import http


def complete(url: str, prompt: str) -> dict:
    code, _, raw = http(url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert code == 200, raw
    return json.loads(raw)


@pytest.mark.parametrize("async_loads", [True, False])
def test_emulated_engine_reloads_an_evicted_prefix_from_host(tokenizer, async_loads):
    engine = {"num_gpu_blocks": 64, "kv_offloading_size": 1.0, "kv_offloading_async": async_loads}
    emu = {"emulate_ttft_ms": None, "emulate_itl_ms": None}
    with emulated_fleet(tokenizer, engine=engine, **emu) as (urls, fleet):
        url, bundle = urls[0], fleet.bundles[0]
        prompt = "the agent reads the repository and plans the change " * 60
        first = complete(url, prompt)
        complete(url, "unrelated words about weather and tides and boats " * 90)  # evicts it
        again = complete(url, prompt)
        n = again["usage"]["prompt_tokens"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
        kv, runner = bundle.engine.core.kv, bundle.engine.core.runner
        cpu = kv.offloader.tiers[0]
        assert cpu.hit_blocks > 0, "the prefix did not come from the host tier"
        expected = cpu.hit_blocks * runner.kv_bytes_per_block / PCIE_BANDWIDTH
        assert abs(runner.modelled_loads["CPU"] - expected) < 1e-9
        kv.pool.check_invariants()
        kv.offloader.check_invariants()
        if async_loads:  # the load ran on the modelled copy link, not inside a step
            assert kv.loads.num_loaded_blocks == cpu.hit_blocks
            assert runner.clock >= expected
