"""The picture of a `kvmesh sim --agents N1,N2,...` sweep: output tokens per minute, hit rate and
preemptions against the number of agents, one line per policy, its knee marked."""

from __future__ import annotations


def plot_sweep(path: str, policies: dict[str, dict]) -> None:
    """`policies`: name -> {"knee": count or None, "points": [loop summaries]}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("output_tok_per_min", "output tokens per simulated minute", "output tok/min"),
        ("hit_rate", "share of prompt tokens", "prefix-cache hit rate"),
        ("preemptions", "preemptions", "preemptions"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    counts = sorted({p["agents"] for run in policies.values() for p in run["points"]})
    for i, (name, run) in enumerate(policies.items()):
        color = f"C{i}"
        points = sorted(run["points"], key=lambda p: p["agents"])
        xs = [p["agents"] for p in points]
        at = run["knee"]
        label = f"{name} (knee {at})" if at is not None else f"{name} (no knee)"
        for ax, (key, _, _) in zip(axes, panels, strict=True):
            ys = [p[key] for p in points]
            ax.plot(xs, ys, marker="o", color=color, label=label)
            if at is not None:
                ax.axvline(at, color=color, ls="--", lw=1, alpha=0.6)
                ax.plot([at], [ys[xs.index(at)]], marker="X", ms=11, color=color)
            if key == "hit_rate" and all("ceiling" in p for p in points):
                ax.plot(xs, [p["ceiling"] for p in points], color=color, ls=":", lw=1)
    for ax, (_, ylabel, title) in zip(axes, panels, strict=True):
        ax.set_xscale("log")
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.minorticks_off()
        ax.set_xlabel("concurrent agents")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[0].set_ylim(bottom=0)
    axes[1].set_ylim(0, 1)  # a share: its whole range, so a small change looks small
    top = max(axes[2].get_ylim()[1], 1.0)  # counts: whole numbers, and room to show a zero
    axes[2].set_ylim(-0.05 * top, top)
    axes[2].yaxis.get_major_locator().set_params(integer=True)
    ceilings = any(all("ceiling" in p for p in run["points"]) for run in policies.values())
    axes[1].set_title("prefix-cache hit rate" + (" (dotted: ceiling)" if ceilings else ""))
    axes[2].set_title("preemptions (X, dashed: the knee)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
