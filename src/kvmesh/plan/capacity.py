"""The analytic cost model's verdict on a candidate before it is simulated.

A decode step of one engine (or DP rank) running B sequences at the workload's mean context is
priced by the same roofline the simulator steps with (the dense roofline at the engine's TP
size, or the instance roofline of the layout, MTP drafts included). From it:

- the per-user decode speed of a sequence alone (B = 1): no fleet of that layout decodes faster,
  whatever its size;
- the most sequences a rank decodes at the target speed or faster (its KV cache allowing), and so
  the fleet's decode tokens/s at that speed, counting decode ranks only.

A candidate is pruned when it costs more than the budget, when one sequence alone decodes below
the target, when its decode capacity at the target speed is below `slack` times the demand of
the agents (Workload.decode_demand_tok_s), or when it adds a host tier while its GPUs' KV caches
already hold everything the agents can reuse (Workload.working_set_tokens): the tier would take
no hits and the same fleet without it is simulated. The roofline leaves out prefill work
sharing the steps and the batch's spread of contexts, so its capacity is optimistic: what it
prunes, the simulator would not pass either (the slack absorbs the demand's own approximation).
"""

from __future__ import annotations

from typing import NamedTuple

from kvmesh.engine.emulation.latency import ACCELERATORS, MODELS, RooflineLatency
from kvmesh.engine.emulation.layouts import build_roofline, parse_layout
from kvmesh.engine.emulation.spec import expected_tokens_per_step, parse_acceptance
from kvmesh.engine.emulation.work import SequenceWork
from kvmesh.plan.candidates import MTP_DRAFTS, Candidate
from kvmesh.plan.targets import Targets, Workload

MAX_BATCH = 1024  # vLLM's --max-num-seqs on a large card: no rank decodes more at once
DEFAULT_SLACK = 0.8


class Capacity(NamedTuple):
    user_tok_s_alone: float  # one sequence alone at the mean context
    batch_at_target: int  # sequences one rank decodes at >= the target speed (0: none)
    decode_tok_s: float  # the fleet's decode ranks at that batch
    kv_tokens: int  # what the decode ranks' KV caches hold together


class Pruned(NamedTuple):
    candidate: Candidate
    rule: str  # "budget", "user speed", "decode capacity", "host tier idle"
    detail: str
    user_tok_s_alone: float = 0.0  # the cost model's best per-user speed (0: not computed)


class RankModel:
    """Decode step time of one rank of a unit layout at a given batch."""

    def __init__(self, candidate: Candidate, model: str, gpu: str, acceptance: str) -> None:
        self.k = MTP_DRAFTS if candidate.mtp else 0
        rates = parse_acceptance(acceptance)
        self.tokens_per_step = expected_tokens_per_step(rates, self.k) if self.k else 1.0
        spec = MODELS[model]
        self.kv_bytes_per_token = spec.kv_bytes_per_token
        if candidate.layout:
            self.roofline = build_roofline(*parse_layout(candidate.layout), gpu, model)
            self.ranks = self.roofline.dp_size
            self.dense = None
            self.kv_capacity = self.roofline.kv_capacity_bytes()
        else:
            self.dense = RooflineLatency(ACCELERATORS[gpu], spec, candidate.tp)
            self.ranks = 1
            self.kv_capacity = self.dense.kv_capacity_bytes()

    def step_s(self, batch: int, context: int) -> float:
        row = SequenceWork(1 + self.k, context, False, self.k, self.k)
        if self.dense is not None:
            return self.dense.step_time([row] * batch)
        return self.roofline.step_time([[row] * batch] * self.ranks)

    def user_tok_s(self, batch: int, context: int) -> float:
        return self.tokens_per_step / self.step_s(batch, context)

    def max_batch(self, context: int) -> int:
        """Sequences of `context` tokens the rank's KV cache holds (at most MAX_BATCH)."""
        per = max(1, context) * self.kv_bytes_per_token
        return max(0, min(MAX_BATCH, int(self.kv_capacity // per)))


def capacity(
    candidate: Candidate, model: str, gpu: str, context: int, target: float, acceptance: str
) -> Capacity:
    rank = RankModel(candidate, model, gpu, acceptance)
    alone = rank.user_tok_s(1, context)
    limit = rank.max_batch(context)
    ranks = candidate.decode_units * candidate.ranks_per_unit
    kv_tokens = int(ranks * rank.kv_capacity // rank.kv_bytes_per_token)
    if alone < target or limit < 1:
        return Capacity(alone, 0, 0.0, kv_tokens)
    lo, hi = 1, limit  # speed falls as the batch grows: the largest batch still at target
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if rank.user_tok_s(mid, context) >= target:
            lo = mid
        else:
            hi = mid - 1
    return Capacity(alone, lo, ranks * lo * rank.user_tok_s(lo, context), kv_tokens)


def prune(
    candidates: list[Candidate],
    targets: Targets,
    workload: Workload,
    model: str,
    gpu: str,
    usd_per_gpu_hour: float,
    acceptance: str,
    slack: float = DEFAULT_SLACK,
) -> tuple[list[Candidate], list[Pruned]]:
    """(survivors, pruned with the rule and figures that pruned each)."""
    context = workload.mean_context_tokens()
    demand = workload.decode_demand_tok_s(targets)
    working_set = workload.working_set_tokens(targets.agents)
    survivors: list[Candidate] = []
    pruned: list[Pruned] = []
    cache: dict[tuple, Capacity] = {}
    for c in candidates:
        usd = c.gpus * usd_per_gpu_hour
        if targets.budget_usd_per_hour and usd > targets.budget_usd_per_hour:
            detail = f"${usd:,.2f}/h over the budget of ${targets.budget_usd_per_hour:,.2f}/h"
            pruned.append(Pruned(c, "budget", detail))
            continue
        key = (c.layout, c.tp, c.mtp, c.decode_units)
        if key not in cache:
            cache[key] = capacity(c, model, gpu, context, targets.user_tok_s, acceptance)
        cap = cache[key]
        if cap.user_tok_s_alone < targets.user_tok_s:
            detail = (
                f"one sequence alone decodes at {cap.user_tok_s_alone:.0f} tok/s on "
                f"{c.unit_name()} at a {context:,}-token context (target {targets.user_tok_s:g})"
            )
            pruned.append(Pruned(c, "user speed", detail, cap.user_tok_s_alone))
        elif cap.decode_tok_s < slack * demand:
            detail = (
                f"decode capacity {cap.decode_tok_s:,.0f} tok/s at {targets.user_tok_s:g} tok/s "
                f"per user ({cap.batch_at_target} per rank) < {slack:g} x the agents' "
                f"{demand:,.0f} tok/s"
            )
            pruned.append(Pruned(c, "decode capacity", detail, cap.user_tok_s_alone))
        elif c.host_tier_gib and cap.kv_tokens >= working_set:
            detail = (
                f"the GPUs' KV caches hold {cap.kv_tokens:,} tokens, all the agents can reuse "
                f"({working_set:,}): a host tier would serve nothing"
            )
            pruned.append(Pruned(c, "host tier idle", detail, cap.user_tok_s_alone))
        else:
            survivors.append(c)
    return survivors, pruned
