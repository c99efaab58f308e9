"""Builds emulated engines: the real engine core around an EmulatedRunner, with faults."""

from __future__ import annotations

from dataclasses import replace

from kvmesh.engine.builder import EngineBundle, assemble
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.emulation.config import EmulationConfig, parse_acceptance
from kvmesh.engine.emulation.faults import FaultInjector
from kvmesh.engine.emulation.latency import ACCELERATORS, MODELS, LatencyModel
from kvmesh.engine.emulation.runner import EmulatedRunner
from kvmesh.engine.emulation.timing import PredictedTiming


def with_vllm_batch_defaults(config: EngineConfig, emu: EmulationConfig) -> EngineConfig:
    """The batch limits vLLM's API server picks for the emulated card, where the flags were left
    at kvmesh's own defaults (sized for a CPU): 8,192 batched tokens and 1,024 sequences on cards
    with at least 70 GiB other than the A100, else 2,048 and 256. (An explicit flag equal to
    kvmesh's default is indistinguishable from none.)"""
    if emu.emulate_ttft_ms is not None:  # constant mode: a test's engine, keep what it asked
        return config
    base, gpu = EngineConfig(), ACCELERATORS[emu.emulate_gpu]  # vLLM asks the device its memory
    large = gpu.memory_bytes >= 70 * 2**30 and emu.emulate_gpu not in ("a100", "cpu")
    tokens, seqs = (8192, 1024) if large else (2048, 256)
    changes = {}
    if config.max_num_batched_tokens == base.max_num_batched_tokens:
        changes["max_num_batched_tokens"] = tokens
    if config.max_num_seqs == base.max_num_seqs:
        changes["max_num_seqs"] = seqs
    return replace(config, **changes) if changes else config


def build_emulated_engine(
    config: EngineConfig,
    emu: EmulationConfig,
    tokenizer,
    tokenizer_name: str = "tokenizer",
    latency: LatencyModel | None = None,
    engine_index: int = 0,
) -> EngineBundle:
    """`latency` replaces the one `emu` names (a lockstep rank's clock, say); the KV cache
    takes what it leaves of the card, unless --num-gpu-blocks says otherwise. The engine's
    draft acceptance draws from an RNG seeded by --seed, its DP rank and `engine_index`."""
    config = with_vllm_batch_defaults(config, emu)
    latency = latency or emu.latency_model()
    spec = MODELS[emu.emulate_model]
    capacity = latency.kv_capacity_bytes()
    if config.num_gpu_blocks is not None:
        num_blocks = config.num_gpu_blocks
    elif capacity is not None:
        per_block = spec.kv_bytes_per_token * config.block_size
        num_blocks = int(capacity // per_block)
    else:
        num_blocks = 8192
    max_len = min(config.max_model_len or spec.max_model_len, spec.max_model_len)
    faults = FaultInjector(emu.fault_config())
    runner = EmulatedRunner(latency, num_blocks, config.block_size, max_len, tokenizer)
    runner.faults = faults
    runner.spec_acceptance = parse_acceptance(emu.emulate_spec_acceptance)
    runner.spec_seed = (config.seed, config.data_parallel_rank, engine_index)
    runner.model_config.num_nextn_predict_layers = spec.num_nextn_predict_layers  # any mode
    name = config.served_model_name or spec.name
    bundle = assemble(
        config, runner, tokenizer, name, f"emulated:{emu.emulate_gpu}", tuple(_eos_ids(tokenizer))
    )
    if hasattr(bundle.publisher, "drop_on_send"):  # dropped after numbering: a seen gap
        bundle.publisher.drop_on_send = faults.drop_events
    bundle.faults = faults
    timing = PredictedTiming(time_scale=emu.emulate_time_scale)
    bundle.engine.time_scale = emu.emulate_time_scale
    timing.timeline_restarts = lambda: bundle.engine.timeline_restarts
    bundle.engine.core.step_observer = timing.observe
    faults.timing = timing  # served on /admin/timing beside the fault settings
    return bundle


def _eos_ids(tokenizer) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else []
