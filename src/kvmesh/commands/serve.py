"""`kvmesh serve`: one engine or emulated engines; and the settings `kvmesh up` shares with it
(`up` runs `serve` and `router` as child processes: commands.up, which builds on this module)."""

from __future__ import annotations

import argparse
import errno
import sys
from typing import TYPE_CHECKING

from kvmesh.commands.checks import model_problem
from kvmesh.commands.flags import config_from_args

# the flags' helps, read from here by tests and tools (their home is commands.serve_flags)
from kvmesh.commands.serve_flags import EMULATION_HELP as EMULATION_HELP
from kvmesh.commands.serve_flags import ENGINE_HELP as ENGINE_HELP
from kvmesh.engine.config import EngineConfig
from kvmesh.protocol.wording import plural

if TYPE_CHECKING:
    from kvmesh.engine.emulation.config import EmulationConfig


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.model == "default":
        args.model = None
    from kvmesh.protocol import auth

    args.api_key = auth.env_key(args.api_key, auth.API_KEY_ENV)
    args.admin_api_key = auth.env_key(args.admin_api_key, auth.ADMIN_KEY_ENV)
    args.kv_transfer_api_key = auth.env_key(args.kv_transfer_api_key, auth.KV_TRANSFER_KEY_ENV)
    return config_from_args(EngineConfig, args)


# the router's scheduling and failure-handling flags that `kvmesh up` takes as well (the ones the
# engine and router share, --block-size, --api-key and the like, are the engine's, passed on)
UP_ROUTER_FLAGS = (
    "preset", "scheduler_config", "max_retries", "scrape_interval", "first_byte_timeout",
    "non_streaming_first_byte_timeout", "stream_idle_timeout", "outlier_consecutive_errors",
    "outlier_base_ejection_time", "outlier_max_ejection_time", "outlier_max_ejection_percent",
    "healthy_panic_threshold", "kv_index_warmup_timeout", "kv_peer_min_cached_token_delta",
)  # fmt: skip


def up_router_config(config: EngineConfig, args: argparse.Namespace, endpoints, kv_events="auto"):
    """The RouterConfig of `kvmesh up`: the engines' own settings where both have one, the
    router flags given to `up` for the rest."""
    from kvmesh.router.config import RouterConfig

    chosen = {name: getattr(args, name) for name in UP_ROUTER_FLAGS if hasattr(args, name)}
    return RouterConfig(
        endpoints=list(endpoints),
        block_size=config.block_size,
        prefix_caching_hash_algo=config.prefix_caching_hash_algo,
        kv_events=kv_events,
        api_key=config.api_key,  # clients send it to the router, the router to the engines
        endpoint_api_key=config.api_key,
        trust_request_chat_template=config.trust_request_chat_template,
        served_model_name=config.served_model_name,
        **chosen,
    )


def engine_settings(args: argparse.Namespace) -> tuple[EngineConfig, EmulationConfig | None]:
    """The engine's config and the emulation's (None: a real engine) from the flags of `serve`
    or `up`; ValueError for a bad one. `serve` emulates when asked (--emulate) or when an
    --emulate-* flag leaves its default."""
    config = _engine_config(args)
    from kvmesh.engine.emulation.config import EmulationConfig

    given, base = config_from_args(EmulationConfig, args), EmulationConfig()
    named = (given.emulate_model, given.emulate_gpu, given.emulate_ttft_ms)
    if args.emulate or (
        args.command == "serve" and named != (base.emulate_model, base.emulate_gpu, None)
    ):
        return config, given
    return config, None


def check_model(config: EngineConfig, emu: EmulationConfig | None) -> None:
    """ValueError when the model cannot be served (weights are needed unless emulated)."""
    problem = model_problem(config.model, weights=emu is None)
    if problem:
        raise ValueError(problem)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config, emu = engine_settings(args)
        check_model(config, emu)
    except ValueError as exc:
        print(f"kvmesh {args.command}: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(config, emu, args)
    except OSError as exc:  # a port taken since it was checked (`kvmesh up`), or never free
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"kvmesh serve: cannot listen: {exc}", file=sys.stderr)
        return 1


def _serve(config: EngineConfig, emu, args: argparse.Namespace) -> int:
    if emu is not None:
        if config.data_parallel_size > 1:
            return run_emulated_data_parallel(config, emu, args)
        return run_emulated(config, emu, args)
    if config.data_parallel_size > 1:
        return serve_data_parallel(config, args)
    from kvmesh.engine.builder import build_engine
    from kvmesh.engine.server import serve

    try:
        bundle = build_engine(config)
    except ValueError as exc:  # a setting only the build can check (a tier path, say)
        print(f"kvmesh serve: {exc}", file=sys.stderr)
        return 2
    serve(bundle, args.host, args.port)
    return 0


def serve_data_parallel(config: EngineConfig, args: argparse.Namespace) -> int:
    """Internal LB (ranks behind one front door), or one rank alone when --data-parallel-rank
    is given (external LB: rank 0 hosts the rendezvous)."""
    if "data_parallel_rank" not in vars(args):
        from kvmesh.engine.dp.launcher import serve_data_parallel as serve_ranks

        return serve_ranks(config, args.host, args.port)
    from kvmesh.engine.config import DEFAULT_DP_RPC_PORT
    from kvmesh.engine.dp.rank import RankSpec, rank_config, run_rank

    rank = config.data_parallel_rank
    port = config.data_parallel_rpc_port or DEFAULT_DP_RPC_PORT
    spec = RankSpec(args.host, args.port, config.data_parallel_address, port, rank == 0)
    try:
        return run_rank(rank_config(config, rank), spec)
    except (OSError, RuntimeError, ValueError) as exc:  # a taken port, a failed rendezvous
        print(f"kvmesh serve: data-parallel rank {rank}: {exc}", file=sys.stderr)
        return 1


def run_emulated_data_parallel(config: EngineConfig, emu, args: argparse.Namespace) -> int:
    """One emulated DP (or DP/EP) instance: N rank engines behind one front door on --port."""
    if args.emulate > 1:
        print(
            "kvmesh serve: --emulate N with --data-parallel-size: one emulated instance only",
            file=sys.stderr,
        )
        return 2
    from kvmesh.engine.emulation.dp_server import serve_emulated_data_parallel
    from kvmesh.engine.tokenizer import load_tokenizer

    tokenizer, _ = load_tokenizer(config.model)
    return serve_emulated_data_parallel(config, emu, tokenizer, args.host, args.port)


def run_emulated(config: EngineConfig, emu, args: argparse.Namespace) -> int:
    """`kvmesh serve --emulate N`: N emulated engines on consecutive ports from --port."""
    from kvmesh.engine import load_progress
    from kvmesh.engine.emulation.host import EmulatedFleet
    from kvmesh.engine.server import run, wait_for_shutdown
    from kvmesh.engine.tokenizer import load_tokenizer

    count = args.emulate or 1
    load_progress.step("loading the tokenizer (emulated engines load no weights)")
    tokenizer, _ = load_tokenizer(config.model)

    async def main() -> None:
        load_progress.step("building %s", plural(count, "emulated engine"))
        fleet = EmulatedFleet(config, emu, tokenizer, count)
        urls = await fleet.start(args.host, args.port)
        spec = f"{emu.emulate_model} on {emu.tensor_parallel_size} x {emu.emulate_gpu}"
        blocks = fleet.bundles[0].engine.core.kv.pool.num_blocks
        engines = plural(count, "emulated engine")
        print(f"kvmesh: {engines}, {spec}, {blocks} KV blocks each", flush=True)
        for url in urls:
            print(f"  engine {url}/v1", flush=True)
        try:
            await wait_for_shutdown()
        finally:
            await fleet.stop()

    run(main())
    return 0
