"""`kvmesh bench agentic|shared-prefix|trace --url URL`: one workload against any
OpenAI-compatible server, with its results as JSON and a table. Each finished request is saved
as a row of <kind>.rows.json in --out while the run goes on, so a run stopped early keeps them."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from rich.console import Console

from kvmesh.bench import cli_args
from kvmesh.bench.loadgen import Record, failures, run_workload, table
from kvmesh.bench.progress import BenchRun
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
    config = {"workload": wl.describe(), "url": args.url, "concurrency": args.concurrency}
    bench = BenchRun(wl.kind, args.out, total=len(wl.requests), config=config)
    return bench.call(_main, args, wl)


def record_row(rec: Record) -> dict:
    """One finished request as a saved row: its times in ms, tokens and error, its ITLs as a
    count and a mean (the run's summary has their percentiles)."""
    row = {
        "rid": rec.rid,
        "start_s": round(rec.start, 4),
        "ttft_ms": round(rec.ttft * 1000, 2),
        "e2e_ms": round(rec.e2e * 1000, 2),
        "prompt_tokens": rec.prompt_tokens,
        "cached_tokens": rec.cached_tokens,
        "output_tokens": rec.output_tokens,
        "itl_ms_mean": round(1000 * sum(rec.itls) / len(rec.itls), 3) if rec.itls else None,
        "endpoint": rec.endpoint,
    }
    if rec.error:
        row["error"] = rec.error
    return row


def _main(args: argparse.Namespace, wl, bench: BenchRun) -> int:
    engines = [u.strip().rstrip("/") for u in args.engine_metrics.split(",") if u.strip()]
    console = Console() if sys.stdout.isatty() else Console(width=170)
    console.print(f"{wl.kind}: {wl.describe()['requests']} requests against {args.url}")

    def on_record(rec: Record) -> None:
        bench.add(record_row(rec), quiet=True)

    result = asyncio.run(
        run_workload(
            args.url.rstrip("/"),
            wl,
            concurrency=args.concurrency,
            engines=engines,
            label=wl.kind,
            progress=bench.progress,
            timeout_s=args.request_timeout,
            prompt_format=args.prompt_format,
            on_record=on_record,
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
