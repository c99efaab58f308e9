"""The plot of `kvmesh bench fleet`: TTFT CDF, hit rate over time and requests per engine, one
line (or bar) per policy row."""

from __future__ import annotations

from pathlib import Path


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["policies"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.8))
    for name, s in rows.items():
        ok = [r for r in s["records"] if r[7]]
        ttft = sorted(r[1] for r in ok)
        a.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name)
        ends = sorted(ok, key=lambda r: r[0] + r[2] / 1000)
        step = max(1, len(ends) // 20)
        xs, ys = [], []
        for i in range(0, len(ends), step):
            win = ends[i : i + step]
            xs.append(win[-1][0] + win[-1][2] / 1000)
            ys.append(sum(r[4] for r in win) / max(1, sum(r[3] for r in win)))
        b.plot(xs, ys, marker=".", label=name)
    b.axhline(result["ceiling"]["hit_rate"], color="k", ls="--", lw=1, label="ceiling")
    a.set(xscale="log", xlabel="TTFT, ms", ylabel="fraction of requests", title="TTFT CDF")
    b.set(
        xlabel="time, s",
        ylabel="hit rate (cached / prompt tokens)",
        ylim=(0, 1.02),
        title="hit rate over time",
    )
    engines = result["engines"]
    width = 0.8 / max(1, len(rows))
    for k, (name, s) in enumerate(rows.items()):
        counts = list(s["load"].values())[: len(engines)]  # in its own fleet's engine order
        c.bar([i + k * width for i in range(len(counts))], counts, width, label=name)
    c.set(xlabel="engine", ylabel="requests", title="requests per engine")
    c.set_xticks([i + 0.4 - width / 2 for i in range(len(engines))], range(len(engines)))
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(result["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
