"""`kvmesh bench chaos --hostile`: a soak of hostile requests mixed into normal agentic load.

On one fresh fleet (the chaos bench's emulated engines and router, no faults) the normal
closed-loop agentic load runs three times, --soak-seconds each but the first: a warm-up
(--warmup-seconds, not reported), the clean run, and the hostile run, in which a separate
process (kvmesh.bench.chaos_hostile) sends --hostile-rate hostile requests a second through the
router, of every class in turn. The runs have the same sessions, each with its own text, so
that no run finds another's prompts cached. Targets: no normal request fails in either run,
the hostile run's TTFT p99 within 20% of the clean run's (no ratio from a run with failures),
every hostile request refused (4xx) or closed, none answered 5xx, none past its timeout,
none quoting its key. Writes hostile.json to --out; engine, router and hostile logs beside."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import aiohttp
from rich.console import Console

from kvmesh.bench import chaos_hostile_report as rep
from kvmesh.bench import loadgen
from kvmesh.bench.chaos_hostile import CLASSES, PARTIAL_TIMEOUT_S, HostileRecord
from kvmesh.bench.chaos_load import drive
from kvmesh.bench.chaos_metrics import parse_router_metrics
from kvmesh.bench.chaos_procs import Fleet, State, client_sessions, start_fleet
from kvmesh.bench.fleet_procs.procs import server_env
from kvmesh.bench.progress import BenchRun

RECORDS = "hostile-records.json"  # the hostile process's records, beside the logs
# (flag, type, default, --quick default, help)
SOAK_KNOBS = (
    ("--soak-seconds", float, 60.0, 8.0, "--hostile: wall seconds of the clean and hostile runs"),
    ("--warmup-seconds", float, 5.0, 2.0, "--hostile: wall seconds of the unreported warm-up"),
    ("--hostile-rate", float, 2.0, 3.0, "--hostile: hostile requests a second"),
    ("--slowloris-connections", int, 16, 4, "--hostile: connections per slowloris request"),
    ("--hostile-prompt-mb", float, 8.0, 8.0, "--hostile: size of an oversized prompt, MB"),
)


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("hostile soak", __doc__.split("\n\n")[1].replace("%", "%%"))
    g.add_argument(
        "--hostile",
        action="store_true",
        help="Run the hostile soak instead of the fault phases: tables of the normal clients' "
        "clean and hostile runs and of the hostile classes, hostile.json.",
    )
    g.add_argument(
        "--hostile-classes",
        default="",
        help=f"--hostile: comma-separated classes to send [all: {', '.join(CLASSES)}].",
    )
    for flag, typ, default, quick, text in SOAK_KNOBS:
        g.add_argument(
            flag, type=typ, default=default, help=f"{text} [{default:g}; --quick: {quick:g}]."
        )


def quick_defaults(args: argparse.Namespace) -> None:
    """--quick sizes for the soak's knobs left at their defaults."""
    for flag, _, default, quick, _ in SOAK_KNOBS if args.quick else ():
        name = flag[2:].replace("-", "_")
        if getattr(args, name) == default:
            setattr(args, name, quick)


async def router_counters(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The router's ejection / re-admission / replay counters now ({} when it does not answer)."""
    try:
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return parse_router_metrics(await r.text()).extras
    except (aiohttp.ClientError, TimeoutError):
        return {}


async def start_hostile(args: argparse.Namespace, url: str, model: str | None, out: Path):
    """The hostile process, its requests built, waiting for the word to start."""
    cmd = [sys.executable, "-m", "kvmesh.bench.chaos_hostile", "--url", url]
    cmd += ["--model", model or "kvmesh", "--seconds", f"{args.soak_seconds:g}"]
    cmd += ["--rate", f"{args.hostile_rate:g}", "--seed", str(args.seed)]
    cmd += ["--slowloris-connections", str(args.slowloris_connections)]
    cmd += ["--classes", args.hostile_classes]
    cmd += ["--prompt-mb", f"{args.hostile_prompt_mb:g}", "--out", str(out / RECORDS)]
    log = open(out / "hostile.log", "w")  # noqa: SIM115 - the process writes it until its end
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=log,
        env=server_env(),
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 300)
    if line.strip() != b"ready":
        raise RuntimeError(f"the hostile client did not start; see {out / 'hostile.log'}")
    return proc, log


async def one_run(http, ctl, fleet: Fleet, model, wl, args, seconds: float, hostile=None):
    """The normal load for `seconds` (the hostile process started with it when given), then
    the requests in flight to their end and the hostile ones to theirs; (state, counters the
    router grew meanwhile)."""
    st = State()
    before = await router_counters(ctl, fleet.router_url)
    load = asyncio.create_task(drive(http, fleet.router_url, model, wl, args, st))
    if hostile is not None:
        hostile.stdin.write(f"{st.t0!r}\n".encode())
        await hostile.stdin.drain()
    await asyncio.sleep(seconds)
    st.stop.set()
    try:
        await asyncio.wait_for(load, args.request_timeout * args.emulate_time_scale + 10)
    except TimeoutError:
        st.notes.append("requests still in flight after the drain timeout were dropped")
    if hostile is not None:
        await asyncio.wait_for(hostile.wait(), PARTIAL_TIMEOUT_S + 60)
    after = await router_counters(ctl, fleet.router_url)
    grown = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    return st, grown


async def soak(
    fleet: Fleet, wl, args: argparse.Namespace, console: Console, bench: BenchRun | None = None
) -> dict:
    """Warm-up, clean and hostile runs on one fleet; the result before assembly."""
    async with client_sessions(args) as (http, ctl):
        await start_fleet(ctl, fleet)
        model = await loadgen.served_model(http, fleet.router_url, fleet.urls)
        proc, log = await start_hostile(args, fleet.router_url, model, fleet.out)
        try:
            runs: dict[str, tuple[State, dict]] = {}
            soak_s = args.soak_seconds
            plan = (("warm-up", 2, args.warmup_seconds, None), ("clean", 0, soak_s, None))
            for name, shift, seconds, hostile in (*plan, ("hostile", 1, soak_s, proc)):
                console.print(f"{name}: {seconds:g} s")
                if bench is not None:
                    bench.phase(f"{name} run ({seconds:g} s)", len(runs) + 1, 3)
                text = replace(wl, seed=wl.seed + shift)  # the same sessions, their own text
                runs[name] = await one_run(http, ctl, fleet, model, text, args, seconds, hostile)
                if bench is not None:
                    row = rep.normal_row(name, runs[name][0].results)
                    bench.add(row | {"router_counters_grown": runs[name][1]}, f"{name} run")
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            log.close()
    records = json.loads((fleet.out / RECORDS).read_text())
    return {"runs": runs, "hostile": [HostileRecord(**r) for r in records]}


def assemble(runs: dict[str, tuple[State, dict]], hostile: list[HostileRecord]) -> dict:
    """The report: normal rows, hostile classes, targets, counters and notes per run."""
    clean = rep.normal_row("clean", runs["clean"][0].results)
    loaded = rep.normal_row("hostile", runs["hostile"][0].results)
    classes = rep.class_rows(hostile)
    return {
        "normal": [clean, loaded],
        "hostile_classes": classes,
        "targets": rep.targets(clean, loaded, classes),
        "warmup_requests": len(runs["warm-up"][0].results),
        "router_counters": {name: grown for name, (_, grown) in runs.items()},
        "notes": [f"{name}: {n}" for name, (st, _) in runs.items() for n in st.notes],
    }


def main(
    args: argparse.Namespace,
    fleet: Fleet,
    wl,
    title: str,
    console: Console,
    bench: BenchRun | None = None,
) -> int:
    """Run the soak, print its tables and write hostile.json; each run's row saved by `bench`
    as it ends."""
    if bench is not None:
        bench.total = 3
    try:
        got = asyncio.run(soak(fleet, wl, args, console, bench))
    finally:
        fleet.stop()
    result = {"title": title, "engines": fleet.urls} | assemble(got["runs"], got["hostile"])
    clean, loaded = result["normal"]
    tg = result["targets"]
    for row in (clean, loaded):
        if row["failed"]:  # failures first: before any table or ratio
            console.print(f"[red]{row['run']}: {row['failed']} normal requests failed[/]")
            for e in row["errors"]:
                console.print(f"  {e}")
    console.print(rep.normal_table(clean, loaded, tg, title))
    console.print(rep.hostile_table(result["hostile_classes"]))
    for name, grown in result["router_counters"].items():
        if grown:
            console.print(f"router counters grown in {name}: {grown}")
    for note in result["notes"]:
        console.print(f"[yellow]note[/] {note}")
    console.print(f"targets: {tg}")
    result["args"] = {k: v for k, v in vars(args).items() if k != "func"}
    result["records"] = {
        name: [asdict(r) | {"outcome": r.outcome} for r in st.results]
        for name, (st, _) in got["runs"].items()
    }
    result["hostile_records"] = [asdict(r) | {"verdict": rep.verdict(r)} for r in got["hostile"]]
    (fleet.out / "hostile.json").write_text(json.dumps(result, indent=1))
    console.print(f"wrote {fleet.out / 'hostile.json'}")
    ok = clean["requests"] and loaded["requests"]
    return 0 if ok else 1
