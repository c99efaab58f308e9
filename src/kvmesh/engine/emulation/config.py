"""The emulated engines' settings (`--emulate-*`, `--fault-*`), apart from the builder so that
`kvmesh serve --help` and `kvmesh up --help` read them without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.engine.emulation.latency import (
    ACCELERATORS,
    MODELS,
    ConstantLatency,
    LatencyModel,
    RooflineLatency,
)

if TYPE_CHECKING:
    from kvmesh.engine.emulation.faults import FaultConfig

# GLM-5-class MTP, conditional per draft position (the last repeats past it); fitted to the
# llm-d GLM-5.2 guide's ~60 vs ~26 output tok/s per user with and without MTP 3 (the guide
# gives no acceptance rate): 1 + 0.8 + 0.8*0.7 + 0.8*0.7*0.6 = 2.70 tokens per step.
DEFAULT_ACCEPTANCE = (0.8, 0.7, 0.6)


def parse_acceptance(text: str) -> tuple[float, ...]:
    """'0.8,0.7,0.6' -> conditional acceptance per draft position, each in [0, 1]."""
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--emulate-spec-acceptance: not a list of numbers: {text!r}") from None
    if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"--emulate-spec-acceptance: rates in [0, 1], comma-separated: {text!r}")
    return rates


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
        from kvmesh.engine.emulation.faults import FaultConfig  # aiohttp: only when built

        return FaultConfig(
            error_rate=self.fault_error_rate,
            hang_rate=self.fault_hang_rate,
            crash_after=self.fault_crash_after,
            slowdown=self.fault_slowdown,
            stall_rate=self.fault_stall_rate,
            stall_seconds=self.fault_stall_seconds,
            drop_events_rate=self.fault_drop_events_rate,
        )
