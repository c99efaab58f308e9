"""`kvmesh router`: the cache-aware router in front of vLLM-compatible engines."""

from __future__ import annotations

import argparse
import sys

from kvmesh.commands.flags import config_from_args


async def wait_for_shutdown() -> None:
    from kvmesh.engine.server import wait_for_shutdown as wait

    await wait()


ROUTER_HELP = {
    "endpoints_file": "YAML/JSON list of endpoints (URLs or {url, name, labels, models, "
    "kv_events}); reloaded when it changes.",
    "scheduler_config": "EndpointPickerConfig YAML (plugins + schedulingProfiles), as llm-d's.",
    "preset": "Scheduler preset when no --scheduler-config: round-robin, random, load, "
    "approx-prefix, precise-prefix, kvmesh.",
    "tokenizer": "Tokenizer of the served model: a local HF directory or GGUF file (default: "
    "the embedded SmolLM2's).",
    "served_model_name": "The model name clients send (the engines' --served-model-name): "
    "every engine's GET /v1/models must list it. Default: not checked.",
    "engine_model_check": "At start ask each engine's GET /v1/models and POST /tokenize; refuse "
    "to start (exit 2) when one does not serve --served-model-name (or a model the endpoints "
    "file lists for it) or splits probe texts into other token ids than --tokenizer (another "
    "model: no prefix would match). An engine that joins or restarts so is kept out of "
    "rotation. --no-engine-model-check routes to them anyway.",
    "block_size": "The engines' KV block size (prefix keys are computed exactly as theirs). "
    "Default: learned from each engine's /metrics (vllm:cache_config_info) at start, 16 "
    "until one reports it. Given, the router refuses to start (exit 2) when an engine reports "
    "another; engines that join or restart with another size are kept out of rotation "
    "(kvmesh_router_endpoint_block_size_mismatch).",
    "prefix_caching_hash_algo": "The engines' --prefix-caching-hash-algo (set the same "
    "PYTHONHASHSEED as theirs).",
    "kv_events": "KV event source per endpoint: 'auto' asks each engine's /kv_event_sources; "
    "'none' turns precise indexing off.",
    "scrape_interval": "Seconds between /metrics scrapes of each endpoint.",
    "max_retries": "Other endpoints tried when one fails before the first byte.",
    "max_body_bytes": "Largest request body accepted.",
    "trust_request_chat_template": "Render chat templates that requests bring (`chat_template`, "
    "`chat_template_kwargs.chat_template`) to compute their prefix keys, as vLLM's flag; each "
    "in a sandbox, on a thread, within 2 s. Off: such requests get 400.",
    "index_capacity": "Most (block, endpoint) entries in the precise index.",
    "approx_capacity_per_endpoint": "Blocks remembered per endpoint by the approximate index.",
    "first_byte_timeout": "Seconds to wait for the first byte of a streaming answer (the "
    "engine sends it with the first token, after any queueing and the prefill) before the "
    "request goes to another endpoint; counts towards the endpoint's ejection.",
    "non_streaming_first_byte_timeout": "The same for a non-streaming answer, whose head comes "
    "only with the whole completion (a CPU engine may take minutes).",
    "stream_idle_timeout": "Seconds with no byte in the middle of an answer before it is cut, "
    "ended with an SSE error event, and counted towards the endpoint's ejection; 0: never.",
    "outlier_consecutive_errors": "Outlier detection, as Envoy's consecutive_5xx: requests "
    "failed in a row (5xx answer, or a timeout before the first byte or mid-stream) that "
    "eject an endpoint for a while (an unreachable one is out until it answers /metrics "
    "again, re-checked at least every 2 s); 0: never.",
    "outlier_base_ejection_time": "Seconds an ejected endpoint stays out, times the number of "
    "its ejections (one forgiven per such span in service).",
    "outlier_max_ejection_time": "Longest ejection, in seconds.",
    "outlier_max_ejection_percent": "Most of the fleet ejected at once, in percent (always "
    "at least one endpoint); with every endpoint out, requests try them all.",
    "prefill_max_retries": "P/D: prefill attempts beyond the first before the decode endpoint "
    "prefills itself.",
    "kv_index_warmup_timeout": "Seconds after start during which inference requests wait for "
    "the engines' KV-event replay to fill the precise index (a restarted router then routes by "
    "the cache at once); a request never waits longer than this, 0: never.",
    "kv_peer_min_cached_token_delta": "Peer sharing: when another healthy endpoint caches at "
    "least this many more leading prompt tokens than the chosen one (precise index, any tier), "
    "name it in x-kv-cache-source-host-port so the chosen engine pulls those blocks instead of "
    "computing them (engines need it in --kv-peer-allowlist); not on the P/D path. 0: off.",
    "api_key": "Key clients must send as `Authorization: Bearer <key>` on /v1/* (default: env "
    "VLLM_API_KEY; unset: none). /health and /metrics stay open.",
    "endpoint_api_key": "Key sent to the engines (their --api-key) in place of the client's "
    "Authorization (default: --api-key; with neither, the client's header passes through).",
}


def router_config_from(args: argparse.Namespace, endpoints: list[str]):
    from kvmesh.router.app import RouterConfig

    args.endpoints = endpoints
    from kvmesh.protocol.auth import API_KEY_ENV, env_key

    args.api_key = env_key(getattr(args, "api_key", None), API_KEY_ENV)
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

    from kvmesh.router.block_size import BlockSizeMismatch
    from kvmesh.router.engine_model import EngineModelMismatch

    refused: list[str] = []

    async def main() -> None:
        try:
            router, runner = await start_router_from(config, args.host, args.port)
        except (BlockSizeMismatch, EngineModelMismatch) as exc:
            refused.append(str(exc))
            return
        # what the router serves now: the endpoints file read, servers split into their
        # data-parallel ranks; the port bound (--port 0: the one the system chose)
        port = runner.server.sockets[0].getsockname()[1] if runner.server.sockets else args.port
        endpoints = router.pool.endpoints.values()
        healthy = sum(1 for e in endpoints if e.healthy)
        print(
            f"kvmesh router ready: http://{args.host}:{port}/v1 ({len(endpoints)} endpoints, "
            f"{healthy} healthy, preset {config.preset})",
            flush=True,
        )
        try:
            await wait_for_shutdown()
        finally:
            await runner.cleanup()

    from kvmesh.engine.server import run

    run(main())
    if refused:
        print(f"kvmesh router: {refused[0]}", file=sys.stderr)
        return 2
    return 0
