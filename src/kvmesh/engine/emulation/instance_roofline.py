"""What the instance rooflines share: a step's cost, the per-rank sums of a batch, and the
per-layer attention + dense part and expert touch chances of an MoE model on one GPU."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvmesh.engine.emulation.expert_load import ExpertRouting
from kvmesh.engine.emulation.latency import AcceleratorSpec, LinkSpec, ModelSpec, SequenceWork


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
        n = a = k = 0
        for w in work:
            new, ctx = w.num_new_tokens, w.num_context_tokens
            n += new
            a += new * ctx + new * (new + 1) / 2
            k += ctx + new
        tokens.append(n)
        attended.append(a)
        kv.append(k)
    return _load(tokens, attended, kv, dummy)


def draft_loads(works: Sequence[Sequence[SequenceWork]], dummy: bool) -> list[RankLoad]:
    """Per draft position j, the per-rank sums of the drafter's j-th pass: one row of one new
    token for every request whose drafts took more than j passes, at the context the draft saw
    (work.draft_passes lists those rows; summed here without them)."""
    depth = 0
    for ws in works:
        for w in ws:
            if w.num_draft_passes > depth:
                depth = w.num_draft_passes
    loads = []
    for j in range(depth):
        tokens, context = [], []
        for ws in works:
            n = c = 0
            for w in ws:
                if w.num_draft_passes > j:
                    n += 1
                    c += w.num_context_tokens + w.num_new_tokens - w.num_spec_tokens + j
            tokens.append(n)
            context.append(c + n)  # one new token each: attends to and reads its context + 1
        loads.append(_load(tokens, context, context, dummy))
    return loads


def _load(tokens: list, attended: list, kv: list, dummy: bool) -> RankLoad:
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

    # idle ranks run vLLM's one-token dummy batch (DP ranks step together); else they wait
    dummy_rank: bool = False

    @abc.abstractmethod
    def _load_cost(self, load: RankLoad) -> StepCost:
        """The target's pass over the ranks' per-rank sums (drafts verified included); zero
        when no rank has work."""

    def step_cost(self, works: Sequence[Sequence[SequenceWork]]) -> StepCost:
        """The target's pass, then the drafter's (kvmesh.engine.emulation.spec): per draft
        position one average layer of the instance over the drafting rows of every rank."""
        if len(works) != self.dp_size:
            raise ValueError(f"expected {self.dp_size} rank batches, got {len(works)}")
        cost = self._load_cost(rank_load(works, self.dummy_rank))
        if cost.time == 0.0:
            return cost
        share = 1.0 / self.model.num_layers
        for load in draft_loads(works, self.dummy_rank):
            draft = self._load_cost(load)
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
