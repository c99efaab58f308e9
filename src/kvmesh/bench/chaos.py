"""Faults against an emulated fleet behind the router, in one run.

Starts N emulated engines, each its own `kvmesh serve --emulate` process with KV events (a
publisher and a replay socket), and `kvmesh router` in front of them; drives closed-loop agentic
sessions through the router (streaming /v1/completions with usage, growing prompts that share
prefixes, x-session-id) while these phases run, --phase-seconds each:

  baseline        no fault
  engine-restart  engine 0 killed (SIGKILL); started again on the same ports --down-seconds later
  router-restart  the router killed (SIGKILL) and started again with the same command
  drop-events     every engine drops --drop-events-rate of its KV event batches
  errors          one engine answers 500 to --error-rate of its requests
  hang            one engine never answers --hang-rate of its requests
  stall           one engine stalls --stall-rate of its streams mid-stream for --stall-seconds
  recovery        no fault

Faults are set at run time with POST /admin/faults. Measured per phase (a request counts in the
phase in which it ended): requests; lost before the first token (an error status, a 503 included,
a connection failure or a timeout before any token; the target is zero); broken after the first
token; hit rate (cached / prompt tokens from usage.prompt_tokens_details); TTFT p50 / p90. From
the router's /metrics, polled every 50 ms: seconds from a kill or fault to the router taking the
engine out of rotation (unhealthy or ejected; xN: how often) and from its restart or the fault's
end to its re-admission (negative: taken back while the fault lasted); the same from the
router's ejection and re-admission counters, which see a stretch too short for a poll; the
KV-event replay counters. After the router restart, from the moment the new router is up: the
precise index's time to hold 98% of its entries of just before the kill (target: 1 s), the
router's own warm-up time of its KV-event feeds (kv_index_warm_seconds), and the hit rate of
the requests routed in the first second against the seconds before the kill (target: within
0.02). The client retries a connection only while the router process is down or was killed
under it, as the OpenAI SDK retries a connection error; such requests count as retried, and
their TTFT runs from the first attempt. Lost requests are reported twice, side by side: as
this retrying client saw them, and as a client without retries would have (every retried
request lost).

Writes chaos.json and chaos.png (requests per second by outcome, hit rate per second, index
size, phase bands, kill / eject / re-admit marks) to --out; engine and router logs beside them."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from kvmesh.bench import chaos_report as rep
from kvmesh.bench import chaos_soak, cli_args, loadgen
from kvmesh.bench.chaos_load import drive
from kvmesh.bench.chaos_plot import plot, print_summary
from kvmesh.bench.chaos_procs import (
    Fleet,
    State,
    client_sessions,
    in_rotation,
    monitor,
    ports_needed,
    read_fault_counts,
    set_faults,
    start_fleet,
    wait_ready,
)
from kvmesh.bench.fleet_procs.ports import taken_ports
from kvmesh.bench.fleet_procs.procs import server_env
from kvmesh.bench.progress import BenchRun

PHASES = ("baseline", "engine-restart", "router-restart", "drop-events", "errors", "hang", "stall")
PHASES += ("recovery",)
# fmt: off
DENSE = {"turns": 8, "answer_tokens": 48, "think_s": 0.5}  # busier than the fleet's sessions
QUICK = {"turns": 4, "system_tokens": 400, "tool_def_tokens": 400, "repos": 2, "repo_tokens": 800,
         "tool_tokens": 200, "answer_tokens": 16, "think_s": 0.1, "fanout": 2, "sub_turns": 1}
# fmt: on


# (flag, type, default, --quick default or None, help) of the run's numeric knobs
KNOBS = (
    ("--engines", int, 4, 2, "Emulated engines, one process each"),
    ("--phase-seconds", float, 20.0, 4.0, "Wall seconds per phase"),
    ("--concurrency", int, 16, 6, "Closed loop: sessions in flight"),
    ("--down-seconds", float, 2.0, 1.0, "How long the killed engine stays down"),
    ("--drop-events-rate", float, 0.3, None, "drop-events: share of batches dropped, every engine"),
    ("--error-rate", float, 0.5, None, "errors: share of requests answered 500"),
    ("--hang-rate", float, 0.3, None, "hang: share of requests never answered"),
    ("--stall-rate", float, 0.5, None, "stall: share of streams stalled once"),
    ("--stall-seconds", float, 3.0, 1.5, "stall: how long, s"),
    ("--first-byte-timeout", float, 3.0, None, "Router flag, if it has it: s"),
    ("--stream-idle-timeout", float, 1.5, 0.75, "Router flag, if it has it: s"),
    ("--ejection-seconds", float, 3.0, 1.0, "Router --outlier-base-ejection-time, if it has it"),
    ("--request-timeout", float, 30.0, None, "Client timeout per request, s"),
)


def _flags(values: dict) -> str:
    return ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in values.items())


def add_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    for flag, typ, default, quick, text in KNOBS:
        q = f"; --quick: {quick:g}" if quick is not None else ""
        a(flag, type=typ, default=default, help=f"{text} [{default:g}{q}].")
    a("--phases", default=",".join(PHASES), help="Comma-separated phases to run [all, in order].")
    a("--preset", default="kvmesh", help="Router preset [kvmesh].")
    a("--router-args", default="", help="Extra `kvmesh router` flags.")
    a("--serve-args", default="", help="Extra `kvmesh serve` flags for each engine.")
    a("--emulate-gpu", default="h100", help="Emulated accelerator [h100].")
    a("--emulate-model", default="llama-3.1-8b", help="Emulated model [llama-3.1-8b].")
    a(
        "--emulate-time-scale",
        type=float,
        default=1.0,
        help="Engines in slow motion: steps, think times and timeouts last K times longer; "
        "TTFT is reported divided by K; phases and eject / warm times stay in wall seconds [1].",
    )
    a(
        "--base-port",
        type=int,
        default=0,
        help="First of the run's ports, 3 x --engines + 1 in a row: engine i's KV events on "
        "BASE+2i and its replay on BASE+2i+1, engine i's HTTP on BASE+2N+i, the router on "
        "BASE+3N; all must be free. 0: a free run below the ephemeral ports [0].",
    )
    a("--out", default="bench-results/chaos", help="Output folder [bench-results/chaos].")
    a("--quick", action="store_true", help="CI size (about a minute), small sessions.")
    w = parser.add_argument_group(
        "workload",
        "Agentic sessions in a closed loop. Defaults are the generator's (below) except "
        f"{_flags(DENSE)} (with --quick: {_flags(QUICK)}); --sessions defaults to enough for the "
        "whole timeline; "
        "--session-rate is ignored.",
    )
    cli_args.add_workload_params(w, ("agentic",))
    w.add_argument("--seed", type=int, default=0, help="Workload seed [0].")
    chaos_soak.add_args(parser)


def router_flags(args: argparse.Namespace) -> list[str]:
    """Short timeouts and ejections for a short run, each only where `kvmesh router --help`
    lists the flag (older routers run with their defaults), then --router-args."""
    cmd = [sys.executable, "-m", "kvmesh.cli", "router", "--help"]
    have = subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=120).stdout
    k, ej = args.emulate_time_scale, args.ejection_seconds
    wanted = {
        "--first-byte-timeout": args.first_byte_timeout * k,
        "--stream-idle-timeout": args.stream_idle_timeout * k,
        "--outlier-base-ejection-time": ej,
        "--outlier-max-ejection-time": 4 * ej,
    }
    flags = set(re.findall(r"--[a-z][a-z0-9-]+", have))
    return [x for f, v in wanted.items() if f in flags for x in (f, f"{v:g}")] + (
        args.router_args.split()
    )


def phase_faults(name: str, args: argparse.Namespace) -> tuple[int, dict, dict]:
    """(engine index, set, clear) of a phase's faults; index -1: every engine."""
    n, stall_s = args.engines, args.stall_seconds * args.emulate_time_scale
    return {
        "drop-events": (-1, {"drop_events_rate": args.drop_events_rate}, {"drop_events_rate": 0}),
        "errors": (1 % n, {"error_rate": args.error_rate}, {"error_rate": 0}),
        "hang": (2 % n, {"hang_rate": args.hang_rate}, {"hang_rate": 0}),
        "stall": (
            3 % n,
            {"stall_rate": args.stall_rate, "stall_seconds": stall_s},
            {"stall_rate": 0},
        ),
    }.get(name, (-1, {}, {}))


async def timeline(
    http, fleet: Fleet, names: list[str], args, st: State, bench: BenchRun | None = None
) -> list[rep.Phase]:
    """Each phase: its kill and restart or its faults at the start, the faults cleared at the
    end. A phase lasts --phase-seconds, and a restart's at least half of that after the process
    is back (the engine: in the router's rotation again), so that the recovery is measured."""
    phases: list[rep.Phase] = []
    for i, name in enumerate(names):
        if bench is not None:
            bench.phase(f"{name} ({args.phase_seconds:g} s)", i + 1, len(names))
        start = t0 = st.now()
        target = ""
        if name == "engine-restart":
            target = fleet.urls[0]
            Fleet.kill(fleet.engines[0])
            st.event("engine_kill", target)
            await asyncio.sleep(args.down_seconds)
            st.event("engine_start", target)
            if await wait_ready(http, target, fleet.start_engine(0)):
                st.event("engine_ready", target)
                await in_rotation(st, target, st.now(), 60.0)
            t0 = max(t0, st.now() - args.phase_seconds / 2)  # half a phase after the restart
        elif name == "router-restart":
            st.router_down, st.router_gen = True, st.router_gen + 1
            Fleet.kill(fleet.router)
            st.event("router_kill", fleet.router_url)
            st.event("router_start", fleet.router_url)
            if await wait_ready(http, fleet.router_url, fleet.start_router()):
                st.event("router_ready", fleet.router_url)
            st.router_down = False
            t0 = max(t0, st.now() - args.phase_seconds / 2)
        idx, on, off = phase_faults(name, args)
        urls = fleet.urls if idx < 0 else [fleet.urls[idx]]
        target = target or ("" if idx < 0 or not on else urls[0])
        for u in urls if on else ():
            await set_faults(http, u, on, st)
        await asyncio.sleep(max(0.0, t0 + args.phase_seconds - st.now()))
        for u in urls if off else ():
            await set_faults(http, u, off, st)
        phases.append(rep.Phase(name, round(start, 3), round(st.now(), 3), target))
        if bench is not None:
            bench.add(phase_row(phases[-1], st.results), name)
    return phases


def phase_row(phase: rep.Phase, results: list[rep.Result]) -> dict:
    """A phase as saved when it ends: its span and the outcomes of the requests sent in it
    that have finished by then (the report recounts them all once the run ends)."""
    outcomes = Counter(r.outcome for r in results if phase.start <= r.start < phase.end)
    return asdict(phase) | {"finished": sum(outcomes.values()), "outcomes": dict(outcomes)}


async def run(fleet: Fleet, wl, names: list[str], args, console: Console, bench: BenchRun):
    """Start the fleet, run load, monitor and timeline together; (state, phases)."""
    async with client_sessions(args) as (http, ctl):
        await start_fleet(ctl, fleet)
        model = await loadgen.served_model(http, fleet.router_url, fleet.urls)
        st, mon_stop = State(), asyncio.Event()
        mon = asyncio.create_task(monitor(ctl, fleet.router_url, st, mon_stop))
        load = asyncio.create_task(drive(http, fleet.router_url, model, wl, args, st))
        console.print(f"fleet up; phases: {', '.join(names)} ({args.phase_seconds:g} s each)")
        phases = await timeline(ctl, fleet, names, args, st, bench)
        st.stop.set()
        try:
            await asyncio.wait_for(load, args.request_timeout * args.emulate_time_scale + 10)
        except TimeoutError:
            st.notes.append("requests still in flight after the drain timeout were dropped")
        mon_stop.set()
        await mon
        await read_fault_counts(ctl, fleet.urls, st)
        return st, phases


def main(args: argparse.Namespace) -> int:
    name = "chaos-hostile" if args.hostile else "chaos"
    return BenchRun(name, args.out).call(_main, args)


def _main(args: argparse.Namespace, bench: BenchRun) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=170)
    for flag, _, default, quick, _ in KNOBS if args.quick else ():  # where left at default
        name = flag[2:].replace("-", "_")
        if quick is not None and getattr(args, name) == default:
            setattr(args, name, quick)
    chaos_soak.quick_defaults(args)
    names = [x.strip() for x in args.phases.split(",") if x.strip()]
    if [x for x in names if x not in PHASES] or args.engines < 2:
        console.print(f"kvmesh bench chaos: phases are {', '.join(PHASES)}; 2 engines at least")
        return 2
    if args.base_port:
        count = ports_needed(args.engines)
        fits = 0 < args.base_port <= 65536 - count
        taken = taken_ports(args.base_port, count) if fits else []
        if taken or not fits:
            why = f"taken: {', '.join(map(str, taken))}" if taken else "out of range"
            last = args.base_port + count - 1
            console.print(f"kvmesh bench chaos: --base-port {args.base_port}..{last}: {why}")
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rflags = router_flags(args)
    profile = QUICK if args.quick else DENSE
    # sessions enough for the whole timeline: one lasts at least a think time per turn
    turns, think = args.turns or profile["turns"], args.think_s or profile["think_s"]
    # each of the soak's runs starts the sessions afresh
    seconds = args.soak_seconds if args.hostile else len(names) * args.phase_seconds
    span = seconds / (turns * (think * args.emulate_time_scale + 0.05))
    overrides = {**profile, "sessions": math.ceil(2 * args.concurrency * span) + args.concurrency}
    wl = cli_args.build_workload(args, "agentic", **overrides)
    scale = args.emulate_time_scale
    title = (
        f"chaos: {args.engines} emulated engines ({args.emulate_model} on {args.emulate_gpu}), "
        f"{args.concurrency} agentic sessions in flight, "
        + (f"{args.soak_seconds:g} s runs" if args.hostile else f"{args.phase_seconds:g} s phases")
        + (f", slow motion x{scale:g}" if scale != 1 else "")
    )
    console.print(title)
    console.print(f"router flags: {' '.join(rflags) or '(its defaults)'}")
    fleet = Fleet(args, out, rflags)
    bench.config = {"title": title, "router_flags": rflags}
    if args.hostile:
        return chaos_soak.main(args, fleet, wl, title, console, bench)
    bench.total = len(names)
    bench.note(f"starting {args.engines} emulated engines and the router")
    try:
        st, phases = asyncio.run(run(fleet, wl, names, args, console, bench))
    finally:
        fleet.stop()
    look = min(5.0, args.phase_seconds / 2)
    result = {"title": title, "router_flags": rflags, "engines": fleet.urls}
    grace = args.first_byte_timeout * args.emulate_time_scale + 1  # a hang shows then
    result |= rep.assemble(st.results, st.samples, st.events, phases, look, grace)
    result |= {"fault_counts": st.fault_counts, "notes": st.notes}
    result["args"] = {k: v for k, v in vars(args).items() if k != "func"}
    result["index_samples"] = [[round(s.t, 3), s.precise] for s in st.samples]
    result["records"] = [asdict(r) | {"outcome": r.outcome} for r in st.results]
    print_summary(console, result)
    (out / "chaos.json").write_text(json.dumps(result, indent=1))
    plot(result, st.results, st.samples, out / "chaos.png")
    console.print(f"wrote {out / 'chaos.json'} and {out / 'chaos.png'}")
    return 0 if st.results else 1
