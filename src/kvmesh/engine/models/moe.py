"""Sparse-MoE decoders: Qwen3-MoE, Mixtral and Qwen2-MoE over llama.py's attention and norms.

A MoE layer routes each token to its top-k logical experts. Experts live in *physical slots*:
`physical_to_logical[p]` names the logical expert slot p holds; a logical expert may own several
slots (EPLB's redundant replicas) and a replicated expert's (token, expert) pairs are split among
its replicas. Rank r of an expert-parallel group holds slots [r * L, (r + 1) * L); this process
stores the weights of its own L slots only (`w13` = fused gate/up, `w2` = down). Every rank keeps
the whole placement, so each knows where every pair goes without asking.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.engine.models.expert_parallel import (
    ExpertParallelConfig,
    dispatch_combine,
    initial_placement,
)
from kvmesh.engine.models.llama import MLP, LlamaForCausalLM
from kvmesh.engine.models.model_config import ModelConfig
from kvmesh.engine.models.model_config import MoeConfig as MoeConfig  # (read here too)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared expert): a drop-in for the dense MLP."""

    def __init__(self, c: ModelConfig, ep: ExpertParallelConfig) -> None:
        super().__init__()
        m = c.moe
        assert m is not None
        self.num_experts, self.top_k = m.num_experts, m.num_experts_per_tok
        self.renormalize = m.norm_topk_prob
        self.ep = ep
        self.gate = nn.Linear(c.hidden_size, m.num_experts, bias=False)
        num_physical = m.num_experts + ep.num_redundant_experts
        self.local_slots = num_physical // ep.world_size
        inter = m.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(self.local_slots, 2 * inter, c.hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.local_slots, c.hidden_size, inter))
        # Qwen2-MoE: an always-on expert scaled per token by sigmoid(shared_expert_gate(x))
        self.shared_expert = self.shared_expert_gate = None
        if m.shared_expert_intermediate_size:
            self.shared_expert = MLP(c, m.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)
        # plain tensors (not buffers), out of state_dict; made on CPU (not meta), they follow
        # the weights' device at the first forward. Counts are (token, expert) pairs.
        self.logical_counts = torch.zeros(m.num_experts, dtype=torch.long, device="cpu")
        self.physical_counts = torch.zeros(num_physical, dtype=torch.long, device="cpu")
        self.set_placement(initial_placement(m.num_experts, ep))

    def set_placement(self, physical_to_logical: list[int]) -> None:
        """Adopt a slot map (weights must already match it) and reset the physical counts."""
        p2l = torch.tensor(physical_to_logical, dtype=torch.long, device="cpu")
        if len(p2l) != len(self.physical_counts) or set(p2l.tolist()) != set(
            range(self.num_experts)
        ):
            raise ValueError("a placement must give every logical expert at least one slot")
        replicas = torch.bincount(p2l, minlength=self.num_experts)
        l2p = torch.full(
            (self.num_experts, int(replicas.max())), -1, dtype=torch.long, device="cpu"
        )
        seen = [0] * self.num_experts
        for slot, e in enumerate(p2l.tolist()):
            l2p[e, seen[e]] = slot
            seen[e] += 1
        self.physical_to_logical, self.logical_to_physical, self.replica_count = p2l, l2p, replicas
        self.physical_counts.zero_()

    def local_logical(self) -> list[int]:
        """The logical expert held by each of this rank's slots."""
        first = self.ep.rank * self.local_slots
        return self.physical_to_logical[first : first + self.local_slots].tolist()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (top-k logical expert ids [T, k], their combine weights [T, k] float32)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device
        if self.replica_count.device != dev:
            self.replica_count = self.replica_count.to(dev)
            self.logical_to_physical = self.logical_to_physical.to(dev)
            self.logical_counts = self.logical_counts.to(dev)
            self.physical_counts = self.physical_counts.to(dev)
        ids, weights = self.route(x)
        flat = ids.flatten()
        # the j-th pair routed to expert e goes to its replica j mod replicas(e): an even split
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=self.num_experts)
        self.logical_counts += per_expert
        first = torch.cumsum(per_expert, 0) - per_expert
        nth = torch.empty_like(flat)
        nth[order] = torch.arange(len(flat), device=dev) - first[flat[order]]
        phys = self.logical_to_physical[flat, nth % self.replica_count[flat]]
        self.physical_counts += torch.bincount(phys, minlength=len(self.physical_counts))
        tokens = torch.arange(len(x), device=dev).repeat_interleave(self.top_k)
        rows = x[tokens]
        if self.ep.world_size == 1:
            y = self.run_experts(rows, phys)
        else:  # collectives run even with zero rows: every rank must call them
            y = dispatch_combine(rows, phys, self.run_experts, self.ep, self.local_slots)
        out = torch.zeros_like(x)
        out.index_add_(0, tokens, (y.float() * weights.flatten()[:, None]).to(x.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def run_experts(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Expert outputs for rows [N, H] bound for local slots [N]: one matmul pair per slot."""
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.local_slots).tolist()
        xs, ys = rows[order], torch.empty_like(rows)
        start = 0
        for slot, n in enumerate(counts):
            if n:
                gate, up = F.linear(xs[start : start + n], self.w13[slot]).chunk(2, dim=-1)
                ys[start : start + n] = F.linear(F.silu(gate) * up, self.w2[slot])
                start += n
        out = torch.empty_like(rows)
        out[order] = ys
        return out


# (HF projection name) -> (our parameter, shard index into w13 or None for w2)
_EXPERT_PROJ = {
    "gate_proj": ("w13", 0),
    "w1": ("w13", 0),
    "up_proj": ("w13", 1),
    "w3": ("w13", 1),
    "down_proj": ("w2", None),
    "w2": ("w2", None),
    "gate_up_proj": ("w13", None),  # transformers-5 fused [E, 2I, H]
}


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3MoeForCausalLM / MixtralForCausalLM / Qwen2MoeForCausalLM."""

    def __init__(self, config: ModelConfig, ep: ExpertParallelConfig | None = None) -> None:
        moe = config.moe
        if moe is None:
            raise ValueError(f"{config.architecture} is not a MoE architecture")
        ep = ep or ExpertParallelConfig(rank=0, world_size=1, group=None)

        def mlp(c: ModelConfig, layer: int) -> nn.Module | None:
            return SparseMoeBlock(c, ep) if moe.is_sparse(layer) else None

        super().__init__(config, mlp)
        self.ep = ep

    def moe_layers(self) -> list[SparseMoeBlock]:
        return [m for layer in self.model.layers if isinstance(m := layer.mlp, SparseMoeBlock)]

    @torch.inference_mode()
    def run_idle_step(self) -> None:
        """A step with no local tokens: every MoE layer's collectives, in forward's order."""
        empty = self.model.embed_tokens.weight.new_zeros(0, self.config.hidden_size)
        for block in self.moe_layers():
            block(empty)

    def load_tensor(
        self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter], filled: dict
    ) -> None:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's module name
        if ".mlp.experts." not in name:
            return super().load_tensor(name, tensor, params, filled)
        prefix, rest = name.split(".experts.", 1)
        try:
            block = self.get_submodule(prefix)
        except AttributeError:
            raise ValueError(f"unexpected checkpoint tensor {name!r}") from None
        parts = rest.split(".")  # "<e>.<proj>.weight" (per expert) or "<proj>" (fused 3D)
        if len(parts) == 3 and parts[0].isdigit() and parts[2] == "weight":
            experts, proj, tensor = [int(parts[0])], parts[1], tensor[None]
        elif len(parts) == 1:
            experts, proj = list(range(len(tensor))), parts[0]
        else:
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        if proj not in _EXPERT_PROJ or not isinstance(block, SparseMoeBlock):
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        if experts[-1] >= block.num_experts:
            raise ValueError(f"{name}: expert index beyond num_experts={block.num_experts}")
        pname, shard = _EXPERT_PROJ[proj]
        param = getattr(block, pname)
        half = param.shape[1] // 2
        for slot, e in enumerate(block.local_logical()):  # experts held elsewhere are skipped
            if e not in experts:
                continue
            dest = param.data[slot]
            if shard is not None:
                dest = dest[shard * half : (shard + 1) * half]
            src = tensor[experts.index(e)]
            if dest.shape != src.shape:
                raise ValueError(f"{name}: shape {tuple(src.shape)} != {tuple(dest.shape)}")
            with torch.no_grad():
                dest.copy_(src)
            filled[f"{prefix}.{pname}"] += dest.numel()
