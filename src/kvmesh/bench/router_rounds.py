"""`kvmesh bench router`'s closed loop (sustained rate and CPU per request) and how rounds of
every router's measurements combine: the median of each figure, so that host noise in one
round moves no router's figures alone."""

from __future__ import annotations

import asyncio
import contextlib
import statistics

from kvmesh.bench.router_client import closed_loop, completion_body, prompt_text
from kvmesh.bench.router_client import request_bytes as raw_request
from kvmesh.bench.router_procs import Proc


def _loop_runner():
    with contextlib.suppress(ImportError):
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    return asyncio.Runner()


def measure_rate(urls: list[str], model: str | None, args, router: Proc | None, engines: Proc):
    text = prompt_text("small", args.seed)
    raws = [
        [
            raw_request(u, "/v1/completions", completion_body(model, f"{text} #{i}", False))
            for i in range(64)
        ]
        for u in urls
    ]
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
                urls, raws, args.concurrency, args.warmup, args.duration, (edge("0"), edge("1"))
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
