"""`kvmesh bench engine`'s report: throughput ratios, targets met or not, the terminal tables
and the PNG chart, all from the results dict that results.json holds."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

LABELS = {
    "kvmesh": "kvmesh engine",
    "vllm": "vLLM",
    "hf_batched": "HF generate, batched",
    "hf_sequential": "HF generate, sequential",
}


def ratios(results: dict, name: str, base: str) -> dict[str, float]:
    tp = results["throughput"]
    if name not in tp or base not in tp:
        return {}
    return {b: round(tp[name][b]["tok_s"] / tp[base][b]["tok_s"], 3) for b in tp[name]}


def targets(results: dict, bmax: int) -> list[dict]:
    out = []
    for base in ("hf_batched", "hf_sequential"):
        value = ratios(results, "kvmesh", base).get(str(bmax))
        if value is not None:
            name = f"kvmesh batch {bmax} tok/s vs {LABELS[base]}"
            out.append({"name": name, "target": ">= 3.0", "value": value, "met": value >= 3.0})
    for kind in ("cached", "suffix"):
        value = results["ttft"].get("kvmesh", {}).get(f"ratio_{kind}")
        if value is not None:
            name = f"kvmesh TTFT {'cached' if kind == 'cached' else 'cached+suffix'} / cold"
            out.append({"name": name, "target": "<= 0.2", "value": value, "met": value <= 0.2})
    return out


def print_report(console: Console, results: dict, sizes: list[int]) -> None:
    cfg = results["config"]
    title = (
        f"Output tokens/s ({cfg['model']}, {cfg['max_tokens']} out / {cfg['prompt_tokens']} "
        f"in tokens per request, {cfg['threads']} threads)"
    )
    t = Table(title=title)
    t.add_column("engine / config")
    for b in sizes:
        t.add_column(f"b={b}", justify="right")
    per_b = " / ".join(f"b={b}" for b in sizes)
    t.add_column(f"vs HF batched\n({per_b})", justify="right")
    t.add_column(f"vs HF sequential\n({per_b})", justify="right")
    t.add_column(f"TTFT p50 @b={sizes[-1]}", justify="right")
    for name, label in LABELS.items():
        tp = results["throughput"].get(name)
        if tp is None:
            continue
        cells = [f"{tp[str(b)]['tok_s']:.1f}" for b in sizes]
        for base in ("hf_batched", "hf_sequential"):
            r = ratios(results, name, base)
            cells.append(" / ".join(f"{r[str(b)]:.2f}x" for b in sizes) if r else "-")
        ttft = tp[str(sizes[-1])].get("ttft_ms_p50")
        t.add_row(label, *cells, f"{ttft:.0f} ms" if ttft is not None else "-")
    console.print(t)
    t = Table(title="TTFT of a long prompt (median; max_tokens=1)")
    t.add_column("engine")
    cols = ("prompt tok", "cold ms", "cached ms", "cached/cold", "+suffix ms", "+suffix/cold")
    for col in (*cols, "cached tok"):
        t.add_column(col, justify="right")
    for name, v in results["ttft"].items():
        t.add_row(
            LABELS[name],
            str(v["prompt_tokens"]),
            f"{v['cold_ms']:.1f}",
            f"{v['cached_ms']:.1f}",
            f"{v['ratio_cached']:.3f}",
            f"{v['suffix_ms']:.1f}",
            f"{v['ratio_suffix']:.3f}",
            str(v["cached_cached_tokens"][0]),
        )
    console.print(t)
    for x in results["targets"]:
        mark = "[green]met[/green]" if x["met"] else "[red]not met[/red]"
        console.print(f"target: {x['name']}: {x['value']:.3f} (target {x['target']}) {mark}")
    load, cpus = results["loadavg"]["start"], results["config"]["cpu_count"] or 1
    if load > 0.5 * cpus:
        console.print(
            f"[yellow]warning: load average {load:.1f} on {cpus} CPUs before the run: other "
            "processes compete for the CPU, so these figures are noisy[/yellow]"
        )
    for key in ("hf_error", "vllm_error"):
        if key in results:
            console.print(f"[yellow]{key}: {results[key]}[/yellow]")


def write_plot(results: dict, sizes: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [n for n in LABELS if n in results["throughput"]]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(sizes))]
        ys = [results["throughput"][name][str(b)]["tok_s"] for b in sizes]
        ax1.bar_label(ax1.bar(xs, ys, width, label=LABELS[name]), fmt="%.0f", fontsize=8)
    ax1.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(sizes))])
    ax1.set_xticklabels([f"batch {b}" for b in sizes])
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("Throughput")
    ax1.legend()
    engines = list(results["ttft"])
    for i, kind in enumerate(("cold", "cached", "suffix")):
        ys = [results["ttft"][e][f"{kind}_ms"] for e in engines]
        label = {"cold": "cold", "cached": "cached", "suffix": "cached + new suffix"}[kind]
        bars = ax2.bar([j + i * 0.27 for j in range(len(engines))], ys, 0.27, label=label)
        ax2.bar_label(bars, fmt="%.0f", fontsize=8)
    ax2.set_xticks([j + 0.27 for j in range(len(engines))])
    ax2.set_xticklabels([LABELS[e] for e in engines])
    ax2.set_ylabel("TTFT ms (median)")
    ax2.set_title("Long-prompt TTFT")
    ax2.legend()
    cfg = results["config"]
    fig.suptitle(
        f"{cfg['model']}: {cfg['prompt_tokens']}-token prompts, {cfg['max_tokens']} tokens out; "
        f"TTFT prompt {cfg['long_prompt_tokens']} tokens; {cfg['threads']} CPU threads"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
