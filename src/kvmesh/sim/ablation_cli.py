"""`kvmesh sim --workload agentic --agents N --ablation`: run each row of kvmesh.sim.ablation on
the same closed loop, print one table and the full stack's cost per token beside commercial API
list prices (kvmesh.sim.cost), and with --output write the JSON and plots of both."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from kvmesh.sim.ablation import TP_REPLICA, Variant, prefill_share, variants
from kvmesh.sim.ablation_jobs import default_jobs, in_order
from kvmesh.sim.agent_args import add_cost_args  # noqa: F401 - the flag's home; API here too
from kvmesh.sim.agents_cli import agent_config, run_agents
from kvmesh.sim.cost import FleetCost, api_comparison, fleet_cost, format_cost_table, plot_cost
from kvmesh.sim.cost import load_price_table as price_table
from kvmesh.sim.fleet import FleetSimConfig


def gpu_price(given: float | None, gpu: str) -> tuple[float, str]:
    """(USD per GPU-hour, where it comes from)."""
    if given is not None:
        if not given > 0:
            raise ValueError(f"--gpu-hour-price must be > 0, got {given}")
        return given, "--gpu-hour-price"
    prices = {name.lower(): entry for name, entry in price_table().gpu_hour.items()}
    entry = prices.get(gpu.lower())
    note = ""
    if entry is None:
        entry = prices.get("h100")
        note = f"no {gpu} price in the price file: the H100 one, "
    if entry is None:
        raise ValueError("the price file has no GPU-hour price: give --gpu-hour-price")
    return entry.usd_per_gpu_hour, f"{note}{entry.basis} ({entry.source})"


def run_cost(config: FleetSimConfig, summary: dict, usd_per_gpu_hour: float) -> FleetCost | None:
    """The run's cost per token (None when it produced no tokens)."""
    from kvmesh.engine.emulation.latency import ACCELERATORS, MODELS

    minutes = summary["duration_s"] / 60
    inputs = round(summary["input_tok_per_min"] * minutes)
    outputs = round(summary["output_tok_per_min"] * minutes)
    if inputs < 1 or outputs < 1:
        return None
    cached = min(inputs, round(summary["hit_rate"] * inputs))
    gpus = config.num_gpus
    gpu, model = ACCELERATORS[config.emulation.emulate_gpu], MODELS[config.emulation.emulate_model]
    flops = gpu.fp8_flops if model.bytes_per_param <= 1 and gpu.fp8_flops else gpu.peak_flops
    busy = summary["gpu_busy"] * gpus * summary["duration_s"]
    share = prefill_share(inputs - cached, busy, model.active_params, flops, gpu.mfu)
    return fleet_cost(gpus, usd_per_gpu_hour, summary["duration_s"], inputs, cached, outputs, share)


def row_text(v: Variant, s: dict | None, full: dict | None, cost: FleetCost | None) -> str:
    if s is None:
        return f"{v.name:>18}  {v.skipped}"
    ratio = s["output_tok_per_min"] / full["output_tok_per_min"] if full else 1.0
    ceiling = f"/{s['ceiling']:.2f}" if "ceiling" in s else ""
    money = f"  ${cost.usd_per_m_output:.3f}/M out" if cost else ""
    return (
        f"{v.name:>18}  out {s['output_tok_per_min']:>12,} tok/min ({ratio:4.2f}x)"
        f"  hit {s['hit_rate']:.3f}{ceiling}  preempt {s['preemptions']:>5}"
        f"  TTFT p50/p90 {s['ttft_ms_p50']:>6.0f}/{s['ttft_ms_p90']:<6.0f}ms"
        f"  user {s['user_tok_s_p50']:>4.0f} tok/s  busy {s['gpu_busy']:.2f}{money}"
        f"  ({s.get('sim_wall_s', 0):.0f} s)"
    )


def run_ablation(args: argparse.Namespace, config: FleetSimConfig, specs: list[str]) -> int:
    """`kvmesh sim --agents N --ablation`: the closed loop of N agents, once per row."""
    try:  # a bad flag's ValueError, here or in a row's setup, is a usage error
        agents = agent_config(args)
        if len(args.agents) > 1:
            raise ValueError("--ablation takes one --agents count")
        return main(args, config, specs, agents)
    except ValueError as exc:
        print(f"kvmesh sim: {exc}", file=sys.stderr)
        return 2


def main(args: argparse.Namespace, config: FleetSimConfig, specs: list[str], agents) -> int:
    from kvmesh.sim.fleet_args import engine_flags

    usd, price_from = gpu_price(args.gpu_hour_price, config.emulation.emulate_gpu)
    rows = variants(
        specs[0], args.serve_args, config.layout, engine_flags(args), config.prefill_gpus,
        config.kv_peer_min_cached_token_delta,
    )  # fmt: skip
    gpus = config.num_gpus
    print(
        f"ablation: {agents.agents} agents for {agents.duration:g} simulated s, "
        f"{config.describe()}; ${usd:.2f}/GPU-hour from {price_from}",
        flush=True,
    )
    results: dict = {"agents": agents.agents, "duration_s": agents.duration, "gpus": gpus,
                     "gpu_hour_usd": usd, "rows": []}  # fmt: skip
    assumed = drafter_assumption(config)
    if assumed is not None:
        print(assumed[0], flush=True)
        results["spec_acceptance"] = assumed[1]
    full: dict | None = None
    full_cost: FleetCost | None = None
    fleets: list[FleetSimConfig | None] = []
    for k, v in enumerate(rows):
        cfg = None
        if not v.skipped:
            try:
                cfg = fleet_of(v, config, gpus)
            except ValueError as exc:  # e.g. no TP replica of the model fits these GPUs
                rows[k] = replace(v, skipped=str(exc))
        fleets.append(cfg)
    runs = [k for k, cfg in enumerate(fleets) if cfg is not None]
    jobs = args.jobs if args.jobs is not None else default_jobs(len(runs))
    ceiling = not args.no_ceiling
    calls = [(fleets[k], rows[k].policy, agents, ceiling, jobs <= 1) for k in runs]
    summaries = in_order(run_row, calls, [rows[k].name.strip() for k in runs], jobs)
    for v, cfg in zip(rows, fleets, strict=True):
        summary = cost = None
        if cfg is not None:
            summary = next(summaries)[1]
            cost = run_cost(cfg, summary, usd)
            if full is None:
                full, full_cost = summary, cost
        print(row_text(v, summary, full, cost), flush=True)
        results["rows"].append(
            {
                "name": v.name,
                "off": v.off,
                "policy": v.policy,
                "layout": v.layout,
                "skipped": v.skipped,
                "summary": summary,
                "cost": None if cost is None else _cost_dict(cost),
            }  # fmt: skip
        )
    comparisons = []
    if full_cost is not None:
        table = price_table()
        comparisons = api_comparison(full_cost, table)
        print("\nfull stack, cost per token:\n" + format_cost_table(full_cost, comparisons, table))
        results["api_comparison"] = [
            {"api": f"{c.api.provider} {c.api.model}", "usd": round(c.api_usd, 2),
             "ratio": round(c.ratio, 2)} for c in comparisons
        ]  # fmt: skip
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(results, indent=1))
        stem = args.output.removesuffix(".json")
        plot_ablation(stem + ".png", results["rows"])
        written = [args.output, stem + ".png"]
        if full_cost is not None:
            written.append(str(plot_cost(full_cost, comparisons, stem + "-cost.png")))
        print("wrote " + ", ".join(written))
    return 0


def drafter_assumption(config: FleetSimConfig) -> tuple[str, list[float]] | None:
    """With a model drafter (MTP, EAGLE, a draft model): the line saying what its drafts are
    assumed to be worth, and the rates; None without one (or with prompt lookup, which is
    checked against the output stream rather than assumed)."""
    from kvmesh.engine.emulation.spec import (
        MODEL_DRAFTERS,
        expected_tokens_per_step,
        parse_acceptance,
    )

    spec = config.engine.speculative()
    if spec is None or spec.method not in MODEL_DRAFTERS:
        return None
    rates = parse_acceptance(config.emulation.emulate_spec_acceptance)
    k = spec.num_speculative_tokens or 1
    per_step = expected_tokens_per_step(rates, k)
    line = (
        f"assumed: {spec.method} drafts ({k}) accepted per position at "
        f"{', '.join(f'{r:g}' for r in rates)} (--emulate-spec-acceptance), "
        f"{per_step:.2f} tokens per step; the - MTP row restates it"
    )
    return line, list(rates)


def run_row(config: FleetSimConfig, policy: str, agents, ceiling: bool, progress_bar: bool) -> dict:
    """One row's run (in a process of its own when rows run in parallel): its summary."""
    return run_agents(config, policy, agents, ceiling, progress_bar)[1]


def fleet_of(v: Variant, config: FleetSimConfig, gpus: int) -> FleetSimConfig:
    """The row's fleet on the same GPUs; a TP replica row takes the smallest TP size (8, 16,
    32) whose replica holds the model's weights."""
    from kvmesh.sim.fleet_args import fleet_config

    def build(layout: str) -> FleetSimConfig:
        return fleet_config(
            v.serve_args, config.engines, config.scrape_interval, config.seed, layout, gpus,
            v.engine_flags, v.prefill_gpus, v.peer_delta,
        )  # fmt: skip

    if v.layout != TP_REPLICA:
        return build(v.layout)
    errors = []
    for n in (8, 16, 32):
        try:
            return build(f"tp{n}")
        except ValueError as exc:
            errors.append(f"tp{n}: {exc}")
    raise ValueError("no TP replica fits: " + "; ".join(errors))


def _cost_dict(c: FleetCost) -> dict:
    return {
        "total_usd": round(c.total_usd, 2),
        "usd_per_m_input": round(c.usd_per_m_input, 4),
        "usd_per_m_output": round(c.usd_per_m_output, 4),
        "usd_per_m_blended": round(c.usd_per_m_blended, 4),
        "prefill_share": round(c.prefill_share, 4),
    }


def plot_ablation(path: str, rows: list[dict]) -> None:
    """Bars per run row: output tok/min and hit rate (rows not run are left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r["summary"] is not None]
    names = [r["name"] for r in ran]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.0, 1.3 * len(ran)), 6.5), sharex=True)
    top.bar(names, [r["summary"]["output_tok_per_min"] / 1e6 for r in ran], color="tab:blue")
    top.set_ylabel("output tokens / min (M)")
    top.set_title("ablation: the full stack, then each technique off")
    bottom.bar(names, [r["summary"]["hit_rate"] for r in ran], color="tab:green")
    bottom.set_ylabel("prefix hit rate")
    bottom.set_ylim(0, 1)
    for ax in (top, bottom):
        ax.grid(axis="y", alpha=0.3)
    bottom.tick_params(axis="x", labelsize=8, rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
