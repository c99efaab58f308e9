"""`kvmesh plan` from its parsed flags: enumerate, prune, simulate, report, write."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from collections import Counter
from pathlib import Path

from kvmesh.plan.candidates import PD_POLICY, Candidate, enumerate_candidates
from kvmesh.plan.capacity import prune
from kvmesh.plan.outputs import plot_plans, values_text
from kvmesh.plan.results import PlanResult, binding_constraint, cheapest, format_table, judge
from kvmesh.plan.search import Search
from kvmesh.plan.targets import Targets, Workload
from kvmesh.sim.agents import AgentConfig
from kvmesh.sim.fleet import FleetSimConfig


def run_plan(args: argparse.Namespace) -> int:
    from kvmesh.sim.ablation_cli import gpu_price, run_cost

    try:
        targets = Targets(args.agents, args.ttft_p90, args.user_tok_s, args.budget, args.max_gpus)
        workload = Workload.preset(args.workload)
        usd, price_from = gpu_price(args.gpu_hour_price, args.gpu)
        agents = AgentConfig(args.agents, args.duration, args.ramp_s, args.seed, workload.params)
    except ValueError as exc:
        print(f"kvmesh plan: {exc}", file=sys.stderr)
        return 2
    from kvmesh.router.pipeline import PRESETS

    policies = tuple(p for p in args.policies.split(",") if p)
    unknown = [p for p in policies if p not in PRESETS or p == PD_POLICY]
    if not policies or unknown:
        aggregated = sorted(set(PRESETS) - {PD_POLICY})
        print(f"kvmesh plan: --policies takes router presets of {aggregated}", file=sys.stderr)
        return 2
    acceptance = args.emulate_spec_acceptance
    print(
        f"plan: {args.agents} agents ({args.workload}: {workload.answer_tokens}-token answers, "
        f"{workload.think_s:g} s think time, ~{workload.mean_context_tokens():,}-token "
        f"contexts), TTFT p90 <= {args.ttft_p90:g} s, >= {args.user_tok_s:g} tok/s per user; "
        f"{args.model} on {args.gpu} at ${usd:.2f}/GPU-hour ({price_from})",
        flush=True,
    )
    candidates = enumerate_candidates(
        args.model, args.gpu, args.max_gpus, policies, args.host_tier_gib, not args.no_pd
    )
    survivors, pruned = prune(candidates, targets, workload, args.model, args.gpu, usd, acceptance)
    rules = Counter(p.rule for p in pruned)
    why = ", ".join(f"{rule} {n}" for rule, n in rules.items()) or "none"
    print(
        f"{len(candidates)} candidate fleets of at most {args.max_gpus} GPUs; the cost model "
        f"pruned {len(pruned)} ({why}); {len(survivors)} left to simulate",
        flush=True,
    )
    configs: dict[Candidate, FleetSimConfig] = {}

    def config_of(c: Candidate) -> FleetSimConfig:
        if c not in configs:
            configs[c] = c.fleet_config(args.model, args.gpu, args.seed, acceptance)
        return configs[c]

    def judged(c: Candidate, summary: dict) -> PlanResult:
        cost = run_cost(config_of(c), summary, usd)
        return judge(c, summary, targets, c.gpus * usd, cost)

    jobs = args.jobs if args.jobs is not None else multiprocessing.cpu_count()
    search = Search(survivors, config_of, agents, judged, jobs, args.top)
    results = search.run()
    best = cheapest(results, args.top)
    print(
        f"simulated {search.runs} of the {len(survivors)} ({args.duration:g} simulated s each)",
        flush=True,
    )
    binding = ""
    if best:
        print(f"the {len(best)} cheapest plans that meet the targets:")
        print(format_table(best, targets))
    else:
        binding = binding_constraint(results, pruned, targets)
        print(f"no plan meets the targets: {binding}")
    print(
        "assumed: the emulated model and GPU's roofline; the workload preset's session shape; "
        f"${usd:.2f}/GPU-hour with host DRAM included"
        + (f"; MTP acceptance {acceptance} per draft position" if any(c.mtp for c in candidates)
           else "")
    )  # fmt: skip
    if args.output:
        write_outputs(Path(args.output), args, targets, results, best, pruned, binding)
    return 0 if best else 1


def write_outputs(
    folder: Path,
    args: argparse.Namespace,
    targets: Targets,
    results: list[PlanResult],
    best: list[PlanResult],
    pruned: list,
    binding: str,
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "targets": {
            "agents": targets.agents,
            "ttft_p90_s": targets.ttft_p90_s,
            "user_tok_s": targets.user_tok_s,
            "budget_usd_per_hour": targets.budget_usd_per_hour,
            "max_gpus": targets.max_gpus,
        },
        "model": args.model,
        "gpu": args.gpu,
        "workload": args.workload,
        "duration_s": args.duration,
        "plans": [r.to_dict() for r in best],
        "binding_constraint": binding,
        "simulated": [r.to_dict() for r in results],
        "pruned": [{**p.candidate.to_dict(), "rule": p.rule, "detail": p.detail} for p in pruned],
    }
    written = [folder / "plan.json", folder / "plan.png"]
    written[0].write_text(json.dumps(data, indent=1))
    plot_plans(written[1], results, best, targets)
    if best:
        written.append(folder / "values.yaml")
        written[2].write_text(values_text(best[0], args.model, args.gpu))
    print("wrote " + ", ".join(map(str, written)))
