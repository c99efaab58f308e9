"""`kvmesh bench router`'s closed loops (sustained rate and CPU per request: a new prompt on
every request, as traffic is, small and ~8k characters; a small prompt repeated from 64 as a
labelled extra) and how rounds of every router's measurements combine: the median of each
figure, so that host noise in one round moves no router's figures alone."""

from __future__ import annotations

import asyncio
import contextlib
import statistics

from kvmesh.bench.fleet_procs.procs import Proc
from kvmesh.bench.router_client import closed_loop, prompt_requests, prompt_text


def _loop_runner():
    with contextlib.suppress(ImportError):
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    return asyncio.Runner()


LOOPS = {  # --loops name -> (row key, prompt kind, repeated prompts: 0 = a new one each time)
    "small": ("throughput", "small", 0),
    "8k": ("throughput_8k", "long", 0),
    "repeated": ("throughput_repeated", "small", 64),  # a labelled extra: not what users send
}


def loop_names(spec: str) -> list[str]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in LOOPS]
    if unknown or not names:
        raise SystemExit(f"--loops: {', '.join(unknown) or spec!r}: choose from {', '.join(LOOPS)}")
    return names


def measure_loops(urls: list[str], model: str | None, args, router: Proc | None, engines: Proc):
    """Each closed loop of --loops in turn: row key -> its row (measure_rate)."""
    out = {}
    for name in loop_names(args.loops):
        key, kind, repeated = LOOPS[name]
        text = prompt_text(kind, args.seed)
        makers = [prompt_requests(u, model, text, repeated) for u in urls]
        out[key] = measure_rate(urls, makers, args, router, engines)
    return out


def measure_rate(urls: list[str], makers: list, args, router: Proc | None, engines: Proc):
    """One closed loop: answers a second and CPU per answer of the router and the engines."""
    cpu: dict[str, float] = {}

    def edge(tag: str):
        def snap() -> None:
            cpu[f"engines_{tag}"] = engines.cpu_seconds()
            if router is not None:
                cpu[f"router_{tag}"] = router.cpu_seconds()

        return snap

    with _loop_runner() as runner:
        stats, wall = runner.run(
            closed_loop(
                urls, makers, args.concurrency, args.warmup, args.duration, (edge("0"), edge("1"))
            )
        )
    done = max(1, stats.ok)
    row = {
        "req_s": round(stats.ok / wall, 1),
        "requests": stats.ok,
        "errors": stats.errors,
        "engines_cpu_us_per_req": round((cpu["engines_1"] - cpu["engines_0"]) / done * 1e6, 1),
    }
    if router is not None:
        row["router_cpu_us_per_req"] = round((cpu["router_1"] - cpu["router_0"]) / done * 1e6, 1)
        row["router_cpu_share"] = round((cpu["router_1"] - cpu["router_0"]) / wall, 3)
    if stats.errors:
        row["statuses"] = {str(k): v for k, v in stats.statuses.items()}
    return row


def median_rows(rows: list[dict]) -> dict:
    """The median of each number over rows of one shape (nested dicts of numbers); other values
    from the first row."""
    first = rows[0]
    out: dict = {}
    for key, value in first.items():
        if isinstance(value, dict):
            out[key] = median_rows([r[key] for r in rows if isinstance(r.get(key), dict)])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            out[key] = round(statistics.median(values), 4)
        else:
            out[key] = value
    return out
