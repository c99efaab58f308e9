"""Builds emulated engines: the real engine core around an EmulatedRunner, with faults."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvmesh.engine.builder import EngineBundle, assemble
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.emulation.faults import FaultConfig, FaultInjector
from kvmesh.engine.emulation.latency import (
    ACCELERATORS,
    MODELS,
    ConstantLatency,
    LatencyModel,
    RooflineLatency,
)
from kvmesh.engine.emulation.runner import EmulatedRunner
from kvmesh.engine.emulation.spec import DEFAULT_ACCEPTANCE, parse_acceptance
from kvmesh.engine.emulation.timing import PredictedTiming


@dataclass(slots=True)
class EmulationConfig:
    emulate_gpu: str = "h100"
    emulate_model: str = "llama-3.1-8b"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    step_overhead_ms: float = 2.0
    emulate_ttft_ms: float | None = None  # constant mode: first-token step time ...
    emulate_itl_ms: float | None = None  # ... and every other step's time
    emulate_time_scale: float = 1.0  # wall seconds per emulated second (slow motion)
    fault_error_rate: float = 0.0
    fault_hang_rate: float = 0.0
    fault_crash_after: int = 0
    fault_slowdown: float = 1.0
    fault_stall_rate: float = 0.0
    fault_stall_seconds: float = 5.0
    fault_drop_events_rate: float = 0.0
    # with --speculative-config (mtp, eagle, draft_model): the chance each draft position is
    # accepted given the ones before it were, the last repeating (GLM-5-class MTP by default)
    emulate_spec_acceptance: str = ",".join(str(r) for r in DEFAULT_ACCEPTANCE)

    def __post_init__(self) -> None:
        parse_acceptance(self.emulate_spec_acceptance)
        if self.emulate_gpu not in ACCELERATORS:
            raise ValueError(f"--emulate-gpu must be one of {sorted(ACCELERATORS)}")
        if self.emulate_model not in MODELS:
            raise ValueError(f"--emulate-model must be one of {sorted(MODELS)}")
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be at least 1")
        if not self.emulate_time_scale > 0:
            raise ValueError("--emulate-time-scale must be positive")
        if (self.emulate_ttft_ms is None) != (self.emulate_itl_ms is None):
            raise ValueError("--emulate-ttft-ms and --emulate-itl-ms go together")

    def latency_model(self) -> LatencyModel:
        if self.emulate_ttft_ms is not None and self.emulate_itl_ms is not None:
            return ConstantLatency(self.emulate_ttft_ms / 1e3, self.emulate_itl_ms / 1e3)
        return RooflineLatency(
            ACCELERATORS[self.emulate_gpu],
            MODELS[self.emulate_model],
            self.tensor_parallel_size,
            self.step_overhead_ms / 1e3,
            self.gpu_memory_utilization,
        )

    def fault_config(self) -> FaultConfig:
        return FaultConfig(
            error_rate=self.fault_error_rate,
            hang_rate=self.fault_hang_rate,
            crash_after=self.fault_crash_after,
            slowdown=self.fault_slowdown,
            stall_rate=self.fault_stall_rate,
            stall_seconds=self.fault_stall_seconds,
            drop_events_rate=self.fault_drop_events_rate,
        )


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
