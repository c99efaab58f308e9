"""One workload through each routing policy over the same fleet, side by side.

Starts N emulated engines once (or uses --endpoints, e.g. real vLLM pods), then for each policy
starts a router (kvmesh presets; sglang-router / vllm-router policies as sglang:NAME, vllm:NAME
where installed), clears the engines' prefix caches, runs the workload through it and stops it.
Prints hit rate (with the workload's ceiling: an infinite cache on one engine), TTFT p50/p90/p99,
ITL p50, output tokens/s, requests per engine max/mean, engine busy time, preemptions and errors;
writes fleet.json and fleet.png (TTFT CDF, hit rate over time, requests per engine) to --out.
--router-replicas adds rows of kvmesh router replicas, active-active behind a round-robin front
(bench.replicas)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console

from kvmesh.bench import cli_args, loadgen, replicas
from kvmesh.bench.engine_probes import (
    engine_timing,
    kv_move_counters,
    kvmesh_engines,
    reset_caches,
    router_metrics,
)
from kvmesh.bench.fleet_plot import plot
from kvmesh.bench.fleet_procs.engines import start_fleet_engines
from kvmesh.bench.fleet_procs.routers import Target, peer_bin, start_router
from kvmesh.bench.progress import BenchRun
from kvmesh.bench.workloads import hit_ceiling

POLICIES = "round-robin,random,load,approx-prefix,precise-prefix,kvmesh"
# fmt: off
QUICK = {  # CI-sized workloads, unless the flags say otherwise
    "agentic": {"sessions": 4, "turns": 3, "system_tokens": 400, "tool_def_tokens": 400,
                "repos": 2, "repo_tokens": 800, "tool_tokens": 200, "answer_tokens": 16,
                "think_s": 0.05, "fanout": 2, "fanout_rate": 0.5, "sub_turns": 1},
    "shared-prefix": {"groups": 2, "prompts_per_group": 6, "system_tokens": 800,
                      "output_tokens": 16},
    "trace": {"limit": 40, "rate": 8.0, "max_output": 16},
}
# fmt: on


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=8, help="Emulated engines [8].")
    parser.add_argument(
        "--endpoints",
        default="",
        help="Comma-separated engine URLs to use instead of starting engines.",
    )
    parser.add_argument(
        "--policies",
        default=POLICIES,
        help=f"Comma-separated kvmesh presets and sglang:P / vllm:P [{POLICIES}].",
    )
    parser.add_argument("--emulate-gpu", default="h100", help="Emulated accelerator [h100].")
    parser.add_argument(
        "--emulate-model", default="llama-3.1-8b", help="Emulated model [llama-3.1-8b]."
    )
    parser.add_argument(
        "--emulate-time-scale",
        type=float,
        default=1.0,
        help="Run the emulated engines in slow motion: every step lasts K times its predicted "
        "time, arrivals and think times are stretched K times and measured times divided by K, "
        "so a host too small for the fleet's token rate still measures it faithfully; below 1, "
        "fast motion, for a long replay whose token rate the host has to spare [1].",
    )
    parser.add_argument(
        "--serve-args",
        default="",
        help="Extra `kvmesh serve` flags for the engines, e.g. '--num-gpu-blocks 100000'; "
        "{engines} stands for the engines' host:port list (e.g. '--kv-peer-allowlist {engines}').",
    )
    parser.add_argument(
        "--router-variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="Also run a kvmesh router labelled NAME with these `kvmesh router` flags after its "
        "--preset (kvmesh unless FLAGS set it), e.g. "
        "'peer=--kv-peer-min-cached-token-delta 512'. Repeatable.",
    )
    parser.add_argument(
        "--engine-variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="Also run every policy over a fresh fleet whose engines take these extra `kvmesh "
        "serve` flags after --serve-args; its rows are labelled POLICY@NAME, e.g. "
        "'host=--kv-offloading-size 64' for the host tier on against off. Repeatable.",
    )
    parser.add_argument(
        "--router-port",
        type=int,
        default=0,
        help="Port of the first policy's router on 127.0.0.1; the routers run one at a time, "
        "the i-th on this port + i. 0: a free port each [0].",
    )
    parser.add_argument(
        "--router-replicas",
        default="",
        metavar="N,N,...",
        help="Also run the kvmesh preset as N router replicas, active-active, behind a "
        "round-robin front (--replica-front), a row 'kvmesh xN' per count, e.g. 1,2,4; each "
        "replica subscribes to every engine's KV events itself and shares nothing with the "
        "others; routers on free ports. Off by default.",
    )
    parser.add_argument(
        "--replica-front",
        choices=tuple(replicas.FRONTS),
        default="balancer",
        help="The replicas' round-robin front: a tiny HTTP balancer that passes every header on "
        "(as a Kubernetes Service or Envoy would), or a kvmesh round-robin router, which sends "
        "the replicas no client header such as x-session-id [balancer].",
    )
    parser.add_argument("--sglang-router-bin", default=None, help="sglang-router executable.")
    parser.add_argument("--vllm-router-bin", default=None, help="vllm-router executable.")
    parser.add_argument("--out", default="bench-fleet", help="Output folder [bench-fleet].")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI size: 2 engines, round-robin and kvmesh, a small workload.",
    )
    cli_args.add_workload_args(parser)


def _targets(spec: str, variants: list[str] = ()) -> list[Target]:
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        kind, _, policy = item.partition(":") if ":" in item else ("kvmesh", "", item)
        out.append(Target(kind, policy))
    for variant in variants:
        name, _, flags = variant.partition("=")
        if not name.strip() or not flags.strip():
            raise ValueError(f"--router-variant takes NAME=FLAGS, got {variant!r}")
        out.append(Target("kvmesh", "kvmesh", tuple(flags.split()), name.strip()))
    return out


def check_targets(wl_kind: str, ceiling: float, rows: dict[str, dict]) -> dict:
    """The issue's targets, where this run's policies and workload say something about them."""
    km, rr, out = rows.get("kvmesh"), rows.get("round-robin"), {}
    failed = sorted(name for name, s in rows.items() if s["errors"])
    if failed:  # no ratio from a run whose requests failed
        out["failed"] = failed
        km = None if km is None or km["errors"] else km
        rr = None if rr is None or rr["errors"] else rr
    if km and wl_kind == "agentic":
        out["kvmesh_of_ceiling"] = round(km["hit_rate"] / ceiling, 3) if ceiling else None
        out["kvmesh_of_ceiling_ok"] = bool(ceiling) and km["hit_rate"] >= 0.9 * ceiling
        if rr and rr["ttft_ms_p90"]:
            out["kvmesh_ttft_p90_over_rr"] = round(km["ttft_ms_p90"] / rr["ttft_ms_p90"], 3)
            out["kvmesh_ttft_p90_ok"] = km["ttft_ms_p90"] <= rr["ttft_ms_p90"] / 3
    if km and wl_kind == "trace":
        out["kvmesh_hit_rate_ok"] = km["hit_rate"] >= 0.33
        out["kvmesh_load_ok"] = km["load_max_mean"] <= 1.3
    return out


def _engine_variants(specs: list[str]) -> list[tuple[str, str]]:
    """('', '') for the base fleet, then (NAME, FLAGS) for each --engine-variant."""
    out = [("", "")]
    for spec in specs:
        name, _, flags = spec.partition("=")
        if not name.strip() or not flags.strip() or "@" in name:
            raise ValueError(f"--engine-variant takes NAME=FLAGS, got {spec!r}")
        out.append((name.strip(), flags.strip()))
    return out


def run_row(
    args: argparse.Namespace,
    wl,
    url: str,
    urls: list[str],
    timed: list[str],
    name: str,
    progress,
) -> dict:
    """loadgen's summary of `wl` sent to `url`, plus router_metrics (of `url`), kv_moves and
    timing (the engines' counters over the run; `timed`: the kvmesh engines among `urls`)."""
    pulls_before, timing_before = kv_move_counters(urls), engine_timing(timed)
    row = asyncio.run(
        loadgen.run_workload(
            url,
            wl,
            concurrency=args.concurrency,
            engines=urls,
            label=name,
            progress=progress,
            timeout_s=args.request_timeout,
            time_scale=args.time_scale_used,
            prompt_format=args.prompt_format,
        )
    )
    row["router_metrics"] = router_metrics(url)
    pulls, timing = kv_move_counters(urls), engine_timing(timed)
    row["kv_moves"] = {k: v - pulls_before.get(k, 0.0) for k, v in pulls.items()}
    row["timing"] = {k: v - timing_before.get(k, 0) for k, v in timing.items()}
    return row


def run_policies(
    args: argparse.Namespace,
    wl,
    urls: list[str],
    targets: list[Target],
    bins: dict,
    out: Path,
    bench: BenchRun | None,
    suffix: str = "",
) -> tuple[dict[str, dict], list[str]]:
    """The workload through a router per target over these engines: rows by label, each saved
    by `bench` as it finishes, and notes on what went wrong (a router that failed keeps the
    others' rows)."""
    progress = bench.progress if bench is not None else None
    rows: dict[str, dict] = {}
    skipped: list[str] = []
    timed = kvmesh_engines(urls)  # vLLM pods are not asked kvmesh's own routes
    for i, t in enumerate(targets):
        name = (t.name or (t.policy if t.kind == "kvmesh" else f"{t.kind}:{t.policy}")) + suffix
        notes = reset_caches(urls)
        for note in notes:
            skipped.append(f"prefix cache not reset before {name}: {note}")
        if notes and i > 0:  # engines without the route (vLLM outside dev mode): fresh words,
            # so this policy meets caches that hold none of its prompts, in the same shape
            skipped.append(f"{name}: ran on its own prompts (workload seed {wl.seed + i})")
        policy_wl = dataclasses.replace(wl, seed=wl.seed + i) if notes else wl
        port = args.router_port + i if getattr(args, "router_port", 0) else 0
        try:
            router, url = start_router(t, urls, [], bins, out, port)
        except RuntimeError as exc:  # one router that fails to start skips its row only
            skipped.append(f"{name}: did not start ({str(exc)[:200]})")
            continue
        try:
            rows[name] = row = run_row(args, policy_wl, url, urls, timed, name, progress)
            if bench is not None:
                bench.add({"name": name, **row}, name)
            rm = row["router_metrics"]
            if (
                t.kind == "kvmesh"
                and t.policy in ("precise-prefix", "kvmesh")
                and not rm.get('kvmesh_router_index_entries{index="precise"}')
            ):
                skipped.append(f"{name}: the router's precise index stayed empty (no KV events)")
        except Exception as exc:  # a failing policy must not lose the others' rows
            skipped.append(f"{name}: failed ({type(exc).__name__}: {str(exc)[:200]})")
        finally:
            router.stop()
    return rows, skipped


def main(args: argparse.Namespace) -> int:
    return BenchRun("fleet", args.out).call(_main, args)


def _main(args: argparse.Namespace, bench: BenchRun) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=170)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n, spec = args.engines, args.policies
    if args.quick:
        n = 2 if n == 8 else n
        spec = "round-robin,kvmesh" if spec == POLICIES else spec
    wl = cli_args.build_workload(args, **(QUICK[args.workload] if args.quick else {}))
    ceiling = hit_ceiling(wl.requests)
    targets, skipped = [], []
    bins = {
        "sglang": peer_bin("sglang", args.sglang_router_bin),
        "vllm": peer_bin("vllm", args.vllm_router_bin),
    }
    try:
        chosen = _targets(spec, args.router_variant)
        variants = _engine_variants(args.engine_variant)
        replica_counts = replicas.parse_counts(args.router_replicas)
    except ValueError as exc:
        console.print(f"kvmesh bench fleet: {exc}")
        return 2
    for t in chosen:
        if t.kind != "kvmesh" and not bins.get(t.kind):
            skipped.append(f"{t.kind}:{t.policy} ({t.kind}-router not installed)")
        else:
            targets.append(t)
    given = [u.strip().rstrip("/") for u in args.endpoints.split(",") if u]
    if given and args.engine_variant:
        console.print("kvmesh bench fleet: --engine-variant needs engines it starts")
        return 2
    if not 0 <= args.router_port <= 65535 - len(targets):
        console.print("kvmesh bench fleet: --router-port must leave a port for every policy")
        return 2
    scale = args.time_scale_used = 1.0 if given else args.emulate_time_scale  # real: real time
    if not scale > 0:
        console.print("kvmesh bench fleet: --emulate-time-scale must be positive")
        return 2
    desc = wl.describe()
    mode = f"closed loop, {args.concurrency} sessions" if args.concurrency else "open loop"
    title = (
        f"{wl.kind}: {desc['requests']} requests, {desc['sessions']} sessions, {mode}, "
        f"{len(given) or n} engines"
        + (f", slow motion x{scale:g}" if scale > 1 else "")
        + (f", fast motion x{1 / scale:.3g}" if scale < 1 else "")
    )
    console.print(f"{title}; hit-rate ceiling {ceiling['hit_rate']:.3f}")
    rows: dict[str, dict] = {}
    urls = given
    bench.total = len(variants) * (len(targets) + len(replica_counts))
    bench.config = {"title": title, "workload": desc, "ceiling": ceiling, "time_scale": scale}
    for variant, flags in variants:
        engines_proc = None
        if not given:
            label = f" ({variant}: {flags})" if variant else ""
            console.print(
                f"starting {n} emulated engines ({args.emulate_model} on {args.emulate_gpu}){label}"
            )
            log = f"engines-{variant}.log" if variant else "engines.log"
            engines_proc, urls = start_fleet_engines(args, n, out, flags, log)
        try:
            got, notes = run_policies(
                args, wl, urls, targets, bins, out, bench, f"@{variant}" if variant else ""
            )
            rows.update(got)
            skipped.extend(notes)
            if replica_counts:
                got, notes = replicas.run_replicas(
                    args,
                    wl,
                    urls,
                    replica_counts,
                    out,
                    bench,
                    run_row,
                    f"@{variant}" if variant else "",
                    seed_offset=len(targets),
                    front_kind=args.replica_front,
                )
                rows.update(got)
                skipped.extend(notes)
        finally:
            if engines_proc is not None:
                engines_proc.stop()
    for note in skipped:
        console.print(f"[yellow]note[/] {note}")
    for line in loadgen.failures(list(rows.items())):
        console.print(f"[red]FAILED[/] {line}")
    console.print(loadgen.table(list(rows.items()), ceiling["hit_rate"], title))
    if any("replicas" in s for s in rows.values()):
        console.print(replicas.table(rows))
    for name, s in rows.items():
        if any(s.get("kv_moves", {}).values()):
            console.print(f"KV moved, {name}: {s['kv_moves']}")
        behind = s.get("timing", {}).get("timeline_restarts")
        if behind:
            console.print(
                f"[yellow]note[/] {name}: engines fell behind their step timeline {behind:g} "
                f"times in {s['timing'].get('steps', 0):g} steps (host too busy for this pace)"
            )
    result = {
        "title": title,
        "workload": desc,
        "ceiling": ceiling,
        "engines": urls,
        "engine_variants": dict(variants[1:]),
        "concurrency": args.concurrency,
        "time_scale": scale,
        "skipped": skipped,
        "policies": rows,
        "targets": check_targets(wl.kind, ceiling["hit_rate"], rows),
    }
    for variant, _ in variants:
        suffix = f"@{variant}" if variant else ""
        got = replicas.targets(rows, suffix)
        result["targets"].update({k + suffix: v for k, v in got.items()})
    (out / "fleet.json").write_text(json.dumps(result, indent=1))
    if rows:
        plot(result, out / "fleet.png")
    console.print(f"targets: {result['targets']}")
    console.print(f"wrote {out / 'fleet.json'} and {out / 'fleet.png'}")
    bad = [k for k, s in rows.items() if s["errors"] == s["requests"]]
    return 1 if bad or not rows else 0
