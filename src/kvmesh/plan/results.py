"""A simulated candidate judged against the targets: its figures, cost, margins; the table of
the cheapest plans that meet them, and the binding constraint when none does."""

from __future__ import annotations

from typing import NamedTuple

from kvmesh.plan.candidates import Candidate
from kvmesh.plan.capacity import Pruned
from kvmesh.plan.targets import Targets


class PlanResult(NamedTuple):
    candidate: Candidate
    summary: dict  # kvmesh.sim.agents_report.summarize_loop's
    usd_per_hour: float
    usd_per_m_input: float | None  # None: the run produced no tokens of that kind
    usd_per_m_output: float | None
    ttft_margin_s: float  # target - TTFT p90 (>= 0: met)
    user_margin_tok_s: float  # per-user p50 - target (>= 0: met)

    @property
    def meets(self) -> bool:
        return self.ttft_margin_s >= 0 and self.user_margin_tok_s >= 0

    @property
    def ttft_p90_s(self) -> float:
        return self.summary["ttft_ms_p90"] / 1e3

    @property
    def user_tok_s(self) -> float:
        return self.summary["user_tok_s_p50"]

    def shortfall(self, targets: Targets) -> float:
        """How far the worse of the two targets is missed, as a ratio (<= 1: both met)."""
        ttft = self.ttft_p90_s / targets.ttft_p90_s
        speed = targets.user_tok_s / self.user_tok_s if self.user_tok_s > 0 else float("inf")
        return max(ttft, speed)

    def to_dict(self) -> dict:
        s = self.summary
        return {
            **self.candidate.to_dict(),
            "techniques": self.candidate.techniques(),
            "meets": self.meets,
            "usd_per_hour": round(self.usd_per_hour, 2),
            "usd_per_m_input": _round(self.usd_per_m_input),
            "usd_per_m_output": _round(self.usd_per_m_output),
            "output_tok_per_min": s["output_tok_per_min"],
            "ttft_p50_s": s["ttft_ms_p50"] / 1e3,
            "ttft_p90_s": s["ttft_ms_p90"] / 1e3,
            "user_tok_s_p50": s["user_tok_s_p50"],
            "preemptions": s["preemptions"],
            "hit_rate": s["hit_rate"],
            "ttft_margin_s": round(self.ttft_margin_s, 3),
            "user_margin_tok_s": round(self.user_margin_tok_s, 1),
            "summary": s,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def judge(
    candidate: Candidate, summary: dict, targets: Targets, usd_per_hour: float, cost
) -> PlanResult:
    """`cost`: the run's kvmesh.sim.cost.FleetCost, or None."""
    return PlanResult(
        candidate,
        summary,
        usd_per_hour,
        None if cost is None else cost.usd_per_m_input,
        None if cost is None else cost.usd_per_m_output,
        targets.ttft_p90_s - summary["ttft_ms_p90"] / 1e3,
        summary["user_tok_s_p50"] - targets.user_tok_s,
    )


def cheapest(results: list[PlanResult], top: int) -> list[PlanResult]:
    """The `top` cheapest results that meet the targets; at equal cost the simpler fleet (no
    host tier, no MTP, aggregated) first, then the larger margins."""
    met = [r for r in results if r.meets]
    met.sort(
        key=lambda r: (
            r.usd_per_hour,
            r.candidate.host_tier_gib > 0,
            r.candidate.mtp,
            r.candidate.prefill_units > 0,
            -r.ttft_margin_s,
            -r.user_margin_tok_s,
        )
    )
    return met[:top]


def binding_constraint(results: list[PlanResult], pruned: list[Pruned], targets: Targets) -> str:
    """Why no plan meets the targets: what the closest simulated fleet of the most GPUs missed,
    or, when nothing was simulated, what the cost model pruned the largest fleet for."""
    where = f"--max-gpus {targets.max_gpus}"
    if targets.budget_usd_per_hour:
        where += f" and --budget ${targets.budget_usd_per_hour:,.2f}/h"
    if results:
        largest = max(r.candidate.gpus for r in results)
        best = min(
            (r for r in results if r.candidate.gpus == largest), key=lambda r: r.shortfall(targets)
        )
        missed = []
        if best.ttft_margin_s < 0:
            missed.append(f"TTFT p90 {best.ttft_p90_s:.3g} s (target {targets.ttft_p90_s:g} s)")
        if best.user_margin_tok_s < 0:
            missed.append(
                f"per-user decode {best.user_tok_s:.0f} tok/s (target {targets.user_tok_s:g})"
            )
        return (
            f"{' and '.join(missed)} at the largest fleet simulated within {where}: "
            f"{best.candidate.label()}"
        )
    if not pruned:
        return f"no fleet of this model on this GPU fits within {where}"
    largest = max(p.candidate.gpus for p in pruned)
    worst = [p for p in pruned if p.candidate.gpus == largest]
    rules = [p for p in worst if p.rule != "budget"] or worst
    # the nearest miss: the fastest layout, then the simplest fleet of it
    p = min(rules, key=lambda p: (-p.user_tok_s_alone, len(p.candidate.techniques())))
    return f"{p.rule}: {p.detail}, at {p.candidate.label()}, the largest fleet within {where}"


def format_table(results: list[PlanResult], targets: Targets) -> str:
    head = (
        f"{'#':>2}  {'GPUs':>4}  {'layout':<26}{'techniques':<42}{'out tok/min':>12}"
        f"  {'TTFT p50/p90 s':>14}  {'user tok/s':>10}  {'preempt':>7}  {'$/h':>8}"
        f"  {'$/M in':>7}  {'$/M out':>7}  margin TTFT / tok/s"
    )
    lines = [head]
    for i, r in enumerate(results, 1):
        s, c = r.summary, r.candidate
        money_in = "-" if r.usd_per_m_input is None else f"{r.usd_per_m_input:.3f}"
        money_out = "-" if r.usd_per_m_output is None else f"{r.usd_per_m_output:.3f}"
        ttft = f"{s['ttft_ms_p50'] / 1e3:.2f}/{s['ttft_ms_p90'] / 1e3:.2f}"
        margins = (
            f"{r.ttft_margin_s:+.2f} s ({r.ttft_margin_s / targets.ttft_p90_s:+.0%}) / "
            f"{r.user_margin_tok_s:+.0f} ({r.user_margin_tok_s / targets.user_tok_s:+.0%})"
        )
        lines.append(
            f"{i:>2}  {c.gpus:>4}  {c.shape():<26}{c.techniques():<42}"
            f"{s['output_tok_per_min']:>12,}  {ttft:>14}  {r.user_tok_s:>10.0f}"
            f"  {s['preemptions']:>7}  {r.usd_per_hour:>8.2f}  {money_in:>7}  {money_out:>7}"
            f"  {margins}"
        )
    return "\n".join(lines)
