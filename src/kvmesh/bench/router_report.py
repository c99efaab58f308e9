"""Tables, targets and the chart of `kvmesh bench router`."""

from __future__ import annotations

from pathlib import Path

ADDED_TARGET_MS = 1.0
CASE_TITLES = {
    "small": "small",
    "8k": "8k chars",
    "small_stream_ttfb": "stream TTFB small",
    "8k_stream_ttfb": "stream TTFB 8k",
}


LOOP_TITLES = {  # closed-loop row key -> its title (the repeated one is a labelled extra)
    "throughput": "small, new",
    "throughput_8k": "8k, new",
    "throughput_repeated": "small, 64 repeated (extra)",
}


def _cell(d: dict | None, a: str, b: str, fmt: str = "{:+.3f}") -> str:
    if not d or a not in d:
        return "-"
    return f"{fmt.format(d[a])} / {fmt.format(d[b])}"


def _peers(fleet: dict) -> list[dict]:
    return [r for r in fleet["routers"] if r["kind"] not in ("kvmesh", "envoy")]


def _kvmesh(fleet: dict, policy: str = "kvmesh") -> dict | None:
    return next(
        (r for r in fleet["routers"] if r["kind"] == "kvmesh" and r["policy"] == policy), None
    )


def targets_summary(result: dict) -> dict:
    """kvmesh (preset kvmesh) against the targets and the best peer of the same run."""
    out: dict = {"added_p50_target_ms": ADDED_TARGET_MS}
    for fleet in result["fleets"]:
        row: dict = {}
        km = _kvmesh(fleet)
        peers = _peers(fleet)
        for case in CASE_TITLES:
            entry: dict = {}
            if km and case in km["latency"]:
                entry["kvmesh_added_p50_ms"] = km["latency"][case]["added_p50_ms"]
                entry["meets_target"] = entry["kvmesh_added_p50_ms"] <= ADDED_TARGET_MS
            best = min(peers, key=lambda r: r["latency"][case]["added_p50_ms"], default=None)
            if best is not None:
                entry["best_peer"] = best["router"]
                entry["best_peer_added_p50_ms"] = best["latency"][case]["added_p50_ms"]
            row[case] = entry
        for loop in LOOP_TITLES:
            for key, pick in (("req_s", max), ("router_cpu_us_per_req", min)):
                had = [r for r in peers if loop in r]
                entry = {}
                if km and loop in km:
                    entry["kvmesh"] = km[loop][key]
                if had:
                    best = pick(had, key=lambda r, k=key, lp=loop: r[lp][k])
                    entry["best_peer"] = best["router"]
                    entry["best_peer_value"] = best[loop][key]
                if entry:
                    row[key + loop.removeprefix("throughput")] = entry
        out[f"engines_{fleet['engines']}"] = row
    return out


def print_tables(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=160)
    con.print(f"pinning: {result['pinning']}")
    for note in result["skipped"]:
        con.print(f"[yellow]skipped[/] {note}")
    for fleet in result["fleets"]:
        n = fleet["engines"]
        t = Table(title=f"{n} engines: added latency, ms, p50 / p99 (direct row: absolute)")
        t.add_column("router")
        for title in CASE_TITLES.values():
            t.add_column(title, justify="right")
        direct = fleet.get("direct", {}).get("latency", {})
        t.add_row(
            "direct (engine)",
            *(_cell(direct.get(c), "p50_ms", "p99_ms", "{:.3f}") for c in CASE_TITLES),
        )
        for r in fleet["routers"]:
            lat = r["latency"]
            t.add_row(
                r["router"],
                *(_cell(lat.get(c), "added_p50_ms", "added_p99_ms") for c in CASE_TITLES),
            )
        con.print(t)
        t = Table(
            title=f"{n} engines: closed loops, req/s | router CPU us/req (router + engines on "
            "one CPU); a new prompt on every request unless marked"
        )
        rows = [("direct (engine)", fleet.get("direct", {}))]
        rows += [(r["router"], r) for r in fleet["routers"]]
        loops = [k for k in LOOP_TITLES if any(k in r for _, r in rows)]
        t.add_column("router")
        for k in loops:
            t.add_column(LOOP_TITLES[k], justify="right")
        t.add_column("errors", justify="right")
        for name, r in rows:
            cells = [
                f"{r[k].get('req_s', '-')} | {r[k].get('router_cpu_us_per_req', '-')}"
                if k in r
                else "-"
                for k in loops
            ]
            errors = sum(r[k].get("errors", 0) for k in loops if k in r)
            t.add_row(name, *cells, f"[red]{errors}[/]" if errors else "0")
        con.print(t)
        for f in fleet["failed"]:
            con.print(f"[red]failed[/] {f['router']}: {f['error'][-300:]}")
        calls = fleet.get("engine_side_calls", {})
        if any(r["router"] == "vllm-router cache_aware" for r in fleet["routers"]) and calls:
            con.print(
                "note: engine POST /v1/completions/render -> "
                f"{calls.get('/v1/completions/render')}, /tokenize -> {calls.get('/tokenize')}; "
                "vllm-router cache_aware calls these on every worker for every request"
            )
    _print_targets(con, result["targets"])


def _print_targets(con, tg: dict) -> None:
    from rich.table import Table

    t = Table(title="targets (shown, not asserted)")
    for col in ("what", "kvmesh", "target / best peer", "ok"):
        t.add_column(col)
    for key, row in tg.items():
        if not key.startswith("engines_"):
            continue
        n = key.split("_")[1]
        for case, title in CASE_TITLES.items():
            e = row.get(case, {})
            if "kvmesh_added_p50_ms" not in e:
                continue
            peer = (
                f"; {e['best_peer']} {e['best_peer_added_p50_ms']:+.3f}" if "best_peer" in e else ""
            )
            t.add_row(
                f"{n} eng: added p50 {title} (ms)",
                f"{e['kvmesh_added_p50_ms']:+.3f}",
                f"<= {ADDED_TARGET_MS}{peer}",
                "yes" if e["meets_target"] else "NO",
            )
        for loop, what in LOOP_TITLES.items():
            suffix = loop.removeprefix("throughput")
            for k, title in (("req_s", "req/s"), ("router_cpu_us_per_req", "router CPU us/req")):
                e = row.get(k + suffix, {})
                if "kvmesh" in e:
                    peer = f"{e['best_peer']} {e['best_peer_value']}" if "best_peer" in e else "-"
                    t.add_row(f"{n} eng: {title}, {what}", str(e["kvmesh"]), peer, "")
    con.print(t)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{r['router']} @{f['engines']}", r) for f in result["fleets"] for r in f["routers"]]
    fig, axes = plt.subplots(1, 3, figsize=(21, 6))
    ax = axes[0]
    width = 0.8 / len(CASE_TITLES)
    xs = range(len(rows))
    for j, (case, title) in enumerate(CASE_TITLES.items()):
        vals = [r["latency"].get(case, {}).get("added_p50_ms", 0.0) for _, r in rows]
        ax.bar([x + j * width for x in xs], vals, width, label=title)
    ax.axhline(ADDED_TARGET_MS, color="red", ls="--", lw=1, label="target")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_title("added latency p50 (ms, symlog)")
    ax.set_xticks(
        [x + 0.4 - width / 2 for x in xs], [n for n, _ in rows], rotation=35, ha="right", fontsize=8
    )
    ax.legend(fontsize=8)
    for ax, key, title in (
        (axes[1], "req_s", "req/s, closed loop C=32, a new small prompt each"),
        (axes[2], "router_cpu_us_per_req", "router CPU µs / request, a new small prompt each"),
    ):
        labels = [n for n, _ in rows]
        vals = [r.get("throughput", {}).get(key, 0.0) for _, r in rows]
        colors = ["tab:green" if r["kind"] == "kvmesh" else "tab:gray" for _, r in rows]
        ax.bar(labels, vals, color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=35, labelsize=8)
        for lbl in ax.get_xticklabels():
            lbl.set_ha("right")
    fig.suptitle(f"kvmesh bench router ({result['pinning']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
