"""How long a decoding stream stalls while another request's long prefix loads from the disk
tier: synchronous loads (inside the step, `--no-kv-offloading-async`) against asynchronous ones
(on the copy worker, the request in WAITING_FOR_REMOTE_KVS), in one run on one engine.

The real engine (SmolLM2-135M on this CPU) is stepped in this process, as its engine thread
would: no HTTP, so the gaps are the engine's own. Setup: the prompt is computed once and pushed
out of the device and the (tiny) host tier by a filler, so only the disk tier holds it. Each
trial: a stream decodes; the prompt arrives; the stream's largest inter-token gap between that
arrival and the prompt's first token is the stall. Between trials the filler comes back (from
the tiers, cheaply) and pushes the prompt down to disk again. Modes alternate, sync first; a
third, `device`, sends the prompt again while it is still on the device: no load at all, only
the step that computes its last block, which every mode ends with (the floor of the stall)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmesh.bench.progress import BenchRun

DECODE_PROMPT = "Count the boats in the harbour, one per line:"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-tokens", type=int, default=4000, help="Tokens of the loaded prompt.")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="Torch threads (0: all).")
    p.add_argument("--repeats", type=int, default=2, help="Trials of each mode.")
    p.add_argument("--disk-path", default=None, help="Folder for the disk tier (default: tmp).")
    p.add_argument("--quick", action="store_true", help="CI-sized: a 400-token prompt, 1 trial.")
    p.add_argument("--out", default="bench-results/tier-stall", help="Folder for the JSON.")


def _run(core, requests: list, on_token=None) -> None:
    """Step until these requests finish; on_token(request_id, time) for every token."""
    for req in requests:
        core.add_request(req)
    while any(not r.is_finished for r in requests):
        for out in core.step():
            if on_token is not None and out.token_ids:
                on_token(out.request_id, time.perf_counter())


def _trial(core, prompt: list[int], decode_ids: list[int], n: int, mode: str) -> dict:
    from kvmesh.engine.sequence import Request, SamplingParams

    greedy = {"temperature": 0, "ignore_eos": True}
    decoder = Request(f"d-{mode}-{n}", decode_ids, SamplingParams(max_tokens=4096, **greedy))
    loader = Request(f"p-{mode}-{n}", prompt, SamplingParams(max_tokens=1, **greedy))
    times: list[float] = []
    core.add_request(decoder)
    while len(times) < 8:  # a steady stream first
        for out in core.step():
            if out.token_ids:
                times.append(time.perf_counter())
    arrival = time.perf_counter()
    first_token = 0.0

    def on_token(rid: str, t: float) -> None:
        nonlocal first_token
        if rid == decoder.request_id:
            times.append(t)
        elif not first_token:
            first_token = t

    disk = core.kv.offloader.tiers[-1]
    hits_before = disk.hit_blocks
    _run(core, [loader], on_token)
    core.abort_request(decoder.request_id)
    during = [
        b - a for a, b in zip(times, times[1:], strict=False) if b >= arrival and a <= first_token
    ]
    before = [b - a for a, b in zip(times, times[1:], strict=False) if b < arrival]
    return {
        "mode": mode,
        "max_gap_s": round(max(during), 4),
        "gaps_during_s": [round(g, 4) for g in during],
        "median_gap_before_s": round(statistics.median(before), 4),
        "decode_tokens_during_load": sum(1 for t in times if arrival <= t <= first_token),
        "ttft_s": round(first_token - arrival, 4),
        "cached_tokens": loader.num_cached_tokens,
        "disk_blocks_loaded": disk.hit_blocks - hits_before,
    }


def main(args: argparse.Namespace) -> int:
    return BenchRun("tier-stall", args.out).call(_main, args)


def _main(args: argparse.Namespace, bench: BenchRun) -> int:
    from kvmesh.engine.builder import build_engine
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.sequence import Request, SamplingParams

    if args.quick:
        args.prompt_tokens, args.repeats = 400, 1
    bs = args.block_size
    prompt_blocks = -(-args.prompt_tokens // bs)
    device_blocks = prompt_blocks + 24  # the prompt and the decoding stream fit together
    per_block = 2 * bs * 3 * 64 * 30 * 4  # SmolLM2-135M, float32
    disk_dir = args.disk_path or tempfile.mkdtemp(prefix="kvmesh-stall-")
    config = EngineConfig(
        block_size=bs,
        num_gpu_blocks=device_blocks,
        max_model_len=device_blocks * bs,
        kv_offloading_size=16 * per_block / 2**30,  # 16 blocks: nearly all of it spills
        kv_offloading_disk_path=disk_dir,
        kv_offloading_disk_size=(3 * device_blocks) * per_block / 2**30,
        num_threads=args.threads or None,
    )
    console = Console()
    bench.total = 3 * args.repeats
    bench.note("building the engine (SmolLM2-135M on this CPU)")
    bundle = build_engine(config)
    core = bundle.engine.core
    loads = core.kv.loads
    assert loads is not None and core.runner.kv_bytes_per_block == per_block
    vocab = range(1000, 1000 + 40000)
    prompt = [vocab[(i * 7919) % len(vocab)] for i in range(args.prompt_tokens)]
    filler = [vocab[(i * 104729 + 13) % len(vocab)] for i in range((device_blocks - 1) * bs)]
    decode_ids = core.tokenizer.encode(DECODE_PROMPT)
    once = {"max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    trials = []
    try:  # a run stopped early still closes the engine (its disk and load threads)
        bench.note(f"prefilling the {args.prompt_tokens}-token prompt")
        _run(core, [Request("prompt", prompt, SamplingParams(**once))])
        for n in range(args.repeats):
            for mode in ("sync", "async", "device"):
                if mode != "device":  # the prompt goes down to disk again
                    _run(core, [Request(f"filler-{mode}-{n}", filler, SamplingParams(**once))])
                core.kv.loads = None if mode == "sync" else loads
                trials.append(_trial(core, prompt, decode_ids, n, mode))
                console.print(trials[-1])
                bench.add(trials[-1], f"{mode}, repeat {n + 1}/{args.repeats}")
    finally:
        bundle.close()
    console.print(f"setup and trials: {time.perf_counter() - t0:.0f} s")

    table = Table(
        title=f"Decode stall while a {args.prompt_tokens}-token prefix loads from disk "
        "(SmolLM2-135M on this CPU)"
    )
    cols = ("prefix from", "max gap (median)", "max gap (worst)", "gap before", "tokens", "TTFT")
    for col in cols:
        table.add_column(col, justify="left" if col == "prefix from" else "right")
    summary = {}
    names = {"sync": "disk, sync load", "async": "disk, async load", "device": "device"}
    for mode in ("sync", "async", "device"):
        rows = [t for t in trials if t["mode"] == mode]
        worst = max(r["max_gap_s"] for r in rows)
        summary[mode] = {
            "max_gap_s": worst,
            "max_gap_median_s": statistics.median(r["max_gap_s"] for r in rows),
            "median_gap_before_s": statistics.median(r["median_gap_before_s"] for r in rows),
            "decode_tokens_during_load": min(r["decode_tokens_during_load"] for r in rows),
            "ttft_s": statistics.median(r["ttft_s"] for r in rows),
        }
        s = summary[mode]
        table.add_row(
            names[mode],
            f"{s['max_gap_median_s'] * 1000:.0f} ms",
            f"{worst * 1000:.0f} ms",
            f"{s['median_gap_before_s'] * 1000:.0f} ms",
            str(s["decode_tokens_during_load"]),
            f"{s['ttft_s'] * 1000:.0f} ms",
        )
    console.print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if not callable(v)}
    results = {"settings": settings, "summary": summary, "trials": trials}
    (out / "tier_stall.json").write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"results: {out / 'tier_stall.json'}")
    return 0
