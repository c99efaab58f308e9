"""`kvmesh sim`: replay a Mooncake-format trace through routing policies in virtual time.

Every policy sees the same requests on a fresh fleet of emulated engines (the real engine core,
a roofline step time, no HTTP), and the table compares them: hit rate against the trace's
ceiling, TTFT percentiles and per-engine load, the figures `kvmesh bench fleet --workload trace`
measures over HTTP, in a fraction of its time.

  kvmesh sim --trace ../shared/traces/mooncake_conversation_trace.jsonl --engines 4 \\
      --policies round-robin,kvmesh
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from kvmesh.sim.fleet import FleetSim, FleetSimConfig, SimRecord, SimRequest

TRACE_BLOCK = 512  # Mooncake hash_ids cover 512-token blocks
_TAIL_BASE = 1 << 40  # token ids of unshared tails start here, clear of every block's ids


def trace_requests(
    path: str, limit: int = 0, start: int = 0, time_scale: float = 1.0
) -> list[SimRequest]:
    """Block h of the trace is token ids h*512 .. h*512+511 wherever it appears (cut to the
    input length in a prompt's last block), so the prefix reuse is exactly the trace's."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start or not line.strip():
                continue
            if limit and len(rows) >= limit:
                break
            rows.append(json.loads(line))
    t0 = rows[0]["timestamp"] if rows else 0
    out = []
    for rid, row in enumerate(rows):
        n = int(row["input_length"])
        prompt: list[tuple[int, int]] = []
        for j, h in enumerate(row["hash_ids"]):
            take = min(TRACE_BLOCK, n - j * TRACE_BLOCK)
            if take <= 0:
                break
            prompt.append((h * TRACE_BLOCK, take))
        covered = sum(k for _, k in prompt)
        if n > covered:
            prompt.append((_TAIL_BASE + (start + rid) * (1 << 20), n - covered))
        at = (row["timestamp"] - t0) / 1000 * time_scale
        out.append(SimRequest(rid, at, tuple(prompt), max(1, int(row["output_length"]))))
    return out


def hit_ceiling(requests: list[SimRequest], block_size: int) -> float:
    """An infinite cache on one engine: leading full blocks seen in an earlier prompt (at most
    (n - 1) // block_size of an n-token prompt, as vLLM). A block is known by its whole prefix."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        ids = r.token_ids()
        n = len(ids)
        total += n
        keys, parent = [], 0
        for k in range(0, n - block_size + 1, block_size):
            parent = hash((parent, tuple(ids[k : k + block_size])))
            keys.append(parent)
        run, limit = 0, (n - 1) // block_size
        while run < limit and keys[run] in seen:
            run += 1
        hit += run * block_size
        seen.update(keys)
    return hit / total if total else 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def summarize(records: list[SimRecord], engines: int) -> dict:
    done = [r for r in records if r.first_token is not None]
    ttft = [r.ttft * 1e3 for r in done]
    load = [0] * engines
    for r in records:
        load[r.engine] += 1
    mean = sum(load) / engines if engines else 0
    prompt = sum(r.prompt_tokens for r in done)
    span = max((r.finished or 0.0) for r in records) if records else 0.0
    return {
        "requests": len(records),
        "unfinished": sum(r.finished is None for r in records),
        "hit_rate": round(sum(r.cached_tokens for r in done) / prompt, 4) if prompt else 0.0,
        **{f"ttft_ms_p{q}": round(pct(ttft, q), 1) for q in (50, 90, 99)},
        "ttft_ms_mean": round(sum(ttft) / len(ttft), 1) if ttft else 0.0,
        "output_tok_s": round(sum(r.output_tokens for r in records) / span, 1) if span else 0.0,
        # prompt share the router knew was cached elsewhere than where it sent the request
        "lost_to_routing": round(
            sum(r.best_known_tokens - r.chosen_known_tokens for r in records) / prompt, 4
        )
        if prompt
        else 0.0,
        "load": load,
        "load_max_mean": round(max(load) / mean, 3) if mean else 0.0,
    }


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace.")
    p.add_argument("--engines", type=int, default=4, help="Emulated engines [default: 4].")
    p.add_argument(
        "--policies",
        default="round-robin,kvmesh",
        help="Comma-separated router presets or EndpointPickerConfig YAML files "
        "[default: round-robin,kvmesh].",
    )
    p.add_argument("--limit", type=int, default=0, help="Replay the first N requests (0: all).")
    p.add_argument("--start", type=int, default=0, help="Skip the first N requests.")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="Multiply the trace's arrival offsets (0.5: twice the rate) [default: 1].",
    )
    p.add_argument(
        "--serve-args",
        default="",
        help='Engine flags as for `kvmesh serve --emulate`, e.g. "--kv-offloading-size 256".',
    )
    p.add_argument("--scrape-interval", type=float, default=0.1, help="Router scrape period, s.")
    p.add_argument(
        "--seed", type=int, default=0, help="Seed of the pickers' tie-breaks [default: 0]."
    )
    p.add_argument(
        "--jobs", type=int, default=1, help="Policies replayed at once, one process each [1]."
    )
    p.add_argument(
        "--output", default="", help="Write the results as JSON here, and a PNG beside it."
    )


def _configs(serve_args: str, engines: int, scrape: float, seed: int = 0) -> FleetSimConfig:
    from kvmesh.cli import build_parser
    from kvmesh.commands.flags import config_from_args
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.emulation.builder import EmulationConfig

    # xxhash unless asked otherwise: the routing is the same, the replay much faster
    argv = ["serve", "--emulate", "--prefix-caching-hash-algo", "xxhash", *shlex.split(serve_args)]
    args = build_parser().parse_args(argv)
    args.model = None if args.model == "default" else args.model
    return FleetSimConfig(
        engines=engines,
        scrape_interval=scrape,
        seed=seed,
        engine=config_from_args(EngineConfig, args),
        emulation=config_from_args(EmulationConfig, args),
    )


def run_policy(
    config: FleetSimConfig, spec: str, trace: tuple, progress: bool = False
) -> tuple[str, dict, list[SimRecord]]:
    """One policy over the trace on a fresh fleet: (label, summary, records). `trace` holds
    trace_requests' arguments, so a worker process reads the trace itself."""
    from tqdm import tqdm

    from kvmesh.engine.tokenizer import load_tokenizer

    name = policy = spec
    if spec.endswith((".yaml", ".yml")):  # an EndpointPickerConfig, labelled by its stem
        with open(spec) as f:
            policy = f.read()
        name = Path(spec).stem
    requests = trace_requests(*trace)
    sim = FleetSim(config, policy, load_tokenizer(config.engine.model)[0])
    t0 = time.perf_counter()
    show = progress and sys.stderr.isatty()
    with tqdm(
        total=len(requests), desc=name, unit="req", leave=False, mininterval=5, disable=not show
    ) as bar:
        records = sim.run(requests, lambda n: bar.update(n - bar.n))
    summary = summarize(records, config.engines)
    summary["sim_wall_s"] = round(time.perf_counter() - t0, 1)
    return name, summary, records


def _print_row(name: str, s: dict) -> None:
    print(
        f"{name:>14}  hit {s['hit_rate']:.3f}  TTFT p50/p90/p99 {s['ttft_ms_p50']:.0f}/"
        f"{s['ttft_ms_p90']:.0f}/{s['ttft_ms_p99']:.0f} ms  out {s['output_tok_s']:.0f} tok/s"
        f"  load max/mean {s['load_max_mean']:.2f}  lost to routing {s['lost_to_routing']:.3f}"
        f"  ({s['sim_wall_s']:.0f} s)",
        flush=True,
    )


def main(args: argparse.Namespace) -> int:
    try:
        config = _configs(args.serve_args, args.engines, args.scrape_interval, args.seed)
    except (ValueError, SystemExit) as exc:
        print(f"kvmesh sim: bad --serve-args: {exc}", file=sys.stderr)
        return 2
    specs = [p for p in args.policies.split(",") if p]
    for spec in specs:
        if spec.endswith((".yaml", ".yml")) and not Path(spec).is_file():
            print(f"kvmesh sim: no such policy file {spec}", file=sys.stderr)
            return 2
    trace = (args.trace, args.limit, args.start, args.time_scale)
    requests = trace_requests(*trace)
    ceiling = hit_ceiling(requests, config.engine.block_size)
    del requests
    print(
        f"{args.limit or 'all'} requests of {args.trace}, {args.engines} engines; "
        f"hit-rate ceiling {ceiling:.3f}"
    )
    results: dict = {"ceiling": round(ceiling, 4), "policies": {}}
    runs: dict[str, list[SimRecord]] = {}
    if args.jobs > 1 and len(specs) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(args.jobs, len(specs))) as pool:
            futures = [pool.submit(run_policy, config, spec, trace) for spec in specs]
            done = [f.result() for f in futures]
    else:
        done = (run_policy(config, spec, trace, progress=True) for spec in specs)
    for name, summary, records in done:
        _print_row(name, summary)
        results["policies"][name] = summary
        runs[name] = records
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
        from kvmesh.sim.plot import plot_policies

        png = args.output.removesuffix(".json") + ".png"
        plot_policies(png, runs, results["policies"], ceiling)
        print(f"wrote {args.output} and {png}")
    return 0
