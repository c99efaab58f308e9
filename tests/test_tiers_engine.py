"""Offload tiers on the real SmolLM2 engine: a prefix pushed out of a tiny device cache comes
back from the host tier or the disk tier, and greedy output is the same as when it is computed,
whether the load runs on the copy worker (async, the default) or inside the step (sync)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import engine_server
from tests.helpers import http

STORY = (
    "The lighthouse keeper wrote down every ship that passed, its flag, its cargo and the hour, "
    "in a ledger that had grown to forty volumes by the winter the lamp went dark. "
)
PROMPT = STORY * 3  # about 110 tokens: 6 full blocks
FILLER = "Rain fell on the harbour and the nets lay drying on the stones all afternoon. " * 18
TINY = {"num_gpu_blocks": 20, "max_model_len": 320, "block_size": 16}


pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread: conftest


def complete(url: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    code, _, raw = http(url + "/v1/completions", body)
    assert code == 200, raw
    return json.loads(raw)


def metric(url: str, name: str, medium: str) -> float:
    _, _, raw = http(url + "/metrics")
    for line in raw.decode().splitlines():
        if line.startswith(name + "{") and f'medium="{medium}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def evict_then_reuse(url: str, bundle) -> tuple[str, str, int]:
    """(reference text, text with the prefix from the tiers, tokens served as cached)."""
    reference = complete(url, PROMPT, cache_salt="computed")["choices"][0]["text"]
    first = complete(url, PROMPT)["choices"][0]["text"]
    assert first == reference
    complete(url, FILLER)  # needs most of the device blocks: PROMPT's blocks are evicted
    kv = bundle.engine.core.kv
    assert bundle.engine.core.kv.pool.num_evictions > 0
    again = complete(url, PROMPT)
    kv.pool.check_invariants()
    kv.offloader.check_invariants()
    if kv.loads is not None:
        kv.loads.check_invariants()
        assert kv.loads.num_loaded_blocks > 0, "the async path was not taken"
    return (
        reference,
        again["choices"][0]["text"],
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
    )


@pytest.mark.parametrize("async_loads", [True, False])
def test_prefix_from_host_tier_gives_identical_output(smollm2, async_loads):
    with engine_server(
        smollm2, kv_offloading_size=0.05, kv_offloading_async=async_loads, **TINY
    ) as (url, bundle):
        cpu = bundle.engine.core.kv.offloader.tiers[0]
        assert (bundle.engine.core.kv.loads is not None) == async_loads
        reference, text, cached = evict_then_reuse(url, bundle)
        assert text == reference
        assert cached >= 5 * 16
        assert cpu.hit_blocks > 0, "the host tier was not used"
        assert metric(url, "kvmesh:kv_offload_hits_total", "CPU") == cpu.hit_blocks * 16
        assert metric(url, "kvmesh:kv_offload_bytes_total", "CPU") > 0
        assert 0 < metric(url, "kvmesh:kv_offload_usage_perc", "CPU") <= 1
        assert bundle.metrics.offload_copy_seconds._value.get() > 0  # CPU copies are timed


@pytest.mark.parametrize("async_loads", [True, False])
def test_prefix_from_disk_tier_gives_identical_output(smollm2, tmp_path, async_loads):
    # a host tier of 8 blocks: the filler's write-through spills PROMPT's blocks to disk
    per_block = 2 * 16 * 3 * 64 * 30 * 4
    size = 8 * per_block / 2**30
    with engine_server(
        smollm2,
        kv_offloading_size=size,
        kv_offloading_disk_path=str(tmp_path),
        kv_offloading_disk_size=0.1,
        kv_offloading_async=async_loads,
        **TINY,
    ) as (url, bundle):
        cpu, disk = bundle.engine.core.kv.offloader.tiers
        assert cpu.num_slots == 8 and disk.medium == "DISK"
        reference, text, cached = evict_then_reuse(url, bundle)
        assert text == reference
        assert cached >= 5 * 16
        assert disk.stored_blocks > 0 and disk.hit_blocks > 0, "the disk tier was not used"
        assert metric(url, "kvmesh:kv_offload_hits_total", "DISK") == disk.hit_blocks * 16
        assert list(tmp_path.iterdir()), "no disk tier file"


def test_offloading_connector_config_sizes_the_host_tier(smollm2):
    cfg = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 10 * 2 * 16 * 3 * 64 * 30 * 4},
    }
    with engine_server(smollm2, kv_transfer_config=json.dumps(cfg), **TINY) as (url, bundle):
        (cpu,) = bundle.engine.core.kv.offloader.tiers
        assert cpu.medium == "CPU" and cpu.num_slots == 10


@pytest.mark.parametrize("flag", [{"kv_offloading_size": 0}, {"kv_offloading_size": -1.0}])
def test_bad_sizes_are_refused(flag):
    from kvmesh.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv-offloading-size"):
        EngineConfig(**flag)
