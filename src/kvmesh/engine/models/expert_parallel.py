"""Expert parallelism over a torch.distributed group (gloo on CPU, NCCL for CUDA tensors).

Every DP rank runs attention on its own batch; each MoE layer's physical expert slots are split
evenly over the ranks (rank r holds slots [r * L, (r + 1) * L)). A MoE layer sends each
(token, expert) pair's hidden row to the rank holding the chosen slot and gets the expert's
output back, with three `all_to_all_single` calls (the one all-to-all gloo has long supported):
pair counts, rows with their slot ids, results. Invariant: every rank makes the same collectives
in the same order each engine step, whatever its token count, zero included; a rank with no work
calls `model.run_idle_step()` (vLLM's dummy batch) so the others never wait on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

PLACEMENTS = ("linear", "round_robin")  # --expert-placement-strategy


@dataclass(slots=True)
class ExpertParallelConfig:
    rank: int  # this DP rank
    world_size: int  # number of DP ranks = EP size
    group: ProcessGroup | None  # None only when world_size == 1
    placement: str = "linear"  # --expert-placement-strategy: "linear" | "round_robin"
    num_redundant_experts: int = 0  # EPLB's extra physical expert slots (vLLM's eplb_config)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world_size {self.world_size}")
        if self.group is None and self.world_size > 1:
            raise ValueError("expert parallelism over several ranks needs a process group")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown expert placement {self.placement!r}; use {PLACEMENTS}")
        if self.num_redundant_experts < 0:
            raise ValueError("num_redundant_experts must be >= 0")


def initial_placement(num_experts: int, ep: ExpertParallelConfig) -> list[int]:
    """physical_to_logical before any rebalancing. `linear`: rank r holds a contiguous run of
    experts; `round_robin`: rank r holds experts r, r + W, r + 2W, ... Redundant slots (the
    entries past num_experts) start as copies of experts 0, 1, ..."""
    num_physical = num_experts + ep.num_redundant_experts
    if num_physical % ep.world_size:
        raise ValueError(
            f"num_experts + num_redundant_experts = {num_physical} must be a multiple of the"
            f" expert-parallel size {ep.world_size}"
        )
    per_rank, w = num_physical // ep.world_size, ep.world_size
    if ep.placement == "linear":
        order = list(range(num_physical))
    else:  # slot j of rank r takes the (j * W + r)-th expert of the sequence
        order = [j * w + r for r in range(w) for j in range(per_rank)]
    return [q % num_experts for q in order]


def dispatch_combine(
    rows: torch.Tensor,
    slots: torch.Tensor,
    run_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ep: ExpertParallelConfig,
    local_slots: int,
) -> torch.Tensor:
    """Rows [N, H] bound for global physical `slots` [N] -> expert outputs [N, H], in order.

    `run_experts(rows, local_slot_ids)` computes this rank's experts for the rows it receives.
    Collective: all ranks of `ep.group` must call it together, N = 0 included.
    """
    group = ep.group
    dest = torch.div(slots, local_slots, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=ep.world_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    # rows and slot ids travel together as one byte matrix: one all-to-all, not two
    packed = torch.cat([_bytes(rows[order]), _bytes(slots[order, None])], dim=1)
    got = packed.new_empty((sum(recv), packed.shape[1]))
    dist.all_to_all_single(got, packed, recv, send, group=group)
    row_bytes = rows.shape[1] * rows.dtype.itemsize
    got_rows = got[:, :row_bytes].contiguous().view(rows.dtype)
    got_slots = got[:, row_bytes:].contiguous().view(torch.long)[:, 0]
    results = run_experts(got_rows, got_slots - ep.rank * local_slots)
    back = rows.new_empty(rows.shape)
    dist.all_to_all_single(back, results.contiguous(), send, recv, group=group)
    out = torch.empty_like(back)
    out[order] = back
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, C] tensor -> [N, C * itemsize] uint8 view of the same bytes."""
    return t.contiguous().view(torch.uint8).view(len(t), t.shape[1] * t.dtype.itemsize)


def move_slots(
    weights: torch.Tensor,
    old: list[int],
    new: list[int],
    ep: ExpertParallelConfig,
) -> torch.Tensor:
    """This rank's slot weights [L, ...] under placement `old` -> under placement `new`.

    Each new slot copies a slot that held the same logical expert before: one on this rank if
    there is one, else the first such slot anywhere (sent by its rank). Every rank derives the
    same plan from the two maps. Collective when world_size > 1.
    """
    per_rank = len(old) // ep.world_size
    where: dict[int, list[int]] = {}
    for slot, e in enumerate(old):
        where.setdefault(e, []).append(slot)

    def source(slot: int) -> int:
        owner = slot // per_rank
        held = [s for s in where[new[slot]] if s // per_rank == owner]
        return held[0] if held else where[new[slot]][0]

    plan = [(source(d), d) for d in range(len(new))]  # (old slot, new slot), ordered by new slot
    first = ep.rank * per_rank
    out = torch.empty_like(weights)
    if ep.world_size == 1:
        for s, d in plan:
            out[d] = weights[s]
        return out
    # (src rank, dst rank) pairs with src != dst travel; the rest are local copies
    sends = [[] for _ in range(ep.world_size)]
    recvs = [[] for _ in range(ep.world_size)]
    for s, d in plan:
        rs, rd = s // per_rank, d // per_rank
        if rs == rd == ep.rank:
            out[d - first] = weights[s - first]
        elif rs != rd and rs == ep.rank:
            sends[rd].append(s - first)
        elif rs != rd and rd == ep.rank:
            recvs[rs].append(d - first)
    send_idx = [i for per in sends for i in per]
    send_buf = weights[send_idx].contiguous() if send_idx else weights[:0].contiguous()
    recv_buf = weights.new_empty((sum(map(len, recvs)), *weights.shape[1:]))
    dist.all_to_all_single(
        recv_buf, send_buf, [len(r) for r in recvs], [len(s) for s in sends], group=ep.group
    )
    recv_idx = [i for per in recvs for i in per]
    if recv_idx:
        out[recv_idx] = recv_buf
    return out


def all_reduce_sum(t: torch.Tensor, ep: ExpertParallelConfig) -> torch.Tensor:
    """Sum of `t` over the group (a copy; collective when world_size > 1)."""
    t = t.clone()
    if ep.world_size > 1:
        dist.all_reduce(t, group=ep.group)
    return t
