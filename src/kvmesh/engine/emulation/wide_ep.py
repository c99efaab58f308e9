"""Roofline of one data-parallel attention / expert-parallel instance (wide EP), and of a
tensor-parallel instance of the same model to compare it with.

Wide EP: every GPU is a DP rank with its own batch and KV cache; attention and the dense parts
(dense FFN layers, shared experts, output head) are replicated on every rank; the routed experts
of every MoE layer are split over the ranks (EP size == DP size). Per MoE layer each rank runs
attention and the dense part over its own batch, dispatches every token's top-k picks to the
ranks holding those experts, runs the experts it holds over the tokens it received, and combines
the results back. Both all-to-alls wait for the slowest rank (lockstep), so a step is the sum over
layers of the slowest rank's time plus the two collectives, whose bytes cross NVLink inside a
node and InfiniBand/RoCE between nodes. A rank without work runs a dummy batch of one token, as
vLLM does, so it pays every collective and reads its weights like any other rank.

Expert load follows a routing distribution (kvmesh.engine.emulation.expert_load): a rank's share
is the probability mass of the experts it holds, and the expected busiest rank's load adds the
binomial spread of that share times the expected maximum of N normals.
"""

from __future__ import annotations

from statistics import NormalDist

import numpy as np

from kvmesh.engine.emulation.expert_load import ExpertRouting, expert_placement
from kvmesh.engine.emulation.instance_roofline import (
    InstanceRoofline,
    RankLoad,
    StepCost,
)
from kvmesh.engine.emulation.latency import (
    GPUS_PER_NODE,
    LINKS,
    AcceleratorSpec,
    LinkSpec,
    ModelSpec,
)

# bytes per hidden element on the wire: expert-parallel all-to-all kernels (DeepEP, as vLLM's
# deepep_* backends use it) dispatch fp8-quantised activations and combine bf16 results; TP
# all-reduces bf16 activations.
DISPATCH_BYTES = 1
COMBINE_BYTES = 2
ALLREDUCE_BYTES = 2
# vLLM's --all2all-backend names: low-latency kernels send every pick on its own; the
# high-throughput kernels send a token once to each remote node holding any of its picks (to the
# GPU of the same local index there, which forwards over NVLink) after a round of counts
ALL2ALL_BACKENDS = ("deepep_low_latency", "deepep_high_throughput")


class WideEPRoofline(InstanceRoofline):
    """DP attention + EP over `dp_size` GPUs, `gpus_per_node` to an NVLink domain."""

    def __init__(
        self,
        gpu: AcceleratorSpec,
        model: ModelSpec,
        dp_size: int,
        routing: ExpertRouting | None = None,
        placement: str = "linear",
        enable_dbo: bool = False,
        dbo_decode_token_threshold: int = 32,
        step_overhead: float = 0.002,
        gpu_memory_utilization: float = 0.9,
        all2all_backend: str = "deepep_low_latency",
        gpus_per_node: int = GPUS_PER_NODE,
        nvlink: LinkSpec = LINKS["nvlink4"],
        network: LinkSpec = LINKS["ib-400g"],
    ) -> None:
        super().__init__(
            gpu, model, routing or ExpertRouting(), step_overhead, gpu_memory_utilization, nvlink
        )
        if all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(f"--all2all-backend must be one of {ALL2ALL_BACKENDS}")
        self.dp_size = self.num_gpus = dp_size
        self.all2all_backend = all2all_backend
        self.network, self.gpus_per_node = network, gpus_per_node
        self.enable_dbo, self.dbo_threshold = enable_dbo, dbo_decode_token_threshold
        owner = expert_placement(model.num_experts, dp_size, placement)
        self.holds = np.eye(dp_size)[owner]  # (experts, ranks) one-hot
        # (layers, ranks): a pick's chance to land on each rank (from the capped pick chances)
        self.share = (self.pick / self.pick.sum(axis=1, keepdims=True)) @ self.holds
        self.experts_per_rank = self.holds.sum(axis=0)
        node = np.arange(dp_size) // gpus_per_node
        same = node[:, None] == node[None, :]
        self.intra = (same & ~np.eye(dp_size, dtype=bool)).astype(float)  # other GPUs, same node
        self.inter = (~same).astype(float)
        self.node_hot = np.eye(int(node.max()) + 1)[node]  # (ranks, nodes) one-hot
        local = np.arange(dp_size) % gpus_per_node
        self.peer = ((local[:, None] == local[None, :]) & ~same).astype(float)
        n = dp_size
        # E[max of n standard normals], Blom's approximation (within ~1% for n = 2 .. 1000)
        self.z = NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0
        # (layers, ranks): a pick's chance to go to another GPU of its node, or to another node
        self.share_intra, self.share_inter = self.share @ self.intra.T, self.share @ self.inter.T
        # the step's total tokens -> (busiest rank's picks, touched expert bytes) per layer
        self._by_total: dict[float, tuple[np.ndarray, np.ndarray]] = {}
        self._fits(f"DP{dp_size}/EP{dp_size}")

    def kv_capacity_bytes(self) -> float:
        m = self.model
        dense = (m.total_params - m.expert_params) * m.bytes_per_param  # replicated per rank
        experts = self.experts_per_rank.max() * m.num_moe_layers * self.expert_bytes
        return self.gpu.memory_bytes * self.gpu_memory_utilization - dense - experts

    def routed_load(self, total_tokens: float) -> tuple[np.ndarray, np.ndarray]:
        """(layers, ranks) expected picks routed to each rank, and the busiest rank's expected
        picks per layer (mean plus the binomial spread times E[max of N normals])."""
        picks = total_tokens * self.model.experts_per_token
        mean = picks * self.share
        spread = np.sqrt(picks * self.share * (1.0 - self.share))
        return mean, (mean + self.z * spread).max(axis=1)

    def _all_to_all(self, send: tuple, recv: tuple, bytes_per_pick: float) -> np.ndarray:
        """Per layer, the collective's time: each link class moves its busiest rank's bytes
        (sent or received, whichever is larger); NVLink and the NIC run side by side."""
        times = []
        for link, s, r in zip((self.nvlink, self.network), send, recv, strict=True):
            volume = np.maximum(s, r).max(axis=1) * bytes_per_pick
            times.append(volume / (link.bandwidth * link.efficiency))
        multi_node = self.dp_size > self.gpus_per_node
        latency = self.network.latency if multi_node else self.nvlink.latency
        rounds = 2 if self.all2all_backend == "deepep_high_throughput" else 1
        return np.maximum(times[0], times[1]) + (rounds * latency if self.dp_size > 1 else 0.0)

    def _volumes(self, tokens: np.ndarray, mean: np.ndarray, total: float) -> tuple:
        """(NVLink, network) picks each rank sends and receives per layer, (layers, ranks)."""
        k = self.model.experts_per_token
        if self.all2all_backend == "deepep_low_latency":
            masks = (self.intra, self.inter)
            shares = (self.share_intra, self.share_inter)
            send = tuple(k * tokens[None, :] * share for share in shares)
            recv = tuple(mean * (mask @ tokens)[None, :] / total for mask in masks)
            return send, recv
        reach = 1.0 - (1.0 - self.share @ self.node_hot) ** k  # (layers, nodes) any pick there
        send_net = tokens[None, :] * (reach @ (1.0 - self.node_hot).T)
        recv_net = (reach @ self.node_hot.T) * (self.peer @ tokens)[None, :]
        # inside the node every pick not computed where it arrived moves once over NVLink
        send_nv = k * tokens[None, :] * (1.0 - self.share)
        recv_nv = mean * (total - tokens)[None, :] / total
        return (send_nv, send_net), (recv_nv, recv_net)

    def _layers(self, load: RankLoad) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
        """One MoE layer each: the slowest rank's attention + dense time, its experts' time,
        the dispatch + combine time; and the busiest rank's routed picks."""
        m, tokens = self.model, load.tokens
        total = float(tokens.sum())
        dense = float(self._dense_layer_time(load, 1, 1).max())
        mean, busiest, touched_bytes = self._routed(total)
        expert_flops = 2 * m.expert_size * busiest
        experts = np.maximum(expert_flops / self.gemm_flops, touched_bytes / self.bandwidth)
        send, recv = self._volumes(tokens, mean, total)
        comm = self._all_to_all(send, recv, m.hidden_size * DISPATCH_BYTES)
        comm = comm + self._all_to_all(send, recv, m.hidden_size * COMBINE_BYTES)
        return dense, experts, comm, busiest / mean.mean(axis=1)

    def _routed(self, total: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """routed_load(total) and the busiest rank's touched expert bytes per layer; what
        depends on the total alone is computed once per total (up to 65,536 totals)."""
        mean = total * self.model.experts_per_token * self.share
        known = self._by_total.get(total)
        if known is None:
            _, busiest = self.routed_load(total)
            touched = (self._touched(total) @ self.holds).max(axis=1) * self.expert_bytes
            if len(self._by_total) >= 1 << 16:
                self._by_total.clear()
            known = self._by_total[total] = (busiest, touched)
        return mean, *known

    dummy_rank = True

    def _load_cost(self, load: RankLoad) -> StepCost:
        if load.idle == self.dp_size:
            return StepCost(0.0, 0.0, 0.0, 1.0, self.dp_size)
        dense, experts, comm, imbalance = self._layers(load)
        compute = dense + experts  # per MoE layer
        if self.enable_dbo and load.tokens.max() >= self.dbo_threshold:
            # two micro-batches, each half the tokens, KV and attention but all the weights
            half = RankLoad(load.tokens / 2, load.attended / 2, load.kv_tokens / 2, load.idle)
            h_dense, h_experts, h_comm, _ = self._layers(half)
            h_compute = h_dense + h_experts
            forward = two_batch_overlap(h_compute, h_comm)
            compute, comm, dense = 2 * h_compute, 2 * h_comm, 2 * h_dense
        else:
            forward = float((compute + comm).sum())
        dense_layers = dense * self.model.num_dense_layers
        return StepCost(
            float(forward + dense_layers + self.step_overhead),
            float(compute.sum() + dense_layers),
            float(comm.sum()),
            float(imbalance.mean()),
            load.idle,
        )


def two_batch_overlap(compute: np.ndarray, comm: np.ndarray) -> float:
    """Seconds of the MoE layers' forward as two micro-batches A and B pipelined across the
    whole forward (SGLang's two-batch overlap, vLLM's DBO), given one micro-batch's kernels and
    all-to-all time per layer: A's first kernels run alone, then every interval runs one
    micro-batch's all-to-all under the other's kernels (A's layer-i all-to-all with B's layer-i
    kernels, B's with A's layer-i+1 kernels), and B's last all-to-all runs alone. Only the
    pipeline's fill and drain are exposed, not one kernel-or-collective per layer."""
    pairs = np.maximum(comm, compute).sum() + np.maximum(comm[:-1], compute[1:]).sum()
    return float(compute[0] + pairs + comm[-1])


class TensorParallelRoofline(InstanceRoofline):
    """One replica over `tp` GPUs of a node: every weight split `tp` ways, two all-reduces of
    the activations per layer over NVLink; an MLA model's latent KV is replicated on each."""

    def __init__(
        self,
        gpu: AcceleratorSpec,
        model: ModelSpec,
        tp: int = 8,
        routing: ExpertRouting | None = None,
        step_overhead: float = 0.002,
        gpu_memory_utilization: float = 0.9,
        nvlink: LinkSpec = LINKS["nvlink4"],
    ) -> None:
        super().__init__(
            gpu, model, routing or ExpertRouting(), step_overhead, gpu_memory_utilization, nvlink
        )
        self.tp, self.dp_size, self.num_gpus = tp, 1, tp
        self.kv_split = 1 if model.attention == "mla" else tp
        self._fits(f"TP{tp}")

    def kv_capacity_bytes(self) -> float:
        per_gpu = self.gpu.memory_bytes * self.gpu_memory_utilization
        per_gpu -= self.model.weight_bytes / self.tp
        return per_gpu * self.kv_split  # MLA: each GPU holds all of it, so capacity does not add

    def _load_cost(self, load: RankLoad) -> StepCost:
        tokens = float(load.tokens[0])
        if not tokens:
            return StepCost(0.0, 0.0, 0.0, 1.0, 1)
        m = self.model
        dense = float(self._dense_layer_time(load, self.tp, self.kv_split)[0])
        flops = 2 * m.expert_size * tokens * m.experts_per_token / self.tp
        touched = self._touched(tokens).sum(axis=1) * self.expert_bytes / self.tp
        experts = np.maximum(flops / self.gemm_flops, touched / self.bandwidth)
        ring = 2 * (self.tp - 1) / self.tp * tokens * m.hidden_size * ALLREDUCE_BYTES
        per_allreduce = ring / (self.nvlink.bandwidth * self.nvlink.efficiency)
        comm = m.num_layers * 2 * (per_allreduce + self.nvlink.latency) if self.tp > 1 else 0.0
        compute = float(experts.sum()) + dense * m.num_layers
        return StepCost(compute + comm + self.step_overhead, compute, comm, 1.0, 0)
