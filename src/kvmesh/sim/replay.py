"""`kvmesh sim`: replay a Mooncake-format trace, or run the agentic or shared-prefix workload,
through routing policies in virtual time.

Every policy sees the same requests on a fresh fleet of emulated engines (the real engine core,
a roofline step time, no HTTP), and the table compares them: hit rate against the trace's
ceiling, TTFT percentiles and per-engine load, the figures `kvmesh bench fleet --workload trace`
measures over HTTP, in a fraction of its time.

  kvmesh sim --trace ../shared/traces/mooncake_conversation_trace.jsonl --engines 4 \\
      --policies round-robin,kvmesh
  kvmesh sim --workload agentic --engines 8 --sessions 32 --repos 16 --repo-tokens 6000 \\
      --tool-tokens 1200 --turns 12 --session-rate 0.8 --policies round-robin,kvmesh
  kvmesh sim --workload agentic --agents 400 --duration 60 --engines 32 --policies kvmesh
  kvmesh sim --workload agentic --agents 3000 --duration 600 --layout dp32 --gpus 544 \\
      --emulate-gpu h100 --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

# Only flag modules and light helpers at module level: `kvmesh sim --help` builds its parser from
# this module, and the simulator (engine cores, router, numpy) loads when a run starts.
from kvmesh.bench.cli_args import DEFAULT_TRACE, add_workload_params, build_workload
from kvmesh.protocol.wording import noun_for, plural
from kvmesh.sim.agent_args import add_agent_args
from kvmesh.sim.fleet_args import add_fleet_args, engine_flags, fleet_config, kv_move_flags
from kvmesh.sim.requests import (  # noqa: F401 - trace_requests is this module's API too
    hit_ceiling,
    load_requests,
    trace_requests,
    workload_requests,
)

if TYPE_CHECKING:
    from kvmesh.sim.fleet import FleetSimConfig, SimRecord


def summarize(records: list[SimRecord], engines: int) -> dict:
    from kvmesh.protocol.stats import percentile

    done = [r for r in records if r.first_token is not None]
    ttft = [r.ttft * 1e3 for r in done]
    load = [0] * engines
    for r in records:
        load[r.engine] += 1
    mean = sum(load) / engines if engines else 0
    prompt = sum(r.prompt_tokens for r in done)
    span = max((r.finished or 0.0) for r in records) if records else 0.0
    return {
        "requests": len(records),
        "unfinished": sum(r.finished is None for r in records),
        "refused": sum(r.refused for r in records),  # past the engine's context: its 400
        "hit_rate": round(sum(r.cached_tokens for r in done) / prompt, 4) if prompt else 0.0,
        **{f"ttft_ms_p{q}": round(percentile(ttft, q), 1) for q in (50, 90, 99)},
        "ttft_ms_mean": round(sum(ttft) / len(ttft), 1) if ttft else 0.0,
        "output_tok_s": round(sum(r.output_tokens for r in records) / span, 1) if span else 0.0,
        # prompt share the router knew was cached elsewhere than where it sent the request
        "lost_to_routing": round(
            sum(r.best_known_tokens - r.chosen_known_tokens for r in records) / prompt, 4
        )
        if prompt
        else 0.0,
        "load": load,
        "load_max_mean": round(max(load) / mean, 3) if mean else 0.0,
    }


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        choices=("trace", "agentic", "shared-prefix"),
        default="trace",
        help="Replay --trace, or generate the benchmark workload of that name from the flags "
        "below, as `kvmesh bench fleet --workload` does [default: trace].",
    )
    p.add_argument(
        "--trace", default=DEFAULT_TRACE, help=f"Mooncake-format JSONL trace [{DEFAULT_TRACE}]."
    )
    p.add_argument(
        "--engines",
        type=int,
        default=4,
        help="Emulated engines, or with --layout instances [default: 4].",
    )
    add_fleet_args(p.add_argument_group("fleet of MoE instances, emulated model and GPU"))
    p.add_argument(
        "--policies",
        default="round-robin,kvmesh",
        help="Comma-separated router presets or EndpointPickerConfig YAML files "
        "[default: round-robin,kvmesh].",
    )
    p.add_argument("--limit", type=int, default=0, help="Replay the first N requests (0: all).")
    p.add_argument("--start", type=int, default=0, help="Skip the first N requests.")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="Multiply the trace's arrival offsets (0.5: twice the rate) [default: 1].",
    )
    p.add_argument(
        "--serve-args",
        default="",
        help='Engine flags as for `kvmesh serve --emulate`, e.g. "--kv-offloading-size 256".',
    )
    p.add_argument("--scrape-interval", type=float, default=0.1, help="Router scrape period, s.")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Seed of the pickers' tie-breaks and of a generated workload [default: 0].",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="Policies replayed (or --ablation rows run) at once, one process each "
        "[policies: 1; --ablation: one per core].",
    )
    p.add_argument(
        "--output", default="", help="Write the results as JSON here, and a PNG beside it."
    )
    add_workload_params(p.add_argument_group("workload"), ("agentic", "shared-prefix"))
    add_agent_args(p)


_configs = fleet_config  # the fleet of the flags (the tests build theirs through it)


def run_policy(
    config: FleetSimConfig, spec: str, source: tuple | list, progress: bool = False
) -> tuple[str, dict, list[SimRecord]]:
    """One policy over the requests (see `load_requests`) on a fresh fleet: (label, summary,
    records)."""
    from tqdm import tqdm

    from kvmesh.engine.tokenizer import load_tokenizer
    from kvmesh.sim.fleet import FleetSim
    from kvmesh.sim.quiet import collector_off

    name = policy = spec
    if spec.endswith((".yaml", ".yml")):  # an EndpointPickerConfig, labelled by its stem
        with open(spec) as f:
            policy = f.read()
        name = Path(spec).stem
    requests = load_requests(source)
    tokenizer = load_tokenizer(config.engine.model)[0]
    show = progress and sys.stderr.isatty()
    with collector_off():
        sim = FleetSim(config, policy, tokenizer)
        t0 = time.perf_counter()
        bar = tqdm(
            total=len(requests), desc=name, unit="req", leave=False, mininterval=5, disable=not show
        )
        with bar:
            records = sim.run(requests, lambda n: bar.update(n - bar.n))
    summary = summarize(records, len(sim.engines))
    summary["sim_wall_s"] = round(time.perf_counter() - t0, 1)
    return name, summary, records


def _print_row(name: str, s: dict) -> None:
    print(
        f"{name:>14}  hit {s['hit_rate']:.3f}  TTFT p50/p90/p99 {s['ttft_ms_p50']:.0f}/"
        f"{s['ttft_ms_p90']:.0f}/{s['ttft_ms_p99']:.0f} ms  out {s['output_tok_s']:.0f} tok/s"
        f"  load max/mean {s['load_max_mean']:.2f}  lost to routing {s['lost_to_routing']:.3f}"
        f"  ({s['sim_wall_s']:.0f} s)",
        flush=True,
    )


def main(args: argparse.Namespace) -> int:
    try:
        config = _configs(
            args.serve_args,
            args.engines,
            args.scrape_interval,
            args.seed,
            args.layout,
            args.gpus,
            engine_flags(args),
            **kv_move_flags(args),
        )
    except SystemExit as exc:
        print(f"kvmesh sim: bad --serve-args: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvmesh sim: {exc}", file=sys.stderr)
        return 2
    # every emulated engine (hundreds of ranks) would log the same build lines: once is the
    # fleet's description; --log-level debug keeps them
    builder = logging.getLogger("kvmesh.engine.builder")
    if not builder.isEnabledFor(logging.DEBUG):
        builder.setLevel(logging.WARNING)
    specs = [p for p in args.policies.split(",") if p]
    for spec in specs:
        if spec.endswith((".yaml", ".yml")) and not Path(spec).is_file():
            print(f"kvmesh sim: no such policy file {spec}", file=sys.stderr)
            return 2
    if args.agents:
        if args.workload != "agentic":
            print("kvmesh sim: --agents needs --workload agentic", file=sys.stderr)
            return 2
        if args.ablation:
            from kvmesh.sim import ablation_cli

            return ablation_cli.run_ablation(args, config, specs)
        from kvmesh.sim import agents_cli

        return agents_cli.main(args, config, specs)
    if args.ablation:
        print("kvmesh sim: --ablation runs the closed loop: give --agents N", file=sys.stderr)
        return 2
    if args.workload == "trace":
        if not Path(args.trace).is_file():
            print(f"kvmesh sim: no such trace {args.trace}", file=sys.stderr)
            return 2
        source: tuple | list = (args.trace, args.limit, args.start, args.time_scale)
        what = f"{args.limit or 'all'} {noun_for(args.limit or 0, 'request')} of {args.trace}"
    else:
        source = workload_requests(build_workload(args, args.workload))
        what = f"{plural(len(source), 'request')} of the {args.workload} workload"
    requests = load_requests(source)
    ceiling = hit_ceiling(requests, config.engine.block_size)
    del requests
    print(f"{what}, {config.describe()}; hit-rate ceiling {ceiling:.3f}")
    results: dict = {"ceiling": round(ceiling, 4), "policies": {}}
    runs: dict[str, list[SimRecord]] = {}
    if (args.jobs or 1) > 1 and len(specs) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(args.jobs, len(specs))) as pool:
            futures = [pool.submit(run_policy, config, spec, source) for spec in specs]
            done = [f.result() for f in futures]
    else:
        done = (run_policy(config, spec, source, progress=True) for spec in specs)
    for name, summary, records in done:
        _print_row(name, summary)
        results["policies"][name] = summary
        runs[name] = records
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
        from kvmesh.sim.plot import plot_policies

        png = args.output.removesuffix(".json") + ".png"
        plot_policies(png, runs, results["policies"], ceiling)
        print(f"wrote {args.output} and {png}")
    return 0
