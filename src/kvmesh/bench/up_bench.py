"""`python -m kvmesh.bench.up_bench`: one Mooncake-format trace replayed, in one run, at the
stack `kvmesh up --emulate N` starts (this checkout's, and an older checkout's given by
--old-src) and at `kvmesh serve --emulate N` + `kvmesh router` started as separate processes,
all with the same engine flags and KV events over tcp.

Per setup: the hit rate (engines' prefix-cache counters, and the answers' cached tokens) beside
the one the router predicted, the KV-event lag the router sees, TTFT p50/p99, errors, the
router's view of its engines (samples with one unhealthy, ejections, retries), the stall of
each server (GET /health latency every 0.1 s), emulated steps that started off their timeline
(something else held the engines' event loop), CPU per process, and the seconds SIGTERM takes
to stop the stack while requests are in flight. Issue 17's figures (about 2.5 minutes):

  git worktree add /tmp/oldtree <before>; python -m kvmesh.bench.up_bench --old-src \
      /tmp/oldtree/src --engines 8 --trace-limit 1000 --rate 40 --prompt-format ids \
      --serve-args "--emulate-ttft-ms 20 --emulate-itl-ms 2 --num-gpu-blocks 30000"
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

from kvmesh.bench import workloads
from kvmesh.bench.chaos_procs import port_block
from kvmesh.bench.cli_args import DEFAULT_TRACE
from kvmesh.bench.loadgen import run_workload
from kvmesh.bench.up_procs import (
    Group,
    health_probe,
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


def setups(args: argparse.Namespace, out: Path) -> list[Setup]:
    n, chosen = args.engines, args.setups.split(",")
    base = port_block(3 * n + 1)  # events base..base+2n-1, router base+2n, engines after it
    port = base + 2 * n
    events = {"enable_kv_cache_events": True, "publisher": "zmq"}
    events |= {"endpoint": f"tcp://*:{base}", "replay_endpoint": f"tcp://*:{base + 1}"}
    flags = ["--kv-events-config", json.dumps(events)] if args.events else []
    flags += shlex.split(args.serve_args)
    kvmesh = [sys.executable, "-m", "kvmesh.cli", "--log-level", "WARNING"]
    up = [*kvmesh, "up", "--emulate", str(n), "--port", str(port), *flags]
    engines = [f"http://127.0.0.1:{port + 1 + i}" for i in range(n)]
    router = f"http://127.0.0.1:{port}"
    serve = [*kvmesh, "serve", "--emulate", str(n), "--port", str(port + 1), *flags]
    route = [*kvmesh, "router", "--port", str(port), "--preset", args.preset]
    route += [arg for url in engines for arg in ("--endpoint", url)]
    route += shlex.split(args.router_args)
    up += ["--preset", args.preset]
    found = {
        "a": Setup("a: kvmesh up (old)", [up], router, engines, args.old_src),
        "b": Setup("b: kvmesh up", [up], router, engines),
        "c": Setup("c: serve + router", [serve, route], router, engines, args.sep_src or None),
    }
    if not args.old_src:
        chosen = [c for c in chosen if c != "a"]
    return [found[c] for c in chosen]


async def measure(s: Setup, wl: workloads.Workload, args: argparse.Namespace, out: Path) -> dict:
    group = Group(out / s.label.split(":")[0], s.pythonpath)
    try:
        for cmd in s.commands:  # the router of separate processes starts once its engines are up
            group.start(cmd)
            await wait_healthy(
                s.engines if cmd is not s.commands[-1] else s.engines + [s.router], group
            )
        stop = asyncio.Event()
        stalls = {
            "router": asyncio.create_task(health_probe(s.router, stop)),
            "engine": asyncio.create_task(health_probe(s.engines[0], stop)),
        }
        view = asyncio.create_task(router_view(s.router, stop))
        cpu0, t0, mine0 = group.cpu(), time.monotonic(), time.process_time()
        result = await run_workload(
            s.router, wl, engines=s.engines, label=s.label, prompt_format=args.prompt_format
        )
        cpu1, wall, mine = group.cpu(), time.monotonic() - t0, time.process_time() - mine0
        (group.logs / "records.json").write_text(json.dumps(result))
        stop.set()
        steps, late = await timeline_restarts(s.engines)
        lag = {k: await t for k, t in stalls.items()}
        seen = await view
        stop_s, leftovers = await group.stop_under_load(s.router, args.stop_load)
    finally:
        group.kill()
    return {
        "hit_rate_engines": result["engine_hit_rate"],
        "hit_rate_answers": result["hit_rate"],
        "ttft_ms_p50": result["ttft_ms_p50"],
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
        "engine_steps": steps,
        "engine_steps_off_timeline": late,
        "sigterm_stop_s": stop_s,
        "left_processes": leftovers,
    }


def table(rows: list[Setup]) -> str:
    cols = [
        ("hit (engines)", "hit_rate_engines"),
        ("hit (answers)", "hit_rate_answers"),
        ("hit predicted", "predicted_hit_rate"),
        ("KV event lag p50/max ms", ("event_lag_ms_p50", "event_lag_ms_max")),
        ("TTFT p50 ms", "ttft_ms_p50"),
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
    lines = ["| setup | " + " | ".join(c for c, _ in cols) + " |"]
    lines.append("|---" * (len(cols) + 1) + "|")
    for s in rows:
        cells = []
        for _, key in cols:
            keys = key if isinstance(key, tuple) else (key,)
            cells.append(" / ".join(str(s.result.get(k, "-")) for k in keys))
        lines.append(f"| {s.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=4, help="Emulated engines N [4].")
    p.add_argument("--setups", default="a,b,c", help="Which of a (old up), b (up), c [a,b,c].")
    p.add_argument("--old-src", default="", help="src/ of an older checkout for setup a.")
    p.add_argument("--sep-src", default="", help="src/ of the checkout setup c runs [this].")
    p.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake-format JSONL.")
    p.add_argument("--trace-start", type=int, default=0, help="First row replayed [0].")
    p.add_argument("--trace-limit", type=int, default=240, help="Rows replayed [240].")
    p.add_argument("--rate", type=float, default=4.0, help="Requests/s, Poisson [4].")
    p.add_argument("--max-output", type=int, default=0, help="Cap on output tokens [none].")
    p.add_argument(
        "--prompt-format", choices=("text", "ids"), default="text", help="As kvmesh bench's."
    )
    p.add_argument("--preset", default="kvmesh", help="Router preset [kvmesh].")
    p.add_argument(
        "--events", action=argparse.BooleanOptionalAction, default=True, help="KV events (tcp)."
    )
    p.add_argument("--serve-args", default="", help="More flags for the engines (up and serve).")
    p.add_argument("--router-args", default="", help="More flags for setup c's router.")
    p.add_argument("--stop-load", type=int, default=16, help="Requests in flight at SIGTERM.")
    p.add_argument("--out", default="bench-up", help="Output folder [bench-up].")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wl = workloads.mooncake(
        args.trace, args.trace_limit, args.trace_start, rate=args.rate, max_output=args.max_output
    )
    rows = setups(args, out)
    for s in rows:
        t0 = time.monotonic()
        s.result = asyncio.run(measure(s, wl, args, out))
        s.result["wall_s"] = round(time.monotonic() - t0, 1)
        print(s.label, json.dumps(s.result), flush=True)
    text = table(rows)
    print(text)
    doc = {"args": vars(args), "workload": wl.describe(), "rows": {s.label: s.result for s in rows}}
    (out / "up_bench.json").write_text(json.dumps(doc, indent=1))
    (out / "up_bench.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip())
    add_args(parser)
    sys.exit(main(parser.parse_args()))
