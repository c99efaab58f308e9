"""How `kvmesh bench emulation` reports a run: where the time went, a table and a plot."""

from __future__ import annotations

import math
import os
from pathlib import Path


def div(a: float, b: float) -> float:
    return a / b if b else math.nan


def diagnose(ph: dict) -> list[str]:
    """Where the time goes when a ratio is off target, from the phase's own figures."""
    o, ncpu, notes = ph["overall"], os.cpu_count() or 1, []
    stretch = div(o["wall_per_step_ms"], o["pred_step_ms"])
    eng = "+".join(f"{c:.0f}" for c in ph["engine_cpu_pct"])
    cpu = (
        f"CPU (100% = a core): engines {eng}%, client {ph['client_cpu_pct']:.0f}%, machine "
        f"{ph['machine_cpu_pct']:.0f}% of {ncpu * 100}%"
    )
    if stretch > 1.5:
        full = "; all cores are busy" if ph["machine_cpu_pct"] >= 90 * ncpu else ""
        notes.append(
            f"steps take {stretch:.1f}x their prediction ({o['wall_per_step_ms']:.1f} vs "
            f"{o['pred_step_ms']:.1f} ms): the engines' event loop cannot do the per-token work "
            f"(scheduling, detokenizing, SSE writes) in time{full}; {cpu}"
        )
    elif not o["itl_within_target"]:
        notes.append(
            f"each step overruns by {o['itl_ms'] - o['itl_pred_ms']:.2f} ms on average (asyncio "
            f"timers wake up to ~1 ms late, later on a busy machine, and the engine does not "
            f"catch up); client loop lag {ph['client_loop_lag_ms_mean']:.2f} ms; {cpu}"
        )
    if not o["ttft_within_target"] and stretch <= 1.5:
        notes.append(
            f"TTFT is {o['ttft_ms'] - o['ttft_pred_ms']:.1f} ms above prediction: HTTP, JSON, "
            f"prompt tokenization before the request reaches the scheduler and late timer "
            f"wake-ups, which the latency model does not include"
        )
    return notes


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Emulation timing fidelity: {result['gpu']} x {result['model']}, +/-10%")
    for col in ("load", "eng x str", "reqs", "TTFT ms", "pred", "ratio", "ITL ms", "pred",
                "ratio", "ms/step", "pred", "CPU% eng/cli/all"):  # fmt: skip
        t.add_column(col, justify="right")
    for name, ph in result["phases"].items():
        o, ok = ph["overall"], {True: "[green]", False: "[red]"}
        t.add_row(
            name, f"{ph['engines']} x {ph['streams_per_engine']}", str(o["requests"]),
            f"{o['ttft_ms']:.1f}", f"{o['ttft_pred_ms']:.1f}",
            f"{ok[o['ttft_within_target']]}{o['ttft_ratio']:.3f}",
            f"{o['itl_ms']:.2f}", f"{o['itl_pred_ms']:.2f}",
            f"{ok[o['itl_within_target']]}{o['itl_ratio']:.3f}",
            f"{o['wall_per_step_ms']:.2f}", f"{o['pred_step_ms']:.2f}",
            f"{'+'.join(f'{c:.0f}' for c in ph['engine_cpu_pct'])}/{ph['client_cpu_pct']:.0f}"
            f"/{ph['machine_cpu_pct']:.0f}",
        )  # fmt: skip
    console = Console(width=max(Console().width, 120))
    console.print(t)
    for name, ph in result["phases"].items():
        for note in ph["notes"]:
            console.print(f"[bold]{name}[/]: {note}", highlight=False)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = result["phases"].items()
    names = [f"{n}\n{p['engines']} x {p['streams_per_engine']}" for n, p in phases]
    rows = [p["overall"] for _, p in phases]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key in zip(axes, ("ttft", "itl"), strict=True):
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [r[f"{key}_ms"] for r in rows], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [r[f"{key}_pred_ms"] for r in rows], 0.4, label="predicted")
        for x, r in zip(xs, rows, strict=True):
            ax.annotate(f"x{r[f'{key}_ratio']:.2f}", (x, r[f"{key}_ms"]), ha="center", va="bottom")
        ax.set_xticks(list(xs), names)
        ax.set_yscale("log")
        ax.set_ylim(top=max(max(r[f"{key}_ms"], r[f"{key}_pred_ms"]) for r in rows) * 3)
        ax.set_title(f"mean {key.upper()} (ms), measured / predicted")
        ax.legend(loc="upper left", fontsize="small")
    fig.suptitle(f"kvmesh emulation timing fidelity: {result['gpu']} x {result['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
