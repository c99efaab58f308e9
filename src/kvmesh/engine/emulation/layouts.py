"""Serving layouts of an emulated MoE instance, as `kvmesh bench ep` and `kvmesh sim --layout`
name them: tpN (one replica over N GPUs of a node, TensorParallelRoofline) or dpN (DP attention +
expert parallelism over N GPUs, N ranks, WideEPRoofline), and the roofline that prices a step of
one instance of the layout."""

from __future__ import annotations

import re

from kvmesh.engine.emulation.expert_load import ExpertRouting
from kvmesh.engine.emulation.instance_roofline import InstanceRoofline
from kvmesh.engine.emulation.latency import ACCELERATORS, MODELS
from kvmesh.engine.emulation.wide_ep import TensorParallelRoofline, WideEPRoofline

LAYOUT_RE = re.compile(r"^(tp|dp)(\d+)$")


def parse_layout(text: str) -> tuple[str, int]:
    """'dp16' -> ('dp', 16): the kind and the GPUs of one instance."""
    match = LAYOUT_RE.match(text.strip().lower())
    if not match or int(match.group(2)) < 1:
        raise ValueError(f"a layout is tpN or dpN, got {text!r}")
    return match.group(1), int(match.group(2))


def layout_name(kind: str, n: int) -> str:
    return f"TP{n}" if kind == "tp" else f"DP{n}/EP{n}"


def build_roofline(
    kind: str,
    n: int,
    gpu: str,
    model: str,
    *,
    routing: ExpertRouting | None = None,
    step_overhead_ms: float = 2.0,
    gpu_memory_utilization: float = 0.9,
    placement: str = "linear",
    enable_dbo: bool = False,
    all2all_backend: str = "deepep_low_latency",
) -> InstanceRoofline:
    """The roofline of one `kind`N instance of emulated `model` on emulated `gpu` (names as
    --emulate-gpu / --emulate-model take them). Raises ValueError for an unknown name, a dense
    model, or a model that does not fit the layout's memory."""
    if gpu not in ACCELERATORS:
        raise ValueError(f"--emulate-gpu must be one of {sorted(ACCELERATORS)}, got {gpu!r}")
    if model not in MODELS:
        raise ValueError(f"--emulate-model must be one of {sorted(MODELS)}, got {model!r}")
    spec = MODELS[model]
    if not spec.num_experts:
        moe = sorted(k for k, m in MODELS.items() if m.num_experts)
        raise ValueError(
            f"layout {kind}{n} needs an MoE model ({', '.join(moe)}); {model} is dense"
        )
    common = {
        "routing": routing or ExpertRouting(),
        "step_overhead": step_overhead_ms / 1e3,
        "gpu_memory_utilization": gpu_memory_utilization,
    }
    if kind == "tp":
        return TensorParallelRoofline(ACCELERATORS[gpu], spec, n, **common)
    return WideEPRoofline(
        ACCELERATORS[gpu],
        spec,
        n,
        placement=placement,
        enable_dbo=enable_dbo,
        all2all_backend=all2all_backend,
        **common,
    )
