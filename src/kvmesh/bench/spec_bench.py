"""`kvmesh bench spec`: speculative decoding on the real model, off vs n-gram vs the MTP head.

For each arm one `kvmesh serve` subprocess (never two at once, same CPU threads), then for each
workload and batch size the same greedy streaming chat requests: output tok/s and ITL per user,
acceptance from the engine's vllm:spec_decode_* counters, and every completion compared with the
off arm's. Talks HTTP only; never imports kvmesh.engine. --emulated runs the emulated variant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
from rich.console import Console

from kvmesh.bench import http_load, spec_report
from kvmesh.bench.fleet_procs.ports import free_port
from kvmesh.bench.fleet_procs.serve import EngineProcess
from kvmesh.bench.progress import BenchRun
from kvmesh.bench.spec_report import ChatResult
from kvmesh.bench.spec_workloads import BenchRequest, requests
from kvmesh.protocol.wording import plural

ARMS = {
    "off": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    },
    "mtp": {"method": "mtp", "num_speculative_tokens": 3, "model": "smollm2"},
}
FULL = dict(batch_sizes="1,8", requests=None, max_tokens_edit=256, max_tokens_chat=128)
QUICK = dict(batch_sizes="1,2", requests=2, max_tokens_edit=32, max_tokens_chat=16)

DESCRIPTION = """\
Speculative decoding on the real model (SmolLM2-135M-Instruct on CPU unless --model), one run:

  arms        off (no drafts), ngram (prompt lookup) and mtp (the trained head), each a fresh
              `kvmesh serve --speculative-config JSON` with the same threads and --max-num-seqs
  workloads   edit: agentic edit tasks, a 40-120 line file (Python, YAML, Markdown) to return
              whole with one small change; chat: short questions
  batches     for each batch size b, the workload's --requests greedy (temperature 0) streaming
              /v1/chat/completions, b in flight at a time; batch 1 runs first, so later
              batches find the prompts in the prefix cache (alike in every arm)
  per user    ITL per token = (last - first text chunk) / (tokens - 1) (one chunk may carry
              several accepted tokens); tok/s per user = its inverse; medians over requests
  acceptance  vllm:spec_decode_* counters scraped before and after each batch run: acceptance
              rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts
  equality    each request's text must equal the off arm's (greedy equality); a mismatch is
              printed and makes the exit status 1

An arm whose engine fails to start is reported as failed with the reason. Targets shown (not
enforced): edit >= 2x off, chat >= 0.95x off in tok/s per user. Writes spec.json and spec.png
into --out."""


def _add(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--arms", default="off,ngram,mtp", help="Arms, comma-separated [off,ngram,mtp]")
    a("--workloads", default="edit,chat", help="Workloads, comma-separated [edit,chat]")
    a("--batch-sizes", help="Requests in flight per user group, comma-separated [1,8]")
    a("--requests", type=int, help="Requests per workload and batch [the largest batch]")
    a("--max-tokens-edit", type=int, help="max_tokens of an edit request [256]")
    a("--max-tokens-chat", type=int, help="max_tokens of a chat request [128]")
    a("--ngram-config", default=json.dumps(ARMS["ngram"]), help="--speculative-config of ngram")
    a("--mtp-config", default=json.dumps(ARMS["mtp"]), help="--speculative-config of mtp")
    a("--threads", type=int, help="Engine CPU threads [all cores available]")
    a("--model", default="default", help="--model for kvmesh serve [SmolLM2, embedded]")
    a("--engine-args", default="", help="More `kvmesh serve` flags, e.g. '--block-size 32'")
    a("--quick", action="store_true", help="CI sizes: batch 1,2; 2 requests; 32/16 tokens out")
    a("--emulated", action="store_true", help="Run the emulated variant (bench.spec_emulated)")
    a("--out", default="bench-results/spec", help="Output directory [bench-results/spec]")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    _add(parser)


@dataclass(slots=True)
class Plan:
    arms: list[str]
    workloads: list[str]
    batch_sizes: list[int]
    requests: int
    max_tokens: dict[str, int]
    threads: int


def make_plan(args: argparse.Namespace) -> Plan:
    base = QUICK if args.quick else FULL
    pick = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    sizes = sorted({int(x) for x in str(pick["batch_sizes"]).split(",") if x.strip()})
    if not sizes or sizes[0] < 1:
        raise ValueError("--batch-sizes must be positive integers, e.g. 1,8")
    arms = [x.strip() for x in args.arms.split(",") if x.strip()]
    if not arms or any(a not in ARMS for a in arms):
        raise ValueError(f"--arms must name some of {', '.join(ARMS)}")
    wls = [x.strip() for x in args.workloads.split(",") if x.strip()]
    if not wls or any(w not in ("edit", "chat") for w in wls):
        raise ValueError("--workloads must name some of edit, chat")
    n = pick["requests"] or sizes[-1]
    mt = {"edit": pick["max_tokens_edit"], "chat": pick["max_tokens_chat"]}
    if n < 1 or min(mt.values()) < 1:
        raise ValueError("--requests and --max-tokens-* must be at least 1")
    threads = args.threads or max(1, len(os.sched_getaffinity(0)))
    return Plan(arms, wls, sizes, n, mt, threads)


async def stream_chat(
    http: aiohttp.ClientSession, url: str, model: str | None, req: BenchRequest, max_tokens: int
) -> ChatResult:
    """One greedy streaming chat completion; errors are recorded, never raised."""
    body: dict = {"messages": req.chat_messages(), "max_tokens": max_tokens, "temperature": 0.0}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    res, parts, t0 = ChatResult(req.index), [], time.perf_counter()
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    res.error = f"stream error: {str(chunk['error'])[:300]}"
                    break
                for choice in chunk.get("choices") or []:
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:  # the first chunk carries the role only
                        now = time.perf_counter() - t0
                        res.first = res.first if res.chunks else now
                        res.last, res.chunks = now, res.chunks + 1
                        parts.append(text)
                if chunk.get("usage"):
                    res.tokens = int(chunk["usage"].get("completion_tokens", 0))
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    res.text = "".join(parts)
    return res


async def scrape(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(f"{url}/metrics") as resp:
        return spec_report.spec_counters(await resp.text())


async def run_batch(
    url: str, model: str | None, reqs: list[BenchRequest], batch: int, max_tokens: int, done
) -> tuple[list[ChatResult], dict]:
    """The requests, `batch` in flight at a time; the counters' growth over the run."""
    gate = asyncio.Semaphore(batch)

    async def one(http: aiohttp.ClientSession, req: BenchRequest) -> ChatResult:
        async with gate:
            res = await stream_chat(http, url, model, req, max_tokens)
        done()
        return res

    async with http_load.session() as http:
        before = await scrape(http, url)
        results = await asyncio.gather(*(one(http, r) for r in reqs))
        after = await scrape(http, url)
    return list(results), spec_report.acceptance(before, after)


async def measure_arm(url: str, arm: str, plan: Plan, bench: BenchRun) -> dict:
    progress = bench.progress
    async with http_load.session() as http:
        model = await http_load.first_model(http, url)
        warm = BenchRequest("chat", -1, (("user", "Say hello."),), "warm-up")
        await stream_chat(http, url, model, warm, 8)
    runs: dict = {}
    for wl in plan.workloads:
        reqs = requests(wl, plan.requests)
        for b in plan.batch_sizes:
            task = progress.add_task(f"{arm}: {wl}, batch {b}", total=len(reqs))
            got, acc = await run_batch(
                url, model, reqs, b, plan.max_tokens[wl], lambda t=task: progress.advance(t)
            )
            errors = [f"#{r.index}: {r.error}" for r in got if r.error]
            if errors:
                failed = plural(len(errors), "request")
                raise RuntimeError(f"{failed} failed: {'; '.join(errors[:3])}")
            runs.setdefault(wl, {})[str(b)] = spec_report.summarize(got) | {"acceptance": acc}
            row = {"arm": arm, "workload": wl, "batch": b, **runs[wl][str(b)]}
            bench.add(row, f"{arm}: {wl}, batch {b}")
    return runs


def run_arm(
    arm: str, spec: dict | None, plan: Plan, serve_args: list[str], out: Path, bench: BenchRun
) -> dict:
    """One arm from engine start to stop; a failure becomes {status: failed, reason}."""
    progress = bench.progress
    args = list(serve_args) + (["--speculative-config", json.dumps(spec)] if spec else [])
    data: dict = {"speculative_config": spec, "serve_args": args}
    task = progress.add_task(f"{arm}: starting engine", total=None)
    t0 = time.perf_counter()
    try:
        with EngineProcess(free_port(), args, out / f"engine-{arm}.log") as url:
            data["start_s"] = round(time.perf_counter() - t0, 2)
            progress.update(task, total=1, completed=1)
            data["runs"] = asyncio.run(measure_arm(url, arm, plan, bench))
        data["status"] = "ok"
    except Exception as exc:  # the engine's log tail is in the message
        data |= {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
        progress.update(task, total=1, completed=1, description=f"{arm}: failed")
        bench.note(f"{arm}: {data['reason'][:300]}")
    data["wall_s"] = round(time.perf_counter() - t0, 2)
    return data


def run_emulated(console: Console, out: Path, quick: bool, bench: BenchRun | None = None) -> int:
    try:
        from kvmesh.bench.spec_emulated import run_emulated as emulated
    except ModuleNotFoundError as exc:
        if exc.name not in ("kvmesh.bench.spec_emulated", "kvmesh.bench"):
            raise
        console.print(
            "[red]kvmesh bench spec --emulated: kvmesh.bench.spec_emulated is not in "
            "this checkout (the emulated variant is not available yet)[/red]"
        )
        return 2
    result = emulated(out, quick, bench)
    if isinstance(result, dict) and result.get("rows"):
        spec_report.print_rows(console, "kvmesh bench spec --emulated", result["rows"])
    console.print(f"results in {out}")
    return 0


def main(args: argparse.Namespace) -> int:
    name = "spec-emulated" if args.emulated else "spec"
    return BenchRun(name, args.out).call(_main, args)


def _main(args: argparse.Namespace, bench: BenchRun) -> int:
    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.emulated:
        return run_emulated(console, out, bool(args.quick), bench)
    try:
        plan = make_plan(args)
        specs = {"off": None, "ngram": json.loads(args.ngram_config)}
        specs["mtp"] = json.loads(args.mtp_config)
    except ValueError as exc:
        console.print(f"[red]kvmesh bench spec: {exc}[/red]")
        return 2
    model = None if args.model in (None, "", "default") else args.model
    serve_args = ["--max-num-seqs", str(max(16, plan.batch_sizes[-1]))]
    serve_args += ["--num-threads", str(plan.threads)] + (["--model", model] if model else [])
    serve_args += shlex.split(args.engine_args)
    t0 = time.perf_counter()
    results: dict = {
        "config": asdict(plan)
        | {"model": model or "SmolLM2-135M-Instruct (embedded)", "quick": bool(args.quick)}
        | {"serve_args": serve_args, "cpu_count": os.cpu_count()}
        | {"python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")},
        "loadavg": {"start": os.getloadavg()[0]},  # others' CPU use makes every figure noisy
        "arms": {},
    }
    bench.config = results["config"]
    bench.total = len(plan.arms) * len(plan.workloads) * len(plan.batch_sizes)
    for i, arm in enumerate(plan.arms):
        bench.phase(f"arm {arm}", i + 1, len(plan.arms))
        results["arms"][arm] = run_arm(arm, specs[arm], plan, serve_args, out, bench)
    results["loadavg"]["end"] = os.getloadavg()[0]
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    results["rows"] = spec_report.rows(results["arms"])
    results["greedy_match"] = spec_report.greedy_check(results["arms"])
    results["targets"] = spec_report.targets(results["rows"])
    (out / "spec.json").write_text(json.dumps(results, indent=2) + "\n")
    spec_report.write_plot(results, out / "spec.png")
    spec_report.print_report(console, results)
    console.print(
        f"wall {results['wall_s']} s; results: {out / 'spec.json'}, chart: {out / 'spec.png'}"
    )
    return 1 if results["greedy_match"]["mismatches"] else 0


if __name__ == "__main__":  # pragma: no cover
    from kvmesh.cli import main as cli_main

    sys.exit(cli_main(["bench", "spec", *sys.argv[1:]]))
