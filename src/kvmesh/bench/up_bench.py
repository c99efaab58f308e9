"""`kvmesh bench up`: one workload, in one run, through the stack `kvmesh up --emulate N` starts
(with its own KV-event transport, ipc://, unless --up-events tcp; setup b; an older checkout's
`up` given by --old-src is setup a) and through `kvmesh serve --emulate N` + `kvmesh router`
started as separate processes with KV events over tcp (setup c), for each routing preset of
--presets; every (setup, preset) --rounds times in turn, each figure the median of its rounds.
--hog N keeps N busy processes on the host meanwhile (a loaded machine, as a shared CI runner
or a laptop running a build is), --emulate-time-scale K runs the engines in slow motion (the
host is then not the bottleneck).

Per setup and preset: the hit rate (engines' prefix-cache counters, and the answers' cached
tokens) beside the one the router predicted, the KV-event lag the router sees, TTFT p50/p90/p99,
errors, the router's view of its engines (samples with one unhealthy, ejections, retries), the
stall of each server (GET /health latency every 0.1 s), emulated steps that started off their
timeline (something else held the engines' event loop), CPU per process, and (first round) the
seconds SIGTERM takes to stop the stack while requests are in flight. Then the ratios the
design holds the stack to: `up` against separate processes, and each preset against round
robin, on TTFT p50 and p90. For example (about 10 minutes):

  kvmesh bench up --workload agentic --sessions 24 --turns 6 --fanout 4 \
      --presets kvmesh,round-robin --rounds 2 --hog 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.bench import cli_args, workloads
from kvmesh.bench.fleet_procs.ports import port_block
from kvmesh.bench.kv_regime import regime, regime_line
from kvmesh.bench.loadgen import run_workload
from kvmesh.bench.progress import BenchRun, LineProgress
from kvmesh.bench.router_rounds import median_rows
from kvmesh.bench.up_procs import (
    Group,
    busy_processes,
    health_probe,
    kv_cache_tokens,
    router_view,
    timeline_restarts,
    wait_healthy,
)
from kvmesh.protocol.stats import percentile


@dataclass
class Setup:
    """One stack under test: its commands (each its own process group), where it answers."""

    label: str
    commands: list[list[str]]
    router: str
    engines: list[str]
    pythonpath: str | None = None
    result: dict = field(default_factory=dict)


def setups(args: argparse.Namespace, out: Path, preset: str) -> list[Setup]:
    n, chosen = args.engines, args.setups.split(",")
    base = port_block(3 * n + 1)  # events base..base+2n-1, router base+2n, engines after it
    port = base + 2 * n
    events = {"enable_kv_cache_events": True, "publisher": "zmq"}
    events |= {"endpoint": f"tcp://*:{base}", "replay_endpoint": f"tcp://*:{base + 1}"}
    tcp = ["--kv-events-config", json.dumps(events)] if args.events else []
    flags = shlex.split(args.serve_args)
    if args.emulate_time_scale != 1.0:
        flags += ["--emulate-time-scale", str(args.emulate_time_scale)]
    kvmesh = [sys.executable, "-m", "kvmesh.cli", "--log-level", "WARNING"]
    up = [*kvmesh, "up", "--emulate", str(n), "--port", str(port), *flags, "--preset", preset]
    if args.up_events == "tcp" or not args.events:
        up += tcp  # else `up` configures its own (ipc://)
    engines = [f"http://127.0.0.1:{port + 1 + i}" for i in range(n)]
    router = f"http://127.0.0.1:{port}"
    serve = [*kvmesh, "serve", "--emulate", str(n), "--port", str(port + 1), *tcp, *flags]
    route = [*kvmesh, "router", "--port", str(port), "--preset", preset]
    route += [arg for url in engines for arg in ("--endpoint", url)]
    if not args.events:
        route += ["--kv-events" if args.sep_src else "--kv-events-config", "none"]  # older src
    route += shlex.split(args.router_args)
    found = {
        "a": Setup(f"a: kvmesh up (old) [{preset}]", [up], router, engines, args.old_src),
        "b": Setup(f"b: kvmesh up [{preset}]", [up], router, engines),
        "c": Setup(
            f"c: serve + router [{preset}]", [serve, route], router, engines, args.sep_src or None
        ),
    }
    if not args.old_src:
        chosen = [c for c in chosen if c != "a"]
    return [found[c] for c in chosen]


async def measure(
    s: Setup,
    wl: workloads.Workload,
    args: argparse.Namespace,
    out: Path,
    stop_load: int,
    progress: LineProgress | None = None,
) -> dict:
    group = Group(out / s.label.replace(" ", "").replace(":", "-"), s.pythonpath)
    try:
        for cmd in s.commands:  # the router of separate processes starts once its engines are up
            group.start(cmd)
            await wait_healthy(
                s.engines if cmd is not s.commands[-1] else s.engines + [s.router], group
            )
        caches = await kv_cache_tokens(s.engines)
        stop = asyncio.Event()
        stalls = {
            "router": asyncio.create_task(health_probe(s.router, stop)),
            "engine": asyncio.create_task(health_probe(s.engines[0], stop)),
        }
        view = asyncio.create_task(router_view(s.router, stop))
        cpu0, t0, mine0 = group.cpu(), time.monotonic(), time.process_time()
        result = await run_workload(
            s.router,
            wl,
            engines=s.engines,
            label=s.label,
            progress=progress,
            prompt_format=args.prompt_format,
            time_scale=args.emulate_time_scale,
            concurrency=args.concurrency,
        )
        cpu1, wall, mine = group.cpu(), time.monotonic() - t0, time.process_time() - mine0
        (group.logs / "records.json").write_text(json.dumps(result))
        stop.set()
        steps, late = await timeline_restarts(s.engines)
        lag = {k: await t for k, t in stalls.items()}
        seen = await view
        stop_s, leftovers = -1.0, 0
        if stop_load:
            stop_s, leftovers = await group.stop_under_load(s.router, stop_load)
    finally:
        group.kill()
    return {
        "hit_rate_engines": result["engine_hit_rate"],
        "hit_rate_answers": result["hit_rate"],
        "ttft_ms_p50": result["ttft_ms_p50"],
        "ttft_ms_p90": result["ttft_ms_p90"],
        "ttft_ms_p99": result["ttft_ms_p99"],
        "errors": result["errors"],
        "requests": result["requests"],
        "preemptions": result["preemptions"],
        "load_max_mean": result["load_max_mean"],
        **{f"{k}_stall_ms_p99": round(percentile(v, 99), 1) for k, v in lag.items()},
        **{f"{k}_stall_ms_max": round(max(v, default=0.0), 1) for k, v in lag.items()},
        **seen,
        # share of one core each process of the stack used during the replay, busiest first
        "cpu_pct": sorted(
            (round(100 * (v - cpu0.get(k, 0.0)) / wall) for k, v in cpu1.items()), reverse=True
        ),
        "client_cpu_pct": round(100 * mine / wall),
        "kv_cache_tokens": caches,
        "engine_steps": steps,
        "engine_steps_off_timeline": late,
        "sigterm_stop_s": stop_s,
        "left_processes": leftovers,
    }


COLUMNS = [
    ("hit (engines)", "hit_rate_engines"),
    ("hit (answers)", "hit_rate_answers"),
    ("hit predicted", "predicted_hit_rate"),
    ("KV event lag p50/max ms", ("event_lag_ms_p50", "event_lag_ms_max")),
    ("TTFT p50 ms", "ttft_ms_p50"),
    ("TTFT p90 ms", "ttft_ms_p90"),
    ("TTFT p99 ms", "ttft_ms_p99"),
    ("errors", "errors"),
    ("unhealthy samples", "unhealthy_samples"),
    ("ejections", "ejections"),
    ("retries", "retries"),
    ("router stall p99/max ms", ("router_stall_ms_p99", "router_stall_ms_max")),
    ("engine stall p99/max ms", ("engine_stall_ms_p99", "engine_stall_ms_max")),
    ("engine steps late", "engine_steps_off_timeline"),
    ("CPU % per process", "cpu_pct"),
    ("SIGTERM stop s", "sigterm_stop_s"),
]


def table(rows: dict[str, dict]) -> str:
    """Label -> result, as a markdown table."""
    lines = ["| setup [preset] | " + " | ".join(c for c, _ in COLUMNS) + " |"]
    lines.append("|---" * (len(COLUMNS) + 1) + "|")
    for label, result in rows.items():
        cells = []
        for _, key in COLUMNS:
            keys = key if isinstance(key, tuple) else (key,)
            cells.append(" / ".join(str(result.get(k, "-")) for k in keys))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _setup_preset(label: str) -> tuple[str, str]:
    """("b", "kvmesh") of "b: kvmesh up [kvmesh]"."""
    return label[:1], label[label.rindex("[") + 1 : -1]


def ratios(rows: dict[str, dict]) -> list[dict]:
    """TTFT p50 and p90 of `up` over separate processes for one preset (b/c), and of each
    preset over round robin in one setup; none from a row whose requests failed."""
    out = []
    by = {_setup_preset(label): label for label in rows}
    for label, result in rows.items():
        setup, preset = _setup_preset(label)
        pairs = []
        if setup == "b" and ("c", preset) in by:
            pairs.append(("up / separate", by["c", preset]))
        if preset != "round-robin" and (setup, "round-robin") in by:
            pairs.append((f"{preset} / round-robin", by[setup, "round-robin"]))
        for what, base in pairs:
            other = rows[base]
            row = {"setup": label, "over": base, "what": what}
            if result["errors"] or other["errors"]:
                row["failed"] = result["errors"] + other["errors"]
            else:
                for q in ("p50", "p90"):
                    mine, theirs = result[f"ttft_ms_{q}"], other[f"ttft_ms_{q}"]
                    row[q] = round(mine / theirs, 3) if theirs else None
            out.append(row)
    return out


def ratio_lines(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if "failed" in r:
            lines.append(f"{r['what']} ({r['setup']}): no ratio, {r['failed']} requests failed")
        else:
            lines.append(f"{r['what']} ({r['setup']}): TTFT p50 x{r['p50']}, p90 x{r['p90']}")
    return lines


def cache_lines(wl: workloads.Workload, rows: dict[str, dict]) -> list[str]:
    """The KV cache each setup's engines declared, once per distinct fleet; for shared-prefix
    groups, how many of their prefixes one engine and the fleet can hold (kv_regime)."""
    lines: dict[str, list[str]] = {}
    for label, result in rows.items():
        caches = result.get("kv_cache_tokens") or []
        if wl.kind == "shared-prefix":
            sp = regime(caches, wl.params["groups"], wl.params["system_tokens"])
            line = regime_line(sp)
        else:
            line = f"KV cache per engine, tokens: {caches}"
        lines.setdefault(line, []).append(label.split(" [")[0])
    return [f"{line} [{', '.join(dict.fromkeys(who))}]" for line, who in lines.items()]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=4, help="Emulated engines N [4].")
    p.add_argument("--setups", default="b,c", help="Which of a (old up), b (up), c [b,c].")
    p.add_argument("--old-src", default="", help="src/ of an older checkout for setup a.")
    p.add_argument("--sep-src", default="", help="src/ of the checkout setup c runs [this].")
    cli_args.add_workload_args(p, ("trace", "agentic", "shared-prefix"))
    p.add_argument("--presets", default="kvmesh", help="Router presets, comma-separated [kvmesh].")
    p.add_argument("--rounds", type=int, default=1, help="Runs of every setup and preset [1].")
    p.add_argument("--hog", type=int, default=0, help="Busy processes beside the stack [0].")
    p.add_argument(
        "--emulate-time-scale", type=float, default=1.0, help="Engines in slow motion [1]."
    )
    p.add_argument(
        "--events", action=argparse.BooleanOptionalAction, default=True, help="KV events."
    )
    p.add_argument(
        "--up-events",
        choices=("own", "tcp"),
        default="own",
        help="KV events of setups a and b: what `up` configures (ipc://), or tcp as c [own].",
    )
    p.add_argument("--serve-args", default="", help="More flags for the engines (up and serve).")
    p.add_argument("--router-args", default="", help="More flags for setup c's router.")
    p.add_argument(
        "--stop-load", type=int, default=16, help="Requests in flight at SIGTERM (round 1) [16]."
    )
    p.add_argument("--out", default="bench-up", help="Output folder [bench-up].")


def main(args: argparse.Namespace) -> int:
    return BenchRun("up", args.out).call(_main, args)


def _main(args: argparse.Namespace, bench: BenchRun) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the trace's defaults of this bench: 240 rows at 4 requests/s
    defaults = {"limit": 240, "rate": 4.0} if args.workload == "trace" else {}
    wl = cli_args.build_workload(args, **defaults)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    runs: dict[str, list[dict]] = {}
    chosen = [c for c in args.setups.split(",") if c != "a" or args.old_src]
    bench.total = args.rounds * len(presets) * len(chosen)
    bench.config = {"workload": wl.describe(), "presets": presets, "rounds": args.rounds}
    with busy_processes(args.hog):
        for r in range(args.rounds):
            for preset in presets:
                for s in setups(args, out, preset):
                    bench.note(f"round {r + 1}/{args.rounds}: {s.label}: starting")
                    t0 = time.monotonic()
                    stop_load = args.stop_load if r == 0 else 0
                    where = out / f"round{r + 1}"
                    result = asyncio.run(measure(s, wl, args, where, stop_load, bench.progress))
                    result["wall_s"] = round(time.monotonic() - t0, 1)
                    runs.setdefault(s.label, []).append(result)
                    print(f"round {r + 1}: {s.label}", json.dumps(result), flush=True)
                    row = {"round": r + 1, "setup": s.label, **result}
                    bench.add(row, f"round {r + 1}, {s.label}")
    rows = {label: median_rows(results) for label, results in runs.items()}
    compared = ratios(rows)
    failed = [f"{label}: {res['errors']} of {res['requests']} requests failed"
              for label, res in rows.items() if res["errors"]]  # fmt: skip
    text = "\n".join([*(f"FAILED {line}" for line in failed), table(rows), "",
                      *cache_lines(wl, rows), *ratio_lines(compared)])  # fmt: skip
    print(text)
    doc = {
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "workload": wl.describe(),
        "rows": rows,
        "rounds": runs,
        "ratios": compared,
    }
    (out / "up_bench.json").write_text(json.dumps(doc, indent=1))
    (out / "up_bench.md").write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip())
    add_args(parser)
    sys.exit(main(parser.parse_args()))
