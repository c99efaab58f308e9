"""P/D disaggregation on an emulated fleet (H100 x Llama-3.1-8B by default), in one run.

Long-prompt mode (default): the same long prompts (5,000 tokens in / 250 out at a Poisson rate, as
llm-d's P/D guide) through 4 aggregated engines behind the `kvmesh` preset and through 2 prefill +
2 decode engines behind selective P/D. Agentic mode (--workload agentic): coding-agent sessions
over long shared contexts through three configurations: never (4 aggregated), always (2P + 2D,
threshold 0) and selective (2P + 2D, disaggregate only when the decode engine lacks at least
--threshold prompt tokens). Reports TTFT, inter-token latency per token gap (where a prefill
stalls the decodes sharing its engine), e2e latency, prefix-cache hit rate, the fraction of
requests disaggregated (the router's counters) and errors; writes JSON and a PNG."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmesh.bench import cli_args
from kvmesh.bench.pd_agentic import AGENTIC, AGENTIC_QUICK, run_configurations
from kvmesh.bench.progress import BenchRun
from kvmesh.bench.workloads import Request, Workload, hit_ceiling

DEFAULT_THRESHOLD = 256  # the `pd` preset's nonCachedTokens


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        choices=("long-prompt", "agentic"),
        default="long-prompt",
        help="long-prompt [default]: --requests prompts of --prompt-words tokens at --rate, "
        "4 aggregated vs 2P+2D (80 requests: ~2 min). agentic: 16 sessions x 6 turns with "
        "sub-agent fan-outs (~190 requests, ~12-16k-token contexts, 15k output tokens) through "
        "never / always / selective P/D, in slow motion x2 (~8 min on 2 cores).",
    )
    p.add_argument("--gpu", default="h100", help="Emulated accelerator [h100].")
    p.add_argument("--model", default="llama-3.1-8b", help="Emulated model [llama-3.1-8b].")
    p.add_argument(
        "--threshold",
        type=int,
        default=DEFAULT_THRESHOLD,
        help="Selective P/D: disaggregate when the chosen decode engine lacks at least this "
        f"many prompt tokens (nonCachedTokens; 0: always) [{DEFAULT_THRESHOLD}].",
    )
    p.add_argument(
        "--emulate-time-scale",
        type=float,
        default=0.0,
        help="Slow motion: every engine step lasts K times its prediction, arrivals and think "
        "times are stretched K times and measured times divided by K (0: 2 for agentic, 1 for "
        "long-prompt and --quick) [0].",
    )
    p.add_argument("--prompt-words", type=int, default=5000, help="Long-prompt: tokens in [5000].")
    p.add_argument("--max-tokens", type=int, default=250, help="Long-prompt: tokens out [250].")
    p.add_argument("--rate", type=float, default=4.0, help="Long-prompt: requests/s, Poisson [4].")
    p.add_argument("--requests", type=int, default=80, help="Long-prompt: requests [80].")
    p.add_argument(
        "--quick", action="store_true", help="CI size: 8 short prompts, or 4 small sessions."
    )
    p.add_argument("--out", default="bench-results/pd", help="Folder for JSON and plot.")
    cli_args.add_workload_args(p, ("agentic",))  # agentic flags override AGENTIC's values
    p.epilog = (
        "Agentic workload here (the workload flags' own defaults do not apply): "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in AGENTIC.items())
    )


def long_prompts(args: argparse.Namespace) -> Workload:
    """One single-request session per prompt, Poisson arrivals; no two prompts share a block."""
    rng = random.Random(args.seed)
    reqs, at = [], 0.0
    for i in range(args.requests):
        reqs.append(Request(i, i, ((f"long{i}", args.prompt_words),), args.max_tokens, at=at))
        at += rng.expovariate(args.rate)
    params = {"prompt_tokens": args.prompt_words, "max_tokens": args.max_tokens, "rate": args.rate}
    return Workload("long-prompt", reqs, args.seed, params)


def main(args: argparse.Namespace) -> int:
    name = "pd-agentic" if args.workload == "agentic" else "pd"
    total = 3 if args.workload == "agentic" else 2  # configurations compared
    return BenchRun(name, args.out, total=total).call(_main, args)


def _main(args: argparse.Namespace, bench: BenchRun) -> int:
    agentic = args.workload == "agentic"
    if agentic:
        wl = cli_args.build_workload(args, "agentic", **(AGENTIC_QUICK if args.quick else AGENTIC))
    else:
        if args.quick:
            args.prompt_words, args.max_tokens, args.requests, args.rate = 600, 16, 8, 4.0
        wl = long_prompts(args)
    scale = args.emulate_time_scale or (2.0 if agentic and not args.quick else 1.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console() if sys.stdout.isatty() else Console(width=150)
    desc, ceiling = wl.describe(), hit_ceiling(wl.requests)
    title = (
        f"P/D, {wl.kind}: {desc['requests']} requests, {desc['prompt_tokens_mean']:.0f} tokens "
        f"in (mean), {desc['output_tokens_total']} out in all, emulated {args.model} on "
        f"{args.gpu}, threshold {args.threshold}"
        + (f", slow motion x{scale:g}" if scale != 1 else "")
    )
    console.print(f"{title}; hit-rate ceiling {ceiling['hit_rate']:.3f}")
    bench.config = {"title": title, "workload": desc, "ceiling": ceiling, "time_scale": scale}
    bench.phase("starting 4 emulated engines, then each configuration's router")
    urls, rows, notes = run_configurations(args, wl, wl.kind, args.threshold, scale, out, bench)
    for note in notes:
        console.print(f"[yellow]note[/] {note}")
    console.print(table(rows, title))
    settings = {k: v for k, v in vars(args).items() if not callable(v)}
    result = {
        "title": title,
        "settings": settings,
        "workload": desc,
        "ceiling": ceiling,
        "engines": urls,
        "time_scale": scale,
        "notes": notes,
        **rows,
    }
    name = "pd-agentic" if agentic else "pd"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    plot(rows, title, out / f"{name}.png")
    console.print(f"results: {out / f'{name}.json'}, {out / f'{name}.png'}")
    return 1 if any(s["errors"] == s["requests"] for s in rows.values()) else 0


def table(rows: dict[str, dict], title: str) -> Table:
    t = Table(title=title)
    cols = "configuration|pools|TTFT p50|TTFT p90|ITL p50|ITL p90|e2e p50|hit rate|computed"
    cols += "|disagg|errors"
    for col in cols.split("|"):
        t.add_column(col, justify="left" if col in ("configuration", "pools") else "right")
    for name, s in rows.items():
        t.add_row(
            name,
            s["pools"],
            *(f"{s[k]:.1f} ms" for k in ("ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50", "itl_ms_p90")),
            f"{s['e2e_ms_p50'] / 1000:.2f} s",
            f"{s['hit_rate']:.3f}",
            f"{s['computed_fraction']:.3f}",
            f"{s['disaggregated_fraction']:.0%}",
            str(s["errors"]),
        )
    return t


def plot(rows: dict[str, dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    for ax, key in zip(axes[:3], ("ttft", "itl", "e2e"), strict=True):
        for j, q in enumerate(("p50", "p90")):
            ax.bar(
                [i + 0.4 * j for i in range(len(names))],
                [rows[n][f"{key}_ms_{q}"] for n in names],
                width=0.4,
                label=q,
            )
        ax.set_xticks([i + 0.2 for i in range(len(names))], names, fontsize=8)
        ax.set_title(f"{key.upper()} (ms)" + (", per token gap" if key == "itl" else ""))
        ax.legend(fontsize=7)
    ax = axes[3]
    for j, (key, label) in enumerate(
        (
            ("computed_fraction", "prompt tokens computed"),
            ("disaggregated_fraction", "disaggregated"),
        )
    ):
        ax.bar(
            [i + 0.4 * j for i in range(len(names))],
            [rows[n][key] for n in names],
            width=0.4,
            label=label,
        )
    ax.set_xticks([i + 0.2 for i in range(len(names))], names, fontsize=8)
    ax.set(ylim=(0, 1.25), title="fraction of prompt tokens / of requests")
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    for a in axes:
        a.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
