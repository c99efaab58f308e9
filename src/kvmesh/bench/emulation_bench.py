"""`kvmesh bench emulation`: how faithfully emulated engines reproduce their latency model.

Emulated engines (`kvmesh serve --emulate N`) sleep for the step time a roofline model predicts
and record, per request, the TTFT and inter-token latencies (ITL) that model predicts
(`GET /admin/timing`, cumulative). This bench starts them as subprocesses, drives a closed loop
of streaming /v1/completions from this process, and compares what the client measured with the
predictions over the same phase (snapshot differences), at a light and at a heavy load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvmesh.bench.emulation_report import diagnose, div, plot, print_table
from kvmesh.bench.fleet_procs.engines import ENGINE_ENV, serve_command, wait_for_urls
from kvmesh.bench.fleet_procs.procs import Proc, admin_headers, stop_all
from kvmesh.bench.progress import BenchRun

TARGET = 0.10  # |measured / predicted - 1| within this is faithful
WORDS = (  # noqa: SIM905
    "the of and to in is was for that with as on by at from they this which had are not be one"
    " all were we when there can an your said if do will each about how up out them then she many"
    " some so these would other into has more two like him see time could no make than first been"
).split()
EPILOG = """What is measured, per load level (light, then heavy), per engine and overall:
  TTFT  client: send -> first content chunk; predicted: time of every step from the request's
        arrival to its first token (incl. the rest of the step in flight), by the latency model.
  ITL   client: time between consecutive content chunks of a stream; predicted: time of the
        step that produced each later token.
Means over all requests / token gaps of a phase, predictions from GET /admin/timing snapshots
taken before and after it; the ratio measured/predicted should lie within 1 +/- 10%. Closed
loop: each stream sends its next request (random prompt of 200-500 words ~ tokens, max_tokens
64-128, ignore_eos) when the last ends. To show where time goes when a ratio drifts: wall time
per engine step vs the predicted step, CPU of the engine process(es), of this client and of the
whole machine, and this client's event-loop lag. Output: emulation.json and emulation.png."""
FLAGS = (  # flag, type, default, help
    ("--engines", int, 16, "Engines at heavy load."),
    ("--streams", int, 50, "Concurrent streams per engine at heavy load."),
    ("--duration", float, 20.0, "Seconds of load per phase (requests in flight then finish)."),
    ("--light-engines", int, 2, "Engines at light load."),
    ("--light-streams", int, 2, "Concurrent streams per engine at light load."),
    ("--gpu", str, "h100", "Emulated accelerator (kvmesh serve --emulate-gpu)."),
    ("--model", str, "llama-3.1-8b", "Emulated model (kvmesh serve --emulate-model)."),
    ("--engine-procs", int, 1, "Engine processes the engines are split over."),
    (
        "--time-scale",
        float,
        0.0,
        "Also run the heavy load in slow motion (kvmesh serve --emulate-time-scale K): every "
        "step lasts K times its prediction and client times are divided by K. 0: no such phase.",
    ),
    ("--port", int, 0, "First engine port; 0: free ports chosen by the OS."),
    ("--seed", int, 0, "Seed of the prompts and lengths."),
    ("--out", Path, Path("bench-results/emulation"), "Output directory."),
)


def add_args(parser: argparse.ArgumentParser) -> None:
    text = parser.description or __doc__.split("\n\n")[1]
    parser.description = textwrap.fill(" ".join(text.split()), 95)
    parser.epilog, parser.formatter_class = EPILOG, argparse.RawDescriptionHelpFormatter
    for flag, kind, default, text in FLAGS:
        parser.add_argument(flag, type=kind, default=default, help=f"{text} [default: {default}]")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI-sized: heavy 2 engines x 2 streams, light 1 x 1, 3 s.",
    )


def start_engines(
    args: argparse.Namespace, count: int, streams: int, scale: float = 1.0
) -> tuple[list[Proc], list[str]]:
    """`kvmesh serve --emulate n` in --engine-procs processes; their base URLs once printed."""
    nprocs = max(1, min(args.engine_procs, count))
    counts = [count // nprocs + (j < count % nprocs) for j in range(nprocs)]
    flags = ["--emulate-gpu", args.gpu, "--emulate-model", args.model]
    flags += ["--max-num-seqs", str(max(64, streams)), "--emulate-time-scale", str(scale)]
    procs = [
        Proc(
            serve_command(n, args.port + sum(counts[:j]) if args.port else 0, flags),
            args.out / f"engines-{j}-x{scale:g}.log",
            ENGINE_ENV,  # /admin/timing: see timing()
        )
        for j, n in enumerate(counts)
    ]
    return procs, wait_for_urls(procs, counts, 300)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs (Linux /proc/stat; NaN elsewhere)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        return math.nan, math.nan
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


@dataclass(slots=True)
class Stat:
    """What the client saw from one engine in one phase."""

    requests: int = 0
    errors: int = 0
    ttft_sum: float = 0.0
    itl_sum: float = 0.0
    itl_n: int = 0
    last_error: str = ""


def token_event(data: bytes) -> bool:
    """Whether an SSE data payload is a chunk with a choice (a token), not the usage chunk."""
    i = data.find(b'"choices"')
    rest = data[i + 9 :].lstrip(b" :") if i >= 0 else b""
    return rest[:1] == b"[" and rest[1:].lstrip()[:1] != b"]"


async def one_request(http: aiohttp.ClientSession, url: str, body: dict, stat: Stat) -> None:
    """One streamed completion; a chunk's time is when its bytes were read off the socket."""
    t0 = time.perf_counter()
    first = last = gap_sum = 0.0
    gaps, buf, done = 0, b"", False
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for part in resp.content.iter_any():
            now = time.perf_counter()
            *events, buf = (buf + part).split(b"\n\n")
            for line in (ln for ev in events for ln in ev.splitlines()):
                data = line[5:].strip() if line.startswith(b"data:") else b""
                if data == b"[DONE]":
                    done = True
                elif data.startswith(b'{"error"'):
                    raise RuntimeError(data[:300].decode(errors="replace"))
                elif token_event(data):
                    if first:
                        gaps, gap_sum = gaps + 1, gap_sum + now - last
                    first, last = first or now, now
            if done:
                break
    if not first:
        raise RuntimeError("stream ended without a token")
    stat.requests, stat.ttft_sum = stat.requests + 1, stat.ttft_sum + first - t0
    stat.itl_n, stat.itl_sum = stat.itl_n + gaps, stat.itl_sum + gap_sum


async def stream_loop(http, url: str, model: str, stat: Stat, deadline: float, seed: int) -> None:
    """Closed loop: the next request as soon as the last ends, until the deadline."""
    rng = random.Random(seed)
    while time.perf_counter() < deadline:
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(200, 500)))
        body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(64, 128)}
        body |= {"temperature": 0.0, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        try:
            await one_request(http, url, body, stat)
        except Exception as exc:  # counted and reported; the loop goes on
            stat.errors, stat.last_error = stat.errors + 1, f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.05)


async def loop_lag(samples: list[float], period: float = 0.01) -> None:
    """How late this process's event loop wakes up from a `period` sleep."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period)
        samples.append(time.perf_counter() - t - period)


async def timing(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(f"{url}/admin/timing", headers=admin_headers()) as resp:
        resp.raise_for_status()
        out = await resp.json()
        return {k: v for k, v in out.items() if not k.endswith("_mean") and k != "time_scale"}


def ratio_row(
    st: Stat, before: dict, after: dict, wall: float, engines: int = 1, scale: float = 1.0
) -> dict:
    """Client-measured means vs the predicted means over the same phase (snapshot difference);
    measured wall times are divided by the time scale to compare in emulated seconds."""
    d = {k: after[k] - before[k] for k in after}
    m_ttft = div(st.ttft_sum, st.requests) / scale
    m_itl = div(st.itl_sum, st.itl_n) / scale
    wall /= scale
    p_ttft = div(d["predicted_ttft_s_sum"], d["ttft_count"])
    p_itl = div(d["predicted_itl_s_sum"], d["itl_count"])
    row = {"ttft_ms": m_ttft * 1e3, "ttft_pred_ms": p_ttft * 1e3, "ttft_ratio": div(m_ttft, p_ttft)}
    row |= {"itl_ms": m_itl * 1e3, "itl_pred_ms": p_itl * 1e3, "itl_ratio": div(m_itl, p_itl)}
    row |= {"requests": st.requests, "errors": st.errors, "itl_gaps": st.itl_n}
    row |= {"pred_ttft_count": d["ttft_count"], "pred_itl_count": d["itl_count"]}
    row |= {"steps": d["steps"], "pred_step_ms": div(d["predicted_step_s_sum"], d["steps"]) * 1e3}
    row["wall_per_step_ms"] = div(wall * engines, d["steps"]) * 1e3  # idle time included
    for key in ("ttft", "itl"):
        row[f"{key}_within_target"] = abs(row[f"{key}_ratio"] - 1) <= TARGET
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


async def run_phase(
    urls: list[str], streams: int, args, model: str, procs, scale: float = 1.0
) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        before = await asyncio.gather(*(timing(http, u) for u in urls))
        cpu0 = [cpu_seconds(p.popen.pid) for p in procs], time.process_time(), machine_cpu()
        lags: list[float] = []
        lag_task = asyncio.create_task(loop_lag(lags))
        stats = [Stat() for _ in urls]
        t0 = time.perf_counter()
        jobs = [
            (e, args.seed * 7919 + e * 97 + s) for e in range(len(urls)) for s in range(streams)
        ]
        end = t0 + args.duration * scale
        await asyncio.gather(
            *(stream_loop(http, urls[e], model, stats[e], end, s) for e, s in jobs)
        )
        wall = time.perf_counter() - t0
        lag_task.cancel()
        cpu1 = [cpu_seconds(p.popen.pid) for p in procs], time.process_time(), machine_cpu()
        after = await asyncio.gather(*(timing(http, u) for u in urls))
    per_engine, total = [], Stat()
    for u, st, b, a in zip(urls, stats, before, after, strict=True):
        row = ratio_row(st, b, a, wall, 1, scale)
        per_engine.append(row | {"url": u, "last_error": st.last_error})
        for f in ("requests", "errors", "itl_n", "ttft_sum", "itl_sum"):
            setattr(total, f, getattr(total, f) + getattr(st, f))
    sums = [{k: sum(x[k] for x in snaps) for k in snaps[0]} for snaps in (before, after)]
    busy = div(cpu1[2][0] - cpu0[2][0], cpu1[2][1] - cpu0[2][1]) * (os.cpu_count() or 1)
    return {
        "engines": len(urls),
        "streams_per_engine": streams,
        "time_scale": scale,
        "duration_s": args.duration,
        "wall_s": round(wall, 3),
        "overall": ratio_row(total, *sums, wall, len(urls), scale),
        "engine_cpu_pct": [
            round((c - b) / wall * 100, 1) for b, c in zip(*(cpu0[0], cpu1[0]), strict=True)
        ],
        "client_cpu_pct": round((cpu1[1] - cpu0[1]) / wall * 100, 1),
        "machine_cpu_pct": round(busy * 100, 1),  # all processes; 100 = one core
        "client_loop_lag_ms_mean": round(div(sum(lags), len(lags)) * 1e3, 3),
        "per_engine": per_engine,
    }


async def measure(
    args, urls: list[str], procs, phases: dict, scale: float, bench: BenchRun
) -> dict:
    """Each (engines, streams) phase in turn on engines started at this time scale, each
    saved by `bench` as it ends."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{urls[0]}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        warm = {"model": model, "prompt": "warm up", "max_tokens": 4, "stream": True}
        await asyncio.gather(*(one_request(http, u, warm, Stat()) for u in urls))
    out = {}
    for name, (engines, streams) in phases.items():
        bench.note(f"phase {name}: {engines} engines x {streams} streams, {args.duration:g} s")
        out[name] = await run_phase(urls[:engines], streams, args, model, procs, scale)
        bench.add({"phase": name, **out[name]}, name)
    return out


def main(args: argparse.Namespace) -> int:
    return BenchRun("emulation", args.out).call(_main, args)


def _main(args: argparse.Namespace, bench: BenchRun) -> int:
    if args.quick:
        args.engines, args.streams, args.light_engines, args.light_streams = 2, 2, 1, 1
        args.duration = 3.0
    light, heavy = (args.light_engines, args.light_streams), (args.engines, args.streams)
    if min(*light, *heavy, args.engine_procs) < 1 or args.duration <= 0 or args.time_scale < 0:
        print(
            "kvmesh bench emulation: counts and --duration must be positive, --time-scale >= 0",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    plan = {1.0: {"light": light, "heavy": heavy}}
    if args.time_scale and args.time_scale != 1:
        plan[args.time_scale] = {f"heavy x{args.time_scale:g}": heavy}
    phases, nprocs = {}, 0
    bench.total = sum(len(group) for group in plan.values())
    for scale, group in plan.items():
        procs: list[Proc] = []
        try:
            counts = [n for n, _ in group.values()], [s for _, s in group.values()]
            bench.note(f"starting {max(counts[0])} emulated engines (time scale {scale:g})")
            procs, urls = start_engines(args, max(counts[0]), max(counts[1]), scale)
            nprocs = len(procs)
            phases |= asyncio.run(measure(args, urls, procs, group, scale, bench))
        except (RuntimeError, aiohttp.ClientError, KeyError) as exc:
            print(f"kvmesh bench emulation: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        finally:
            stop_all(procs)
    for ph in phases.values():
        ph["notes"] = diagnose(ph)
    names = [f[2:].replace("-", "_") for f, *_ in FLAGS] + ["quick"]
    settings = {n: str(v) if isinstance(v := getattr(args, n), Path) else v for n in names}
    ratios = {
        n: {k: p["overall"][f"{k}_ratio"] for k in ("ttft", "itl")} for n, p in phases.items()
    }
    result = {"gpu": args.gpu, "model": args.model, "engine_procs": nprocs, "target": TARGET}
    result |= {"cpu_count": os.cpu_count(), "settings": settings, "ratios": ratios}
    result["phases"] = phases
    (args.out / "emulation.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "emulation.png")
    print_table(result)
    print(f"results: {args.out / 'emulation.json'}, {args.out / 'emulation.png'}")
    return 0
