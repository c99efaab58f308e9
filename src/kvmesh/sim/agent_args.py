"""The flags of `kvmesh sim`'s closed loop of agents (--agents, --duration, ...) and of its
ablation and cost table (--ablation, --gpu-hour-price). Only the standard library: building the
parser (`kvmesh sim --help`) loads none of the simulator; kvmesh.sim.agents_cli and
kvmesh.sim.ablation_cli run what they ask for."""

from __future__ import annotations

import argparse


def agent_counts(text: str) -> list[int]:
    """`--agents`: one count or a comma-separated list of distinct positive counts; "0" (the
    default) is the empty list: the open workload instead."""
    parts = text.split(",")
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a count or a comma-separated list of counts"
        ) from None
    if counts == [0]:
        return []
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: every count must be at least 1")
    if len(set(counts)) < len(counts):
        raise argparse.ArgumentTypeError(f"{text!r}: a count appears twice")
    return counts


def add_agent_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("closed-loop agents (--workload agentic)")
    g.add_argument(
        "--agents",
        type=agent_counts,
        default=[],
        help="Concurrent coding agents, each running agentic sessions back to back for "
        "--duration; a comma-separated list (20,40,80) runs every policy at each count; "
        "0: the open workload of --sessions instead [0].",
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
    add_cost_args(g)


def add_cost_args(g) -> None:
    g.add_argument(
        "--ablation",
        action="store_true",
        help="With --agents N: run the full stack (the first of --policies, --layout, "
        "--speculative-config, the host tier of --serve-args, --kv-peer-min-cached-token-delta, "
        "--prefill-gpus), then each technique off in turn (routing -> round-robin, host tier, "
        "peer sharing, P/D -> the same GPUs aggregated, wide EP -> TP8 replicas, MTP), one "
        "table; "
        "and the full stack's cost per token beside commercial API list prices.",
    )
    g.add_argument(
        "--gpu-hour-price",
        type=float,
        default=None,
        help="USD per GPU-hour for the cost table [default: the price file's public rate for "
        "--emulate-gpu, else its H100 rate].",
    )
