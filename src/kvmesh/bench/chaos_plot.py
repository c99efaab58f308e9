"""What `kvmesh bench chaos` shows: the per-phase table, the router restart's table, the
counters the router exported and the targets on the console, and the PNG timeline (requests
per second by outcome, hit rate per second, precise index size, phase bands, kill / eject /
re-admit marks)."""

from __future__ import annotations

import math
from pathlib import Path

from rich.table import Table

from kvmesh.bench.chaos_metrics import Sample
from kvmesh.bench.chaos_report import OUTCOMES, Result, hit_series

COLORS = {"ok": "tab:green", "lost": "tab:red", "broken": "tab:orange"}


def _f(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _ready(x: float | None) -> str:
    """A restarted engine's re-admission counted from its /health answering."""
    return "" if x is None else f" (ready{x:+.2f})"


def _counted(p: dict) -> str:
    """Ejections and re-admissions the router counted, and the re-admission time they give."""
    if "eject_s" not in p:
        return "-"
    n = f"{p['ejections_counted']}/{p['readmissions_counted']}"
    return n + _f(p.get("readmit_counted_s"), ", {:.2f} s").removeprefix("-")


def table(phases: list[dict], title: str) -> Table:
    t = Table(title=title)
    cols = "phase|target|s|requests|lost <1st token: retrying client|lost: no retries"
    cols += "|broken >1st token|retried|hit rate|TTFT p50|p90|eject|re-admit|counted ej/re"
    for col in cols.split("|"):
        left = col in ("phase", "target")
        whole = left or col in ("p90", "eject", "re-admit", "counted ej/re")
        t.add_column(col, justify="left" if left else "right", no_wrap=whole)
    for p in phases:
        t.add_row(
            p["name"],
            p["target"].removeprefix("http://") or "-",
            f"{p['end'] - p['start']:.1f}",
            str(p["requests"]),
            f"[red]{p['lost']}[/]" if p["lost"] else "0",
            f"[red]{p['lost_without_retries']}[/]" if p["lost_without_retries"] else "0",
            str(p["broken"]),
            str(p["retried"]),
            _f(p["hit_rate"]),
            _f(p["ttft_ms_p50"], "{:.0f} ms"),
            _f(p["ttft_ms_p90"], "{:.0f} ms"),
            _f(p.get("eject_s"), "{:.2f} s")
            + (f" x{p['ejections']}" if p.get("ejections") else ""),
            _f(p.get("readmit_s"), "{:.2f} s") + _ready(p.get("readmit_after_ready_s")),
            _counted(p),
        )
    return t


def restart_table(w: dict) -> Table:
    """The router restart, from the moment the new router was up."""
    t = Table(title="router restart (times from the new router up)")
    cols = "down|index entries before|index warm (98% entries)|index warm (router gauge)"
    cols += "|all feeds warm seen|hit rate before (n)|hit rate 1st s (n)|hit rate back"
    for col in cols.split("|"):
        t.add_column(col, justify="right")
    t.add_row(
        _f(w["router_down_s"], "{:.2f} s"),
        _f(w["index_before"], "{:.0f}"),
        _f(w["index_warm_s"], "{:.2f} s"),
        _f(w.get("index_warm_router_s"), "{:.2f} s"),
        _f(w.get("index_warm_seen_s"), "{:.2f} s"),
        f"{_f(w['hit_before'])} ({w['n_before']})",
        f"{_f(w['hit_first_s'])} ({w['n_first_s']})",
        _f(w["hit_recovered_s"], "{:.2f} s"),
    )
    return t


def print_summary(console, result: dict) -> None:
    """The table, the router restart, counters the router exported, notes and targets."""
    console.print(table(result["phases"], result["title"]))
    if result["router_restart"]:
        console.print(restart_table(result["router_restart"]))
    for row in result["phases"]:
        grown: dict[str, float] = {}  # summed over endpoints, by metric and reason
        for key, v in row["counters"].items():
            name = key.split("{", 1)[0].removeprefix("kvmesh_router_").removesuffix("_total")
            reason = key.partition("reason=")[2].split(",")[0].rstrip("}")
            name += f"({reason})" if reason else ""
            grown[name] = grown.get(name, 0.0) + v
        if grown:
            text = ", ".join(f"{k} +{v:g}" for k, v in sorted(grown.items()))
            console.print(f"{row['name']}: {text}")
    for note in dict.fromkeys(result["notes"]):
        console.print(f"[yellow]note[/] {note}")
    console.print(f"engines' fault counters: {result['fault_counts']}")
    console.print(f"targets: {result['targets']}")


def plot(result: dict, results: list[Result], samples: list[Sample], path: Path) -> None:
    """Requests per second by outcome (by end time), hit rate per second (by routing time) and
    the precise index size, over phase bands with eject / re-admit marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(3, 1, figsize=(13, 9), sharex=True)
    end = max([r.end for r in results] + [p["end"] for p in result["phases"]] + [1.0])
    nbins = int(end) + 1
    bottom = [0] * nbins
    for o in OUTCOMES:
        counts = [0] * nbins
        for r in results:
            if r.outcome == o:
                counts[min(nbins - 1, int(r.end))] += 1
        a.bar(range(nbins), counts, 1.0, bottom=bottom, color=COLORS[o], label=o, align="edge")
        bottom = [x + y for x, y in zip(bottom, counts, strict=True)]
    a.set(ylabel="requests ended / s", title=result["title"])
    a.set_ylim(0, max(bottom) * 1.15 + 1)
    xs: list[float] = []
    ys: list[float] = []
    for x, h, _ in hit_series(results):
        if xs and x - xs[-1] > 1.5:  # a second without a finished request breaks the line
            xs, ys = [*xs, xs[-1] + 1], [*ys, math.nan]
        xs, ys = [*xs, x + 0.5], [*ys, h]
    b.plot(xs, ys, ".-", label="hit rate")
    b.set(ylabel="hit rate (by routing time)", ylim=(0, 1.02))
    c.plot(
        [s.t for s in samples],
        [math.nan if s.precise is None else s.precise for s in samples],  # router down: a gap
        lw=1,
        label="precise index entries",
    )
    c.set(xlabel="time, s", ylabel="index entries")
    for i, p in enumerate(result["phases"]):
        for ax in (a, b, c):
            ax.axvspan(p["start"], p["end"], color=f"C{i % 10}", alpha=0.07)
        a.text(p["start"], a.get_ylim()[1] * 0.97, p["name"], fontsize=7, va="top")
    for e in result["events"]:
        style = {"kill": ("k", "-"), "ejected": ("tab:red", ":"), "readmitted": ("tab:green", ":")}
        kind = next((k for k in style if k in e["kind"]), None)
        if kind:
            for ax in (a, b, c):
                ax.axvline(e["t"], color=style[kind][0], ls=style[kind][1], lw=1)
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
