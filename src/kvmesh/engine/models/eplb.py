"""Expert load and EPLB (expert-parallel load balancing) for the MoE models.

Each MoE layer counts the (token, expert) pairs routed to each logical expert (cumulative since
load) and to each physical slot (since the last placement). `expert_load` turns the counts into
per-rank shares and the imbalance (max / mean over ranks). `rebalance` builds a new slot map from
observed load: the R redundant slots replicate the experts with the highest load per replica,
then slots are packed onto ranks heaviest first, each to the least loaded rank with a free slot.
`apply_placement` moves the weights to match (re-indexing on one process, all-to-all across
ranks); outputs do not change, since every replica of an expert holds the same weights.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvmesh.engine.models.expert_parallel import all_reduce_sum, move_slots

if TYPE_CHECKING:
    from kvmesh.engine.models.moe import MoeForCausalLM


class ExpertLoad(NamedTuple):
    expert_counts: list[list[int]]  # [moe layer][logical expert] pairs routed, since load
    rank_tokens: list[list[int]]  # [moe layer][rank] pairs sent to its slots, since placement
    rank_share: list[list[float]]  # rank_tokens normalised per layer (0s when nothing ran)
    layer_imbalance: list[float]  # per layer: max / mean of rank_tokens (1.0 = balanced)
    # sum over layers of the busiest rank / sum of the mean rank: the lockstep slowdown factor
    imbalance: float


def imbalance_of(rank_tokens: list[list[int]]) -> tuple[list[float], float]:
    per_layer = [max(r) / (sum(r) / len(r)) if sum(r) else 1.0 for r in rank_tokens]
    busiest = sum(max(r) for r in rank_tokens)
    mean = sum(sum(r) / len(r) for r in rank_tokens)
    return per_layer, busiest / mean if mean else 1.0


def expert_load(
    model: MoeForCausalLM, *, gather: bool = False, num_ranks: int | None = None
) -> ExpertLoad:
    """This rank's counts; with `gather`, summed over the EP group (a collective).

    `num_ranks` views the slots as split over that many ranks instead of the EP size (one
    process holding every slot can show the balance an EP deployment of it would have)."""
    blocks = model.moe_layers()
    if not blocks:
        return ExpertLoad([], [], [], [], 1.0)
    logical = torch.stack([b.logical_counts for b in blocks])
    physical = torch.stack([b.physical_counts for b in blocks])
    if gather:
        logical, physical = all_reduce_sum(logical, model.ep), all_reduce_sum(physical, model.ep)
    w = num_ranks or model.ep.world_size
    if physical.shape[1] % w:
        raise ValueError(f"{physical.shape[1]} expert slots do not split over {w} ranks")
    ranks = physical.view(len(blocks), w, -1).sum(-1).tolist()
    share = [[t / sum(r) if sum(r) else 0.0 for t in r] for r in ranks]
    per_layer, overall = imbalance_of(ranks)
    return ExpertLoad(logical.tolist(), ranks, share, per_layer, overall)


def rank_loads(load: list[float], placement: list[int], num_ranks: int) -> list[float]:
    """Each rank's expected load under `placement` (physical_to_logical) when an expert's load
    splits evenly over its replicas."""
    replicas = [placement.count(e) for e in range(len(load))]
    per_rank = len(placement) // num_ranks
    out = [0.0] * num_ranks
    for slot, e in enumerate(placement):
        out[slot // per_rank] += load[e] / replicas[e]
    return out


def rebalance(load: list[int], num_physical: int, world_size: int) -> list[int]:
    """A physical_to_logical map for one layer from its logical expert `load`."""
    num_experts = len(load)
    if num_physical < num_experts or num_physical % world_size:
        raise ValueError("need num_physical >= num_experts and a multiple of world_size")
    replicas = [1] * num_experts
    for _ in range(num_physical - num_experts):  # hottest per replica gets the next slot
        e = max(range(num_experts), key=lambda i: (load[i] / replicas[i], -i))
        replicas[e] += 1
    items = [(load[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])]
    items.sort(key=lambda it: (-it[0], it[1]))
    per_rank = num_physical // world_size
    slots: list[list[int]] = [[] for _ in range(world_size)]
    rank_load = [0.0] * world_size
    for weight, e in items:
        free = [r for r in range(world_size) if len(slots[r]) < per_rank]
        apart = [r for r in free if e not in slots[r]] or free  # spread replicas over ranks
        r = min(apart, key=lambda q: (rank_load[q], q))
        slots[r].append(e)
        rank_load[r] += weight
    return [e for rank in slots for e in rank]


def apply_placement(model: MoeForCausalLM, placements: list[list[int]]) -> None:
    """Move every MoE layer's expert weights to `placements[i]` (collective under EP)."""
    blocks = model.moe_layers()
    if len(placements) != len(blocks):
        raise ValueError(f"{len(placements)} placements for {len(blocks)} MoE layers")
    for block, new in zip(blocks, placements, strict=True):
        if len(new) != len(block.physical_to_logical):
            raise ValueError("a placement must keep the number of physical slots")
        old = block.physical_to_logical.tolist()
        with torch.no_grad():
            block.w13.data = move_slots(block.w13.data, old, new, model.ep)
            block.w2.data = move_slots(block.w2.data, old, new, model.ep)
        block.set_placement(new)


def rebalance_model(
    model: MoeForCausalLM, loads: list[list[int]] | None = None, num_ranks: int | None = None
) -> None:
    """Rebalance every MoE layer from `loads` (default: the group's counts since load), packing
    for `num_ranks` ranks (default: the EP size; see `expert_load`)."""
    if loads is None:
        loads = expert_load(model, gather=True).expert_counts
    w = num_ranks or model.ep.world_size
    placements = [
        rebalance(load, len(b.physical_to_logical), w)
        for load, b in zip(loads, model.moe_layers(), strict=True)
    ]
    apply_placement(model, placements)


class EplbState:
    """Call `step(model)` once per engine step on every rank (idle ones too): every
    `step_interval` steps it sums the last `window_size` steps' load over the group and
    rebalances (the two fields of --eplb-config, dp.eplb_config.EPLBConfig). Collective on the
    rebalancing steps, which all ranks reach together."""

    def __init__(self, window_size: int = 1000, step_interval: int = 3000) -> None:
        if window_size < 1 or step_interval < 1:
            raise ValueError("window_size and step_interval must be >= 1")
        self.step_interval = step_interval
        self.steps = 0
        self.history: deque[torch.Tensor] = deque(maxlen=window_size + 1)

    def step(self, model: MoeForCausalLM) -> ExpertLoad | None:
        """The load rebalanced from (on rebalancing steps), else None."""
        blocks = model.moe_layers()
        if not blocks:
            return None
        self.history.append(torch.stack([b.logical_counts for b in blocks]))
        self.steps += 1
        if self.steps % self.step_interval:
            return None
        full = len(self.history) == self.history.maxlen  # else the window starts at load
        window = self.history[-1] - (self.history[0] if full else 0)
        loads = all_reduce_sum(window, model.ep).tolist()
        before = expert_load(model, gather=True)
        rebalance_model(model, loads)
        return before
