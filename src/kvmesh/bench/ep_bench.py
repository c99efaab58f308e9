"""`kvmesh bench ep`: wide expert parallelism against tensor parallelism, on the emulated
GLM-5.2-class MoE (753B, 39B active, MLA, 256 experts, top-8), at rising concurrency.

Layouts, side by side in one run: TP8 (one replica on an 8-GPU node: every weight split 8 ways,
two NVLink all-reduces per layer, MLA's latent KV replicated on each GPU) and DP8/EP8, DP16/EP16,
DP32/EP32 (data-parallel attention: every GPU a rank with its own scheduler and KV cache; the
routed experts spread over all ranks; tokens dispatched to their experts and combined back over
NVLink inside a node and 400 Gb/s InfiniBand/RoCE between nodes). Each rank is the real engine
scheduler and block pool, the ranks step in lockstep in virtual time, and each step lasts what
the instance roofline says (kvmesh.engine.emulation.wide_ep). C closed-loop users (each sends
its next request when the previous ends) drive one instance per layout and concurrency; no GPU
and no HTTP are involved, so the whole run takes minutes on one core.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvmesh.bench.ep_load import ClosedLoop, Traffic
from kvmesh.bench.ep_report import compare_text, plot, print_table
from kvmesh.bench.progress import BenchRun
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.emulation.dp_group import DPGroup
from kvmesh.engine.emulation.expert_load import PLACEMENTS, ExpertRouting
from kvmesh.engine.emulation.instance_roofline import InstanceRoofline
from kvmesh.engine.emulation.latency import ACCELERATORS, MODELS, SequenceWork
from kvmesh.engine.emulation.layouts import (  # noqa: F401 - LAYOUT_RE is this module's API too
    LAYOUT_RE,
    layout_name,
    parse_layout,
)
from kvmesh.engine.emulation.layouts import build_roofline as layout_roofline
from kvmesh.engine.emulation.wide_ep import ALL2ALL_BACKENDS

EPILOG = """Measured per layout and concurrency C, over the window after the warm-up steps
(virtual time; the first requests start mid-stream, so the window is near steady state):
  output tok/s per GPU  output tokens of the window / its seconds / the layout's GPUs
  ITL p50 / p90         time between consecutive tokens of a request (a step, or more when
                        chunked prefill or a preemption stretches it)
  TTFT p50              arrival -> first token of the window's arrivals; one still queued at
                        the end counts with its wait so far (a lower bound, marked >=)
  decode-only           analytic: the roofline's steady decode step with min(C, KV room,
                        --max-num-seqs) sequences at context input + output/2, as the decode
                        side of a P/D deployment (the llm-d wide-EP guide's setting) runs it
Output: ep.json, ep.png and the table. llm-d's wide-EP guide reports ~2.2k output tok/s per
H200 at 2k in / 2k out and concurrency 2048; the last lines say how the model compares."""
LLMD_TOK_S_PER_GPU = 2200.0  # llm-d wide-EP guide (v0.3 blog, quoted in vLLM's): per H200
GUIDE_USERS = 2048  # the guide's concurrency (2k in / 2k out)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.epilog, parser.formatter_class = EPILOG, argparse.RawDescriptionHelpFormatter
    a = parser.add_argument
    a("--layouts", default="tp8,dp8,dp16,dp32", help="tpN / dpN (EP = DP) [tp8,dp8,dp16,dp32].")
    a("--concurrency", default="1,64,256,1024,2048", help="Users C [1,64,256,1024,2048].")
    a("--gpu", default="h200", choices=sorted(ACCELERATORS), help="Emulated GPU [h200].")
    moe = sorted(k for k, m in MODELS.items() if m.num_experts)
    a("--model", default="glm-5.2-moe", choices=moe, help="Emulated MoE model [glm-5.2-moe].")
    a(
        "--workload",
        default="random",
        choices=("random", "agentic"),
        help="random: unique prompts of --input-len; agentic: sessions sharing a system prompt "
        "per group, each turn the last prompt + its answer + --turn-tokens [random].",
    )
    a("--input-len", type=int, default=2048, help="Prompt tokens (agentic: first turn) [2048].")
    a("--output-len", type=int, default=2048, help="Output tokens per request [2048].")
    a("--shared-prefix-len", type=int, default=2048, help="Agentic: shared system prompt [2048].")
    a("--group-size", type=int, default=16, help="Agentic: sessions per system prompt [16].")
    a("--turn-tokens", type=int, default=512, help="Agentic: tokens a later turn adds [512].")
    a("--max-context", type=int, default=32768, help="Agentic: restart past it [32768].")
    a(
        "--dp-rank-affinity",
        action="store_true",
        help="Agentic: later turns name their session's first rank (X-data-parallel-rank, as "
        "a prefix-aware router would); default: vLLM's internal load balancer picks.",
    )
    a(
        "--expert-routing",
        default="uniform",
        choices=("uniform", "zipf"),
        help="Token-to-expert distribution; zipf: hot experts per layer, a seeded order [uniform].",
    )
    a("--zipf-s", type=float, default=1.0, help="Zipf exponent of expert popularity [1.0].")
    a("--expert-placement-strategy", default="linear", choices=PLACEMENTS, help="[linear].")
    a(
        "--enable-dbo",
        action="store_true",
        help="Dual-batch overlap (vLLM's --enable-dbo): two micro-batches, one's all-to-all "
        "under the other's kernels.",
    )
    a(
        "--all2all-backend",
        default="deepep_low_latency",
        choices=ALL2ALL_BACKENDS,
        help="low_latency: every pick crosses on its own; high_throughput: once per remote "
        "node, forwarded over NVLink [deepep_low_latency].",
    )
    a("--max-num-seqs", type=int, default=256, help="Per rank (llm-d decode: 256) [256].")
    a("--max-num-batched-tokens", type=int, default=8192, help="Per rank [8192].")
    a("--block-size", type=int, default=64, help="KV block size (MLA kernels use 64) [64].")
    a("--gpu-memory-utilization", type=float, default=0.9, help="[0.9].")
    a("--step-overhead-ms", type=float, default=2.0, help="Fixed cost per step, ms [2.0].")
    a("--warmup-steps", type=int, default=200, help="Unmeasured lockstep steps [200].")
    a("--steps", type=int, default=400, help="Measured lockstep steps [400].")
    a("--seed", type=int, default=0, help="Seed of the warm start and the routing [0].")
    a("--out", type=Path, default=Path("bench-results/ep"), help="Output directory.")
    a("--quick", action="store_true", help="Smoke-sized: C 1,16; 128 in / 32 out; 5+20 steps.")


def build_roofline(kind: str, n: int, args: argparse.Namespace) -> InstanceRoofline:
    return layout_roofline(
        kind,
        n,
        args.gpu,
        args.model,
        routing=ExpertRouting(args.expert_routing, args.zipf_s, args.seed),
        step_overhead_ms=args.step_overhead_ms,
        gpu_memory_utilization=args.gpu_memory_utilization,
        placement=args.expert_placement_strategy,
        enable_dbo=args.enable_dbo,
        all2all_backend=args.all2all_backend,
    )


def decode_only(roofline: InstanceRoofline, users: int, context: int, args) -> dict:
    """The steady decode step of `users` sequences at `context` tokens, as many as fit."""
    per_rank_room = int(roofline.kv_capacity_bytes() // roofline.model.kv_bytes_per_token)
    cap = min(args.max_num_seqs, per_rank_room // max(1, context))
    running = min(users, cap * roofline.dp_size)
    base, extra = divmod(running, roofline.dp_size)
    works = [[SequenceWork(1, context)] * (base + (r < extra)) for r in range(roofline.dp_size)]
    cost = roofline.step_cost(works)
    rate = running / cost.time / roofline.num_gpus if cost.time else 0.0
    return {
        "tok_s_per_gpu": round(rate, 1),
        "running": running,
        "step_ms": round(cost.time * 1e3, 2),
        "comm_ms": round(cost.comm * 1e3, 2),
        "compute_ms": round(cost.compute * 1e3, 2),
    }


def _config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )


def run(args: argparse.Namespace, bench: BenchRun) -> dict:
    from kvmesh.engine.tokenizer import load_tokenizer

    if args.quick:
        args.concurrency, args.input_len, args.output_len = "1,16", 128, 32
        args.warmup_steps, args.steps = 5, 20
    layouts = [parse_layout(x) for x in args.layouts.split(",") if x.strip()]
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not layouts or not levels or min(levels) < 1:
        raise ValueError("--layouts and --concurrency need at least one entry each, C >= 1")
    traffic = Traffic(
        args.input_len,
        args.output_len,
        args.workload,
        args.shared_prefix_len,
        args.group_size,
        args.turn_tokens,
        args.max_context,
        args.dp_rank_affinity,
    )
    tokenizer = load_tokenizer(None)[0]
    context = args.input_len + args.output_len // 2
    results: list[dict] = []
    per_run = args.warmup_steps + args.steps
    bench.total = len(layouts) * len(levels)
    progress = bench.progress
    for kind, n in layouts:
        name = layout_name(kind, n)
        for users in levels:
            label = f"{name} C={users}"
            row = {"layout": name, "gpus": n, "concurrency": users}
            try:
                roofline = build_roofline(kind, n, args)
            except ValueError as exc:  # the model does not fit this layout on this GPU
                results.append({**row, "error": str(exc)})
                bench.add(results[-1], label)
                continue
            task = progress.add_task(f"{label}: steps", total=per_run)
            group = DPGroup(roofline, _config(args), tokenizer)
            loop = ClosedLoop(group, traffic, users, args.seed)
            loop.start(warm=True)
            window = loop.run(args.warmup_steps, args.steps, lambda t=task: progress.advance(t))
            progress.update(task, completed=per_run)
            row.update(window.summary(roofline.num_gpus, roofline.dp_size))
            row["kv_tokens_per_rank"] = group.num_blocks * args.block_size
            row["decode_only"] = decode_only(roofline, users, context, args)
            results.append(row)
            bench.add(row, label)
    return {"results": results}


def _config_of(args: argparse.Namespace) -> dict:
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    cfg.pop("func", None)
    return cfg


def main(args: argparse.Namespace) -> int:
    return BenchRun("ep", args.out, config=_config_of(args)).call(_main, args)


def _main(args: argparse.Namespace, bench: BenchRun) -> int:
    started = time.time()
    out = run(args, bench)
    out["config"] = _config_of(args)
    out["reference"] = {"llm-d wide-EP output tok/s per H200": LLMD_TOK_S_PER_GPU}
    out["guide_setting"] = guide_setting(args)
    out["comparison"] = compare_text(out["results"], out["guide_setting"], LLMD_TOK_S_PER_GPU)
    out["wall_s"] = round(time.time() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ep.json").write_text(json.dumps(out, indent=2))
    print_table(out["results"], args)
    plot(out["results"], args.out / "ep.png", LLMD_TOK_S_PER_GPU)
    print("\n".join(out["comparison"]))
    print(f"wrote {args.out / 'ep.json'} and {args.out / 'ep.png'}")
    return 0


def guide_setting(args: argparse.Namespace) -> dict:
    """The llm-d guide's decode setting on this GPU: DP16/EP16, C 2048, 2k in / 2k out,
    decode-only, with and without dual-batch overlap."""
    out = {"gpu": args.gpu, "layout": "DP16/EP16", "concurrency": GUIDE_USERS}
    for dbo in (False, True):
        probe = argparse.Namespace(**{**vars(args), "enable_dbo": dbo})
        try:
            roofline = build_roofline("dp", 16, probe)
        except ValueError as exc:
            return {**out, "error": str(exc)}
        key = "decode_only_dbo" if dbo else "decode_only"
        out[key] = decode_only(roofline, GUIDE_USERS, 2048 + 1024, probe)
    return out
