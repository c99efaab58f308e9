"""Step-time models for emulated engines: a roofline of a named accelerator and model.

A step's time is the larger of its compute time (FLOPs of the scheduled tokens, attention over
the cached context included) and its memory time (weights read once per step, plus the KV cache
read for every sequence), divided across tensor-parallel ranks, plus the all-reduce cost of TP and
a fixed per-step overhead. Sources of the figures are noted on each preset.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from kvmesh.engine.emulation.work import SequenceWork, draft_time


@dataclass(frozen=True, slots=True)
class AcceleratorSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bandwidth: float  # bytes/s
    memory_bytes: float
    interconnect_bandwidth: float  # bytes/s per direction between TP ranks
    mfu: float = 0.55  # attainable fraction of peak FLOPs in large GEMMs
    mbu: float = 0.80  # attainable fraction of peak memory bandwidth
    source: str = ""
    fp8_flops: float = 0.0  # dense fp8 FLOP/s (0: no fp8 tensor cores; GEMMs run at peak_flops)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    total_params: float
    active_params: float  # per token (== total for dense models)
    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    kv_bytes_per_token: int  # all layers, K and V (or the MLA latent), at bytes_per_param
    bytes_per_param: float = 2.0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: float = 0.0  # parameters in routed experts (all of them)
    max_model_len: int = 131072
    source: str = ""
    num_dense_layers: int = 0  # leading layers with a dense FFN instead of routed experts
    attention: str = "gqa"  # "mla": one latent KV head, so every TP rank holds all of the KV
    num_nextn_predict_layers: int = 0  # MTP layers shipped with the model (method "mtp")

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.bytes_per_param

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.num_experts else 0

    @property
    def dense_active_params(self) -> float:
        """Parameters every token reads outside the routed experts (attention, dense FFN
        layers, shared experts, output head): the active count less the routed experts' part."""
        routed = self.expert_params * self.experts_per_token / max(1, self.num_experts)
        return self.active_params - routed

    @property
    def expert_size(self) -> float:
        """Parameters of one routed expert in one MoE layer."""
        return self.expert_params / max(1, self.num_moe_layers * self.num_experts)


GIB = 2**30
ACCELERATORS: dict[str, AcceleratorSpec] = {
    "h100": AcceleratorSpec(
        "H100-SXM-80GB",
        989e12,
        3.35e12,
        80 * 1e9,
        450e9,
        source="NVIDIA H100 datasheet (SXM5: 989 TFLOPS bf16 dense, 1,979 TFLOPS fp8 dense,"
        " 3.35 TB/s, NVLink 900 GB/s bidirectional)",
        fp8_flops=1979e12,
    ),
    "h200": AcceleratorSpec(
        "H200-SXM-141GB",
        989e12,
        4.8e12,
        141 * 1e9,
        450e9,
        source="NVIDIA H200 datasheet (989 TFLOPS bf16 dense, 1,979 TFLOPS fp8 dense,"
        " 4.8 TB/s HBM3e, NVLink 900 GB/s bidirectional)",
        fp8_flops=1979e12,
    ),
    "a100": AcceleratorSpec(
        "A100-SXM-80GB",
        312e12,
        2.039e12,
        80 * 1e9,
        300e9,
        source="NVIDIA A100 datasheet (312 TFLOPS bf16, 2,039 GB/s, NVLink 600 GB/s bidirectional)",
    ),
    "cpu": AcceleratorSpec(
        "CPU-server-2S",
        8e12,
        0.5e12,
        512 * GIB,
        50e9,
        mfu=0.4,
        mbu=0.6,
        source="two-socket AMX server class: ~8 TFLOPS bf16, ~500 GB/s DDR5"
        " (order-of-magnitude figures)",
    ),
}


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """A link GPUs exchange activations over: bandwidth per GPU per direction, the fixed cost of
    one collective on it, and the share of line rate collectives attain."""

    name: str
    bandwidth: float  # bytes/s per GPU per direction
    latency: float  # s per collective (launch, synchronisation, one switch hop)
    # attainable share of `bandwidth` in all-to-all / all-reduce: expert-parallel kernels
    # (DeepEP's published runs) and NCCL reach most of line rate on large messages
    efficiency: float = 0.8
    source: str = ""


LINKS: dict[str, LinkSpec] = {
    "nvlink4": LinkSpec(
        "NVLink-4",
        450e9,
        8e-6,
        source="NVIDIA H100/H200 SXM datasheets: NVLink 900 GB/s per GPU bidirectional, i.e."
        " 450 GB/s each way through the NVSwitch; 8 us per collective as the TP roofline charges",
    ),
    "ib-400g": LinkSpec(
        "InfiniBand/RoCE-400G",
        50e9,
        20e-6,
        source="one 400 Gb/s ConnectX-7 NIC per GPU (DGX/HGX H100 and H200 layout) = 50 GB/s"
        " each way; ~20 us per GPU-initiated RDMA all-to-all (order of magnitude: NIC and switch"
        " hops plus completion signalling)",
    ),
}
GPUS_PER_NODE = 8  # HGX H100 / H200 baseboards: 8 GPUs on one NVSwitch domain


def _dense(name, params, layers, hidden, heads, kv_heads, head_dim, ctx, source) -> ModelSpec:
    return ModelSpec(
        name,
        params,
        params,
        layers,
        hidden,
        heads,
        head_dim,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * 2,
        max_model_len=ctx,
        source=source,
    )


MODELS: dict[str, ModelSpec] = {
    "llama-3.1-8b": _dense(
        "Llama-3.1-8B", 8.03e9, 32, 4096, 32, 8, 128, 131072, "meta-llama/Llama-3.1-8B config.json"
    ),
    "qwen3-32b": _dense(
        "Qwen3-32B",
        32.8e9,
        64,
        5120,
        64,
        8,
        128,
        131072,
        "Qwen/Qwen3-32B config.json (64 layers, 64 q / 8 kv heads, head_dim 128)",
    ),
    "llama-3.1-70b": _dense(
        "Llama-3.1-70B",
        70.6e9,
        80,
        8192,
        64,
        8,
        128,
        131072,
        "meta-llama/Llama-3.1-70B config.json",
    ),
    # MLA latent (512) + rope key (64) per layer; FP8 weights; 256 routed experts, 8 per token.
    # Routed experts: 75 MoE layers (3 leading dense) x 256 x 3 x hidden 6144 x moe 2048
    # = 724.8e9 parameters (GLM-5 config: first_k_dense_replace 3, moe_intermediate_size 2048).
    "glm-5.2-moe": ModelSpec(
        "GLM-5.2-class-MoE",
        753e9,
        39e9,
        78,
        6144,
        64,
        192,
        kv_bytes_per_token=78 * 576 * 2,
        bytes_per_param=1.0,
        num_experts=256,
        experts_per_token=8,
        expert_params=724.8e9,
        max_model_len=202752,
        source="GLM-5 class published totals (~753B total incl. the MTP layer, ~39B active,"
        " MLA attention); GLM-5 config: 78 layers, 3 dense, 256 experts of 2048, top-8",
        num_dense_layers=3,
        attention="mla",
        num_nextn_predict_layers=1,
    ),
}


class LatencyModel(abc.ABC):
    """Predicts how long one scheduler step takes."""

    @abc.abstractmethod
    def step_time(self, work: list[SequenceWork]) -> float: ...

    def kv_capacity_bytes(self) -> float | None:
        """Memory left for the KV cache, when the model knows it."""
        return None


class ConstantLatency(LatencyModel):
    """Test mode: a step that samples a first token costs `ttft`, any other step `itl`."""

    def __init__(self, ttft: float = 0.05, itl: float = 0.01, per_prefill_token: float = 0.0):
        self.ttft, self.itl, self.per_prefill_token = ttft, itl, per_prefill_token

    def step_time(self, work: list[SequenceWork]) -> float:
        # verified drafts are decode rows, not a prompt; the drafter is free in this mode
        prefill = [
            w.num_new_tokens
            for w in work
            if w.is_prefill or w.num_new_tokens - w.num_spec_tokens > 1
        ]
        if not prefill:
            return self.itl if work else 0.0
        return self.ttft + self.per_prefill_token * sum(prefill)


class RooflineLatency(LatencyModel):
    def __init__(
        self,
        gpu: AcceleratorSpec,
        model: ModelSpec,
        tensor_parallel_size: int = 1,
        step_overhead: float = 0.002,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        self.gpu, self.model, self.tp = gpu, model, tensor_parallel_size
        self.step_overhead = step_overhead
        self.gpu_memory_utilization = gpu_memory_utilization
        if self.kv_capacity_bytes() <= 0:
            raise ValueError(
                f"{model.name} weights ({model.weight_bytes / 1e9:.0f} GB) do not fit on "
                f"{tensor_parallel_size} x {gpu.name}; raise --tensor-parallel-size"
            )

    def kv_capacity_bytes(self) -> float:
        usable = self.gpu.memory_bytes * self.gpu_memory_utilization * self.tp
        return usable - self.model.weight_bytes

    def _weight_bytes_read(self, num_tokens: int) -> float:
        m = self.model
        if not m.num_experts:
            return m.weight_bytes
        # each routed expert is read once if any token of the step picks it
        dense = (m.total_params - m.expert_params) * m.bytes_per_param
        p_untouched = (1 - m.experts_per_token / m.num_experts) ** num_tokens
        return dense + m.expert_params * m.bytes_per_param * (1 - p_untouched)

    def step_time(self, work: list[SequenceWork]) -> float:
        drafts = draft_time(self._forward_time, work, self.model.num_layers, self.step_overhead)
        return self._forward_time(work) + drafts

    def _forward_time(self, work: list[SequenceWork]) -> float:
        """The target's pass over the scheduled rows (drafts verified included)."""
        if not work:
            return 0.0
        m, g = self.model, self.gpu
        tokens = sum(w.num_new_tokens for w in work)
        attended = sum(
            w.num_new_tokens * w.num_context_tokens + w.num_new_tokens * (w.num_new_tokens + 1) / 2
            for w in work
        )
        flops = (
            2 * m.active_params * tokens + 4 * m.num_layers * m.num_heads * m.head_dim * attended
        )
        kv_read = sum(w.num_context_tokens + w.num_new_tokens for w in work) * m.kv_bytes_per_token
        bytes_moved = self._weight_bytes_read(tokens) + kv_read
        compute = flops / (g.peak_flops * g.mfu * self.tp)
        memory = bytes_moved / (g.mem_bandwidth * g.mbu * self.tp)
        comm = 0.0
        if self.tp > 1:  # two all-reduces of the activations per layer (ring: 2(n-1)/n)
            per_layer = 2 * tokens * m.hidden_size * 2 * 2 * (self.tp - 1) / self.tp
            comm = m.num_layers * per_layer / g.interconnect_bandwidth + m.num_layers * 2 * 8e-6
        return max(compute, memory) + comm + self.step_overhead
