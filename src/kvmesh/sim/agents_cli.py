"""`kvmesh sim --workload agentic --agents N --duration S`: the closed loop of coding agents
(kvmesh.sim.agents) through each policy on a fresh fleet, one table row per policy.

`--agents N1,N2,...` sweeps: every policy at each count (same seed), one table per policy with a
row per count and the knee (the smallest count whose run preempted), and with `--output` the
points in the JSON and a plot of them beside it."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from kvmesh.protocol.wording import noun_for, plural
from kvmesh.sim.agent_args import (  # noqa: F401 - the flags are this module's API too
    add_agent_args,
    agent_counts,
)
from kvmesh.sim.agents import AgentConfig, ClosedLoop
from kvmesh.sim.agents_report import knee, loop_ceiling, print_knee, print_loop_row, summarize_loop
from kvmesh.sim.fleet import FleetSim, FleetSimConfig
from kvmesh.sim.quiet import collector_off


def agent_config(args: argparse.Namespace, agents: int | None = None) -> AgentConfig:
    """The loop of `agents` agents (default: the first of --agents) and the session flags."""
    from kvmesh.bench.cli_args import build_workload

    params = build_workload(args, "agentic", sessions=0).params  # the session shape's flags
    count = args.agents[0] if agents is None else agents
    return AgentConfig(count, args.duration, args.ramp_s, args.seed, params)


def run_agents(
    config: FleetSimConfig,
    spec: str,
    agents: AgentConfig,
    ceiling: bool = True,
    progress_bar: bool = True,
) -> tuple[str, dict]:
    """One policy (a preset name or a YAML file) over the closed loop: (label, summary); a
    progress bar on stderr when it is a terminal (unless progress_bar is False)."""
    from kvmesh.engine.tokenizer import load_tokenizer

    name = policy = spec
    if spec.endswith((".yaml", ".yml")):
        policy, name = Path(spec).read_text(), Path(spec).stem
    config = replace(config, measure_known=False)  # the loop reports no "lost to routing"
    tokenizer = load_tokenizer(config.engine.model)[0]
    show = progress_bar and sys.stderr.isatty()  # simulated seconds done, against wall time
    with collector_off():
        sim = FleetSim(config, policy, tokenizer)
        loop = ClosedLoop(sim, agents)
        t0 = time.perf_counter()
        bar = tqdm(total=agents.duration, desc=name, unit="sim s", leave=False, disable=not show)
        with bar:
            loop.run(lambda now: bar.update(min(now, agents.duration) - bar.n))
    wall = time.perf_counter() - t0
    value = loop_ceiling(loop, config.engine.block_size) if ceiling else None
    summary = summarize_loop(loop, value)
    summary["sim_wall_s"] = round(wall, 1)
    summary["wall_s_per_sim_min"] = round(wall / (agents.duration / 60), 1)
    summary["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if config.layout:  # "engines" counts endpoints (ranks); GPU busy is each GPU's share
        summary.update(layout=config.layout, instances=config.engines, gpus=config.num_gpus)
    return name, summary


def main(args: argparse.Namespace, config: FleetSimConfig, specs: list[str]) -> int:
    try:
        agents = agent_config(args)
    except ValueError as exc:
        print(f"kvmesh sim: {exc}", file=sys.stderr)
        return 2
    if len(args.agents) > 1:
        return sweep(args, config, specs)
    who = plural(agents.agents, "agent")
    print(f"{who} for {agents.duration:g} simulated s, {config.describe()}")
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


def sweep(args: argparse.Namespace, config: FleetSimConfig, specs: list[str]) -> int:
    """Every policy at each count of --agents (same seed): a table per policy, its knee."""
    counts = args.agents
    print(
        f"{','.join(map(str, counts))} {noun_for(sum(counts), 'agent')} for "
        f"{args.duration:g} simulated s, {config.describe()}"
    )
    results: dict = {
        "agents": counts,
        "duration_s": args.duration,
        "engines": config.engines,
        **({"layout": config.layout, "gpus": config.num_gpus} if config.layout else {}),
        "policies": {},
    }
    for spec in specs:
        points = []
        for i, n in enumerate(counts):
            name, summary = run_agents(config, spec, agent_config(args, n), not args.no_ceiling)
            if i == 0:
                print(f"{name}:", flush=True)
            print_loop_row(plural(n, "agent"), summary)
            points.append(summary)
        at = knee(points)
        print_knee(at, max(counts))
        results["policies"][name] = {"knee": at, "points": points}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
        from kvmesh.sim.agents_plot import plot_sweep

        png = args.output.removesuffix(".json") + ".png"
        plot_sweep(png, results["policies"])
        print(f"wrote {args.output} and {png}")
    return 0
