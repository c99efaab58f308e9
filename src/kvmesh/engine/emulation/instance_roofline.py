"""What the instance rooflines share: a step's cost, the per-rank sums of a batch, and the
per-layer attention + dense part and expert touch chances of an MoE model on one GPU."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvmesh.engine.emulation.expert_load import ExpertRouting
from kvmesh.engine.emulation.latency import AcceleratorSpec, LinkSpec, ModelSpec, SequenceWork
from kvmesh.engine.emulation.work import draft_passes


class StepCost(NamedTuple):
    time: float  # seconds of the whole step (the slowest rank's, overhead included)
    compute: float  # seconds the slowest rank spends in kernels (max of compute, memory)
    comm: float  # seconds in collectives (dispatch + combine, or TP all-reduces)
    imbalance: float  # routed tokens on the busiest rank / the mean, averaged over MoE layers
    idle_ranks: int  # ranks that ran a dummy batch


class RankLoad(NamedTuple):
    tokens: np.ndarray  # (ranks,) tokens computed this step (1 on an idle rank: the dummy)
    attended: np.ndarray  # (ranks,) query x context pairs of attention
    kv_tokens: np.ndarray  # (ranks,) tokens of KV read
    idle: int


def rank_load(works: Sequence[Sequence[SequenceWork]], dummy: bool) -> RankLoad:
    tokens, attended, kv = [], [], []
    for work in works:
        tokens.append(sum(w.num_new_tokens for w in work))
        attended.append(
            sum(
                w.num_new_tokens * w.num_context_tokens
                + w.num_new_tokens * (w.num_new_tokens + 1) / 2
                for w in work
            )
        )
        kv.append(sum(w.num_context_tokens + w.num_new_tokens for w in work))
    t, a, k = (np.array(x, dtype=float) for x in (tokens, attended, kv))
    idle = t == 0
    if dummy:  # vLLM's dummy run: one token, no context
        t[idle], a[idle], k[idle] = 1.0, 1.0, 1.0
    return RankLoad(t, a, k, int(idle.sum()))


class InstanceRoofline(abc.ABC):
    """Step time of one serving instance over its DP ranks' batches (one list per rank)."""

    gpu: AcceleratorSpec
    model: ModelSpec
    dp_size: int
    num_gpus: int

    def __init__(
        self,
        gpu: AcceleratorSpec,
        model: ModelSpec,
        routing: ExpertRouting,
        step_overhead: float,
        gpu_memory_utilization: float,
        nvlink: LinkSpec,
    ) -> None:
        if not model.num_experts:
            raise ValueError(f"{model.name} has no routed experts")
        self.gpu, self.model, self.nvlink = gpu, model, nvlink
        self.step_overhead = step_overhead
        self.gpu_memory_utilization = gpu_memory_utilization
        m = model
        self.gemm_flops = (
            gpu.fp8_flops if m.bytes_per_param <= 1 and gpu.fp8_flops else gpu.peak_flops
        ) * gpu.mfu
        self.attn_flops = gpu.peak_flops * gpu.mfu
        self.bandwidth = gpu.mem_bandwidth * gpu.mbu
        self.probs = routing.probabilities(m.num_moe_layers, m.num_experts)  # (layers, experts)
        # chance that one token's top-k includes expert e (k picks without replacement)
        self.pick = np.minimum(1.0, self.probs * m.experts_per_token)
        self.expert_bytes = m.expert_size * m.bytes_per_param

    @abc.abstractmethod
    def kv_capacity_bytes(self) -> float:
        """KV cache bytes of one DP rank."""

    @abc.abstractmethod
    def _forward_cost(self, works: Sequence[Sequence[SequenceWork]]) -> StepCost:
        """The target's pass over every rank's scheduled rows (drafts verified included)."""

    def step_cost(self, works: Sequence[Sequence[SequenceWork]]) -> StepCost:
        """The target's pass, then the drafter's (kvmesh.engine.emulation.spec): per draft
        position one average layer of the instance over the drafting rows of every rank."""
        cost = self._forward_cost(works)
        for rows in draft_passes(works):
            draft = self._forward_cost(rows)
            share = 1.0 / self.model.num_layers
            cost = cost._replace(
                time=cost.time + max(0.0, draft.time - self.step_overhead) * share,
                compute=cost.compute + draft.compute * share,
                comm=cost.comm + draft.comm * share,
            )
        return cost

    def step_time(self, works: Sequence[Sequence[SequenceWork]]) -> float:
        return self.step_cost(works).time

    def _dense_layer_time(self, load: RankLoad, split: int, kv_split: int) -> np.ndarray:
        """Per rank, one layer's attention and dense part (an even 1/num_layers share)."""
        m = self.model
        gemm = 2 * m.dense_active_params * load.tokens / m.num_layers
        attn = 4 * m.num_heads * m.head_dim * load.attended
        weights = m.dense_active_params * m.bytes_per_param / m.num_layers
        kv = load.kv_tokens * m.kv_bytes_per_token / m.num_layers
        compute = (gemm / self.gemm_flops + attn / self.attn_flops) / split
        memory = (weights / split + kv / kv_split) / self.bandwidth
        return np.maximum(compute, memory)

    def _touched(self, total_tokens: float) -> np.ndarray:
        """(layers, experts) chance that some token of the step picks each expert."""
        return 1.0 - (1.0 - self.pick) ** total_tokens

    def _fits(self, layout: str) -> None:
        if self.kv_capacity_bytes() <= 0:
            raise ValueError(
                f"{self.model.name} ({self.model.weight_bytes / 1e9:.0f} GB) does not fit "
                f"{layout} on {self.gpu.name} at --gpu-memory-utilization "
                f"{self.gpu_memory_utilization}"
            )
