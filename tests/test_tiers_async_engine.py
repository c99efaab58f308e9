"""Asynchronous tier loads on the real SmolLM2 engine, stepped by hand: while one request's
prefix loads from the disk tier (its copy held at a gate on the copy worker), a running request
keeps producing tokens; the loaded request's greedy output equals a recomputed one; an abort
mid-load leaks no device block and no tier reference."""

from __future__ import annotations

import threading

import pytest

from kvmesh.engine.sequence import Request, RequestStatus, SamplingParams
from tests.test_tiers_engine import FILLER, PROMPT

PER_BLOCK = 2 * 16 * 3 * 64 * 30 * 4  # SmolLM2-135M, float32, 16-token blocks


pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread: conftest


@pytest.fixture
def engine(smollm2, tmp_path):
    from kvmesh.engine.builder import assemble
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.torch_runner import TorchRunner

    config = EngineConfig(
        num_gpu_blocks=24,
        max_model_len=320,
        kv_offloading_size=8 * PER_BLOCK / 2**30,  # 8 blocks: the filler spills PROMPT to disk
        kv_offloading_disk_path=str(tmp_path),
        kv_offloading_disk_size=0.1,
    )
    runner = TorchRunner(config, smollm2)
    eos = tuple(smollm2.config.eos_token_ids)
    bundle = assemble(config, runner, smollm2.tokenizer, "smollm2", str(smollm2.path), eos)
    gate = threading.Event()
    gate.set()
    copy_from_tier = runner.copy_from_tier

    def gated(medium, slots, block_ids) -> None:  # runs on the copy worker only (async)
        assert threading.current_thread().name == "kvmesh-kv-load"
        assert gate.wait(60), "the test never opened the gate"
        copy_from_tier(medium, slots, block_ids)

    runner.copy_from_tier = gated
    yield bundle.engine.core, gate
    gate.set()
    bundle.close()


def request(core, rid: str, text: str, max_tokens: int, salt: str | None = None) -> Request:
    ids = core.tokenizer.encode(text)
    req = Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    req.cache_salt = salt
    core.add_request(req)
    return req


def run_to_end(core) -> None:
    for _ in range(500):
        if not core.has_work():
            return
        core.step()
    raise AssertionError("the engine did not finish")


def load_prompt_to_disk(core) -> list[int]:
    """PROMPT computed (the reference output, salted so it is not cached), computed again
    (cached, spilled to disk by the filler), and evicted from the device and host tier."""
    reference = request(core, "reference", PROMPT, 8, salt="computed")
    run_to_end(core)
    request(core, "first", PROMPT, 1)
    run_to_end(core)
    request(core, "filler", FILLER, 1)
    run_to_end(core)
    cpu, disk = core.kv.offloader.tiers
    assert disk.stored_blocks > 0 and core.kv.pool.num_evictions > 0
    return reference.output_token_ids


def test_a_running_request_decodes_while_a_prefix_loads_from_disk(engine):
    core, gate = engine
    reference = load_prompt_to_disk(core)
    decoder = request(core, "decoder", "Count the boats in the harbour:", 30)
    core.step()
    assert decoder.num_output_tokens == 1
    gate.clear()  # the next copy waits on the worker until the test opens the gate
    loader = request(core, "loader", PROMPT, 8)
    core.step()  # starts the load, and decodes
    assert decoder.num_output_tokens == 2
    assert loader.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert core.kv.loads.jobs, "no load was started"
    for n in range(3, 8):  # steps while the copy is held: the decoder keeps producing tokens
        core.step()
        assert decoder.num_output_tokens == n
        assert loader.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    core.kv.loads.check_invariants()
    gate.set()
    run_to_end(core)
    assert loader.output_token_ids == reference
    disk = core.kv.offloader.tiers[1]
    assert disk.hit_blocks > 0, "the prefix did not come from the disk tier"
    assert loader.num_cached_tokens >= 5 * 16
    core.kv.pool.check_invariants()
    core.kv.offloader.check_invariants()
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks


def test_abort_mid_load_leaks_nothing(engine):
    core, gate = engine
    load_prompt_to_disk(core)
    gate.clear()
    loader = request(core, "loader", PROMPT, 8)
    core.step()
    assert loader.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    out = core.abort_request("loader")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert core.kv.loads.jobs, "the copy is still running: its blocks stay held"
    assert core.has_work(), "the engine must step until the copy ends, to free its blocks"
    gate.set()
    run_to_end(core)
    core.kv.pool.check_invariants()
    core.kv.offloader.check_invariants()
    core.kv.loads.check_invariants()
    assert not core.kv.loads.jobs and not core.kv.loads.held
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
