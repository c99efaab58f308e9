"""`kvmesh plan`: the cheapest fleets that give N agents a TTFT p90 and a per-user decode speed,
found by simulating the real router and engine schedulers (`kvmesh sim --agents`).

Candidate fleets (dense TP sizes or MoE tpN / dpN instances, fleet size, aggregated or P/D at a
1/4, 1/3 or 1/2 prefill share, routing preset, host tier, MTP where the model has MTP layers) are
pruned with the roofline cost model first (over budget; one sequence alone slower than the
target; decode capacity at the target speed below the agents' demand), and the survivors are
simulated in parallel processes, whole GPU counts at a time, cheapest first.

  kvmesh plan --agents 40 --workload agentic --ttft-p90 2 --user-tok-s 60 --max-gpus 8
  kvmesh plan --agents 60 --ttft-p90 5 --user-tok-s 30 --model glm-5.2-moe --max-gpus 32 \\
      --output bench-results/plan
"""

from __future__ import annotations

import argparse

from kvmesh.engine.emulation.latency import ACCELERATORS, MODELS


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agents", type=int, required=True, help="Concurrent coding agents.")
    p.add_argument(
        "--workload",
        default="agentic",
        help="Session shape of the agents: agentic (the generator's defaults, 120-token "
        "answers) or seed (1,000-token answers) [agentic].",
    )
    p.add_argument("--ttft-p90", type=float, required=True, help="TTFT p90 target, seconds.")
    p.add_argument(
        "--user-tok-s",
        type=float,
        required=True,
        help="Per-user decode speed target: the median request's tokens/s after its first.",
    )
    p.add_argument(
        "--model",
        default="llama-3.1-8b",
        choices=sorted(MODELS),
        help="Emulated model [llama-3.1-8b].",
    )
    p.add_argument(
        "--gpu", default="h100", choices=sorted(ACCELERATORS), help="Emulated GPU [h100]."
    )
    p.add_argument(
        "--budget", type=float, default=0.0, help="Most USD per hour for the fleet (0: none) [0]."
    )
    p.add_argument("--max-gpus", type=int, default=16, help="Largest fleet considered [16].")
    p.add_argument(
        "--gpu-hour-price",
        type=float,
        default=None,
        help="USD per GPU-hour [default: the price file's public rate for --gpu].",
    )
    p.add_argument(
        "--policies",
        default="kvmesh",
        help="Router presets of aggregated fleets, comma-separated (kvmesh, round-robin, "
        "...); P/D fleets run pd [kvmesh].",
    )
    p.add_argument(
        "--host-tier-gib",
        type=int,
        default=64,
        help="Host DRAM KV tier per engine or DP rank of the 'host tier on' candidates "
        "(--kv-offloading-size); 0: no such candidates [64].",
    )
    p.add_argument("--no-pd", action="store_true", help="Leave P/D splits out.")
    p.add_argument(
        "--emulate-spec-acceptance",
        default="0.8,0.7,0.6",
        help="MTP drafts' acceptance per position, as `kvmesh serve` takes it [0.8,0.7,0.6].",
    )
    p.add_argument(
        "--duration", type=float, default=60.0, help="Simulated seconds per candidate [60]."
    )
    p.add_argument(
        "--ramp-s", type=float, default=10.0, help="Agents start over this many seconds [10]."
    )
    p.add_argument("--seed", type=int, default=0, help="Seed of the agents and pickers [0].")
    p.add_argument("--top", type=int, default=3, help="Plans to print [3].")
    p.add_argument(
        "--jobs", type=int, default=None, help="Candidates simulated at once [one per core]."
    )
    p.add_argument(
        "--output", default="", help="Write plan.json, plan.png and values.yaml in this folder."
    )


def main(args: argparse.Namespace) -> int:
    from kvmesh.plan.run import run_plan

    return run_plan(args)
