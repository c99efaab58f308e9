"""`kvmesh bench agentic|shared-prefix|trace --url URL`: one workload against any
OpenAI-compatible server, with its results as JSON and a table."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from rich.console import Console

from kvmesh.bench import cli_args
from kvmesh.bench.loadgen import failures, progress_bars, run_workload, table
from kvmesh.bench.workloads import hit_ceiling


def add_args_workload(parser: argparse.ArgumentParser, kind: str) -> None:
    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="Base URL of the OpenAI-compatible server [http://127.0.0.1:8000].",
    )
    parser.add_argument(
        "--engine-metrics",
        default="",
        help="Comma-separated engine base URLs whose /metrics are read before "
        "and after (prefix hits, preemptions) [none].",
    )
    parser.add_argument("--out", default=f"bench-{kind}", help=f"Output folder [bench-{kind}].")
    parser.add_argument("--kind", default=kind, help=argparse.SUPPRESS)
    cli_args.add_workload_args(parser, (kind,))


def main_workload(args: argparse.Namespace) -> int:
    wl = cli_args.build_workload(args, args.kind)
    engines = [u.strip().rstrip("/") for u in args.engine_metrics.split(",") if u.strip()]
    console = Console() if sys.stdout.isatty() else Console(width=170)
    console.print(f"{wl.kind}: {wl.describe()['requests']} requests against {args.url}")
    with progress_bars(console) as progress:
        result = asyncio.run(
            run_workload(
                args.url.rstrip("/"),
                wl,
                concurrency=args.concurrency,
                engines=engines,
                label=wl.kind,
                progress=progress,
                timeout_s=args.request_timeout,
                prompt_format=args.prompt_format,
            )
        )
    ceiling = hit_ceiling(wl.requests)
    for line in failures([(args.url, result)]):
        console.print(f"[red]FAILED[/] {line}")
    console.print(table([(args.url, result)], ceiling["hit_rate"], wl.kind))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{wl.kind}.json"
    doc = {
        "workload": wl.describe(),
        "ceiling": ceiling,
        "url": args.url,
        "concurrency": args.concurrency,
        "result": result,
    }
    path.write_text(json.dumps(doc, indent=1))
    console.print(f"wrote {path}")
    return 1 if result["errors"] == result["requests"] else 0
