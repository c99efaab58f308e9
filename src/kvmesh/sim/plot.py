"""The picture of a `kvmesh sim` run: TTFT distribution and hit rate per policy."""

from __future__ import annotations

from kvmesh.sim.fleet import SimRecord


def plot_policies(
    path: str, runs: dict[str, list[SimRecord]], summaries: dict[str, dict], ceiling: float
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=(3, 2))
    for name, records in runs.items():
        ttft = sorted(r.ttft * 1e3 for r in records if r.ttft is not None)
        if ttft:
            cdf.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name)
    cdf.set_xscale("log")
    cdf.set_xlabel("time to first token (virtual ms)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT")
    cdf.grid(alpha=0.3)
    cdf.legend(fontsize=8)
    names = list(summaries)
    hits = [summaries[n]["hit_rate"] for n in names]
    lost = [summaries[n]["lost_to_routing"] for n in names]
    xs = range(len(names))
    bars.bar(xs, hits, label="hit rate")
    bars.bar(xs, lost, bottom=hits, alpha=0.4, label="known elsewhere (lost to routing)")
    bars.axhline(ceiling, color="k", ls="--", lw=1, label=f"ceiling {ceiling:.3f}")
    bars.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    bars.set_ylabel("share of prompt tokens")
    bars.set_title("prefix-cache hits")
    bars.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
