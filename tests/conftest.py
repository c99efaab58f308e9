"""Shared fixtures: the real SmolLM2 model loaded once, and engine servers on loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M, loaded on every core; the thread count it found is kept, so
    loading it inside a module on one_thread leaves that module on one thread."""
    import torch

    from kvmesh.engine.models.loader import load_model

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    try:
        return load_model(None, device="cpu", dtype=torch.float32)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one intra-op thread from the first test of a module that asks for it (or every
    test: `pytestmark = pytest.mark.usefixtures("one_thread")`, which also covers the module's
    own fixtures) to the module's end. On a shared 2-core box a second thread waiting for a busy
    core stalls every small op of small-batch steps (SmolLM2 engine runs took 6-13x as long with
    two on a loaded host), and tiny models run faster and the same on a busy host."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_smollm2():
    """HF transformers' SmolLM2 from the embedded GGUF (HF dequantises it independently of our
    loader): the reference of test_engine_hf and test_model_hf, read once for both."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvmesh.engine.tokenizer import default_gguf_path

    # SmolLM2's published shape, given here so HF reads the big GGUF once (weights only)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    path = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    ).eval()


@contextlib.contextmanager
def engine_server(loaded, **config_kw):
    """Run a real engine server (HTTP on loopback) on its own event-loop thread."""
    from kvmesh.engine.builder import assemble
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.server import start_server
    from kvmesh.engine.torch_runner import TorchRunner

    config_kw.setdefault("num_gpu_blocks", 256)
    config_kw.setdefault("max_model_len", 2048)
    config = EngineConfig(**config_kw)
    runner = TorchRunner(config, loaded)
    bundle = assemble(
        config,
        runner,
        loaded.tokenizer,
        loaded.name,
        str(loaded.path),
        tuple(loaded.config.eos_token_ids),
    )
    loop = asyncio.new_event_loop()
    started = threading.Event()
    state: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        state["runner"] = loop.run_until_complete(start_server(bundle, "127.0.0.1", 0))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60), "server did not start"
    port = state["runner"].addresses[0][1]  # bound on port 0: no pick-then-bind race
    try:
        yield f"http://127.0.0.1:{port}", bundle
    finally:
        fut = asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop)
        fut.result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def tokenizer():
    from kvmesh.engine.tokenizer import load_tokenizer

    return load_tokenizer(None)[0]


@contextlib.contextmanager
def emulated_fleet(tokenizer, count: int = 1, engine: dict | None = None, **emu):
    """Emulated engines on loopback, served from their own event-loop thread."""
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.emulation.builder import EmulationConfig
    from kvmesh.engine.emulation.host import EmulatedFleet

    emu.setdefault("emulate_ttft_ms", 20.0)
    emu.setdefault("emulate_itl_ms", 5.0)
    fleet = EmulatedFleet(EngineConfig(**(engine or {})), EmulationConfig(**emu), tokenizer, count)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    urls: list[str] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        urls.extend(loop.run_until_complete(fleet.start("127.0.0.1", 0)))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "emulated fleet did not start"
    try:
        yield urls, fleet
    finally:
        asyncio.run_coroutine_threadsafe(fleet.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
