"""`kvmesh sim --workload agentic --agents N --duration S`: the closed loop of coding agents
(kvmesh.sim.agents) through each policy on a fresh fleet, one table row per policy."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvmesh.sim.agents import AgentConfig, ClosedLoop
from kvmesh.sim.agents_report import loop_ceiling, print_loop_row, summarize_loop
from kvmesh.sim.fleet import FleetSim, FleetSimConfig


def add_agent_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("closed-loop agents (--workload agentic)")
    g.add_argument(
        "--agents",
        type=int,
        default=0,
        help="Concurrent coding agents, each running agentic sessions back to back for "
        "--duration; 0: the open workload of --sessions instead [0].",
    )
    g.add_argument(
        "--duration", type=float, default=60.0, help="Simulated seconds of --agents [60]."
    )
    g.add_argument(
        "--ramp-s",
        type=float,
        default=10.0,
        help="Agents start at uniform offsets over this many simulated seconds [10].",
    )
    g.add_argument(
        "--no-ceiling",
        action="store_true",
        help="Skip the hit-rate ceiling (its hashing costs a few seconds per million blocks).",
    )


def agent_config(args: argparse.Namespace) -> AgentConfig:
    from kvmesh.bench.cli_args import build_workload

    params = build_workload(args, "agentic", sessions=0).params  # the session shape's flags
    return AgentConfig(args.agents, args.duration, args.ramp_s, args.seed, params)


def run_agents(
    config: FleetSimConfig, spec: str, agents: AgentConfig, ceiling: bool = True
) -> tuple[str, dict]:
    """One policy (a preset name or a YAML file) over the closed loop: (label, summary)."""
    from kvmesh.engine.tokenizer import load_tokenizer

    name = policy = spec
    if spec.endswith((".yaml", ".yml")):
        policy, name = Path(spec).read_text(), Path(spec).stem
    config = replace(config, measure_known=False)  # the loop reports no "lost to routing"
    sim = FleetSim(config, policy, load_tokenizer(config.engine.model)[0])
    loop = ClosedLoop(sim, agents)
    t0 = time.perf_counter()
    loop.run()
    wall = time.perf_counter() - t0
    value = loop_ceiling(loop, config.engine.block_size) if ceiling else None
    summary = summarize_loop(loop, value)
    summary["sim_wall_s"] = round(wall, 1)
    summary["wall_s_per_sim_min"] = round(wall / (agents.duration / 60), 1)
    summary["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return name, summary


def main(args: argparse.Namespace, config: FleetSimConfig, specs: list[str]) -> int:
    try:
        agents = agent_config(args)
    except ValueError as exc:
        print(f"kvmesh sim: {exc}", file=sys.stderr)
        return 2
    print(f"{agents.agents} agents for {agents.duration:g} simulated s, {config.engines} engines")
    results: dict = {"agents": agents.agents, "duration_s": agents.duration, "policies": {}}
    for spec in specs:
        name, summary = run_agents(config, spec, agents, not args.no_ceiling)
        print_loop_row(name, summary)
        results["policies"][name] = summary
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.output}")
    return 0
