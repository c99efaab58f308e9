"""`kvmesh router`: the cache-aware router in front of vLLM-compatible engines."""

from __future__ import annotations

import argparse
import asyncio
import errno
import sys

from kvmesh.commands.checks import model_problem
from kvmesh.commands.flags import config_from_args
from kvmesh.protocol.wording import plural


async def wait_for_shutdown() -> None:
    from kvmesh.engine.server import wait_for_shutdown as wait

    await wait()


ROUTER_HELP = {
    "endpoints_file": "YAML/JSON list of endpoints (URLs or {url, name, labels, models, "
    "kv_events}); reloaded when it changes.",
    "k8s_inference_pool": "Discover the endpoints from the Kubernetes API: the ready pods "
    "(Ready condition true, not terminating) of this InferencePool "
    "(inference.networking.k8s.io/v1: its spec.selector.matchLabels and spec.targetPorts), "
    "watched, so pods that come, go or turn unready join or leave the pool. Each pod gives "
    "http://POD_IP:PORT per target port, named after the pod (<pod>-rank-<i> with several "
    "ports, as llm-d; annotation llm-d.ai/active-ports narrows them), with the pod's labels "
    "(llm-d.ai/role: prefill, decode or both) and annotation kvmesh.ai/data-parallel-size "
    "as an endpoints file's. Needs get on inferencepools, list and watch on pods.",
    "k8s_selector": "Discover the endpoints from the ready pods matching this label selector "
    "('key=value,key2=value2'; equality only) on --k8s-target-port, as --k8s-inference-pool.",
    "k8s_target_port": "The engines' port on the pods --k8s-selector finds.",
    "k8s_namespace": "Namespace of the pool or pods (default: the service account's in a pod, "
    "else the kubeconfig context's, else 'default').",
    "kubeconfig": "Kubeconfig file for Kubernetes discovery (default: the pod's service account "
    "token and CA when KUBERNETES_SERVICE_HOST is set, else $KUBECONFIG or ~/.kube/config).",
    "scheduler_config": "EndpointPickerConfig YAML (plugins + schedulingProfiles), as llm-d's.",
    "preset": "Scheduler preset when no --scheduler-config: round-robin, random, load, "
    "approx-prefix, precise-prefix, kvmesh.",
    "tokenizer": "The served model, as the engines' --model: a local HF directory or GGUF file "
    "whose tokenizer and chat template the router uses (default: the embedded SmolLM2's).",
    "served_model_name": "The model name clients send (the engines' --served-model-name): "
    "every engine's GET /v1/models must list it. Default: not checked.",
    "engine_model_check": "At start ask each engine's GET /v1/models and POST /tokenize; refuse "
    "to start (exit 2) when one does not serve --served-model-name (or a model the endpoints "
    "file lists for it) or splits probe texts into other token ids than --model (another "
    "model: no prefix would match). An engine that joins or restarts so is kept out of "
    "rotation. --no-engine-model-check routes to them anyway.",
    "block_size": "The engines' KV block size (prefix keys are computed exactly as theirs). "
    "Default: learned from each engine's /metrics (vllm:cache_config_info) at start, 16 "
    "until one reports it. Given, the router refuses to start (exit 2) when an engine reports "
    "another; engines that join or restart with another size are kept out of rotation "
    "(kvmesh_router_endpoint_block_size_mismatch).",
    "prefix_caching_hash_algo": "The engines' --prefix-caching-hash-algo (set the same "
    "PYTHONHASHSEED as theirs).",
    "kv_events": "Where the router subscribes to each endpoint's KV events: 'auto' asks each "
    "engine's /kv_event_sources; a ZMQ endpoint such as 'tcp://*:5557' (as the engines' "
    "publisher says it, '*' reached at each endpoint's host; a named address, where engines "
    "connect, is bound by the router: one router per host and address, the others not ready); "
    "'none' turns precise indexing off.",
    "scrape_interval": "Seconds between /metrics scrapes of each endpoint.",
    "max_retries": "Other endpoints tried when one fails before the first byte.",
    "max_body_bytes": "Largest request body accepted.",
    "max_choices_per_request": "Most choices (prompts times n) one request may ask for; more: "
    "400 before its prompt is tokenized or forwarded (as the kvmesh engine's flag).",
    "trust_request_chat_template": "Render chat templates that requests bring (`chat_template`, "
    "`chat_template_kwargs.chat_template`) to compute their prefix keys, as vLLM's flag; each "
    "in a sandbox, on a thread, within 2 s. Off: such requests get 400.",
    "index_capacity": "Most (block, endpoint) entries in the precise index.",
    "approx_capacity_per_endpoint": "Blocks remembered per endpoint by the approximate index.",
    "first_byte_timeout": "Seconds to wait for the first token of a streaming answer (its "
    "first SSE data line, after any queueing and the prefill; a head or SSE comments sent "
    "before it do not count) before the request goes to another endpoint; counts towards "
    "the endpoint's ejection.",
    "non_streaming_first_byte_timeout": "The same for a non-streaming answer, whose body comes "
    "only with the whole completion (a CPU engine may take minutes).",
    "stream_idle_timeout": "Seconds with no byte in a stream after its first token before it "
    "is cut, ended with an SSE error event, and counted towards the endpoint's ejection; "
    "0: never.",
    "outlier_consecutive_errors": "Outlier detection, as Envoy's consecutive_5xx: requests "
    "failed in a row (5xx answer, or a timeout before the first byte or mid-stream) that "
    "eject an endpoint for a while (an unreachable one is out until it answers /metrics "
    "again, re-checked at least every 2 s); 0: never.",
    "outlier_base_ejection_time": "Seconds an ejected endpoint stays out, times the number of "
    "its ejections (one forgiven per such span in service).",
    "outlier_max_ejection_time": "Longest ejection, in seconds.",
    "outlier_max_ejection_percent": "Most of the fleet ejected at once, in percent (always "
    "at least one endpoint); with every endpoint out, requests try them all.",
    "healthy_panic_threshold": "Envoy's healthy_panic_threshold: while fewer endpoints than "
    "this percent of the fleet are in rotation (not ejected, answering their checks), "
    "requests go to every endpoint but those refusing connections, ejected or with checks "
    "timing out, so that timeouts on a loaded host never leave no endpoint "
    "(kvmesh_router_healthy_panic); 0: never.",
    "prefill_max_retries": "P/D: prefill attempts beyond the first before the decode endpoint "
    "prefills itself.",
    "kv_index_warmup_timeout": "Seconds after start during which inference requests wait for "
    "the engines' KV-event replay to fill the precise index (a restarted router then routes by "
    "the cache at once); a request never waits longer than this, 0: never.",
    "kv_peer_min_cached_token_delta": "Peer sharing: when another healthy endpoint caches at "
    "least this many more leading prompt tokens than the chosen one (precise index, any tier), "
    "name it in x-kv-cache-source-host-port so the chosen engine pulls those blocks instead of "
    "computing them (engines need it in --kv-peer-allowlist); not on the P/D path. 0: off.",
    "ext_proc_port": "Also serve Envoy's ext_proc gRPC service on this port, as the Gateway API "
    "Inference Extension's endpoint picker: each request Envoy streams here (request body "
    "BUFFERED, or FULL_DUPLEX_STREAMED with request trailers SEND) is scheduled as on --port "
    "and answered with x-gateway-destination-endpoint: IP:PORT (header and envoy.lb metadata); "
    "see docs/envoy-ext-proc.yaml and docs/envoy-ext-proc-streamed.yaml. 0: any free port.",
    "ext_proc_fail_open": "ext_proc: when no endpoint can be picked, let Envoy route by its own "
    "configuration instead of answering 503.",
    "ext_proc_fallback_endpoints": "ext_proc: name this many more endpoints after the chosen "
    "one, next best first, as the Gateway API Inference Extension's fallbacks "
    "(x-gateway-destination-endpoint: IP:PORT,IP:PORT,...), which the gateway's retries walk "
    "in order. Needs a gateway that reads such a list (Envoy's override_host load balancing "
    "policy: python -m kvmesh.router.envoy_config --endpoint ...); Envoy's ORIGINAL_DST cluster "
    "takes one address only. 0: the chosen endpoint alone.",
    "ext_proc_endpoint_header": "ext_proc: name the endpoint that served in an "
    "x-kvmesh-endpoint header on each answer (its URL: an internal address, so off by "
    "default).",
    "inference_objectives": "ext_proc: a YAML file of InferenceObjective manifests (the "
    "Gateway API Inference Extension's; `kubectl get inferenceobjectives -o yaml`): a request "
    "naming one in x-gateway-inference-objective takes its spec.priority (default 0); one "
    "with a negative priority is answered 429 while the pool is saturated.",
    "saturation_queue_depth_threshold": "ext_proc shedding: an endpoint with this many requests "
    "waiting (or more) has no capacity; with none left the pool is saturated.",
    "saturation_kv_cache_util_threshold": "ext_proc shedding: an endpoint whose KV cache usage "
    "(0-1) reaches this has no capacity.",
    "shutdown_timeout": "On SIGTERM or SIGINT, seconds the answers in progress (and the ext_proc "
    "streams Envoy holds open for them) get to finish, while new requests get 503 and new "
    "ext_proc streams an immediate 503; then the router exits (a second signal: at once). "
    "0: stop at once.",
    "api_key": "Key clients must send as `Authorization: Bearer <key>` on /v1/* (default: env "
    "VLLM_API_KEY; unset: none). /health and /metrics stay open.",
    "endpoint_api_key": "Key sent to the engines (their --api-key) in place of the client's "
    "Authorization (default: --api-key; with neither, the client's header passes through).",
}


# one name per concept across serve, router and up: the engines' (vLLM's) names for the model and
# for KV events; the old spellings still work, with a warning on stderr
ROUTER_RENAMED = {
    "tokenizer": ("--model", ("--tokenizer",)),
    "kv_events": ("--kv-events-config", ("--kv-events",)),
}


def router_config_from(args: argparse.Namespace, endpoints: list[str]):
    from kvmesh.router.config import RouterConfig

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


async def drain(runner, ext_proc, timeout: float) -> None:
    """Graceful shutdown: the HTTP listener and the ext_proc server refuse new work while what
    is in progress finishes, for at most timeout seconds or until a second signal."""
    if timeout <= 0:
        return
    waits = [runner.drain(timeout)]
    if ext_proc is not None:
        waits.append(ext_proc.drain(timeout))
    done = asyncio.ensure_future(asyncio.gather(*waits))
    await asyncio.sleep(0)  # both refuse new work from here on
    print(f"kvmesh router: draining (up to {timeout:g} s)", file=sys.stderr, flush=True)
    again = asyncio.ensure_future(wait_for_shutdown())
    await asyncio.wait([done, again], return_when=asyncio.FIRST_COMPLETED)
    again.cancel()
    if not done.done() or not all(done.result()):
        done.cancel()
        print("kvmesh router: requests still in progress cut", file=sys.stderr, flush=True)


def cmd_router(args: argparse.Namespace) -> int:

    if not (args.endpoint or args.endpoints_file or args.k8s_inference_pool or args.k8s_selector):
        print(
            "kvmesh router: give --endpoint URL (repeatable), --endpoints-file, "
            "--k8s-inference-pool or --k8s-selector",
            file=sys.stderr,
        )
        return 2
    try:
        config = router_config_from(args, args.endpoint or [])
        problem = model_problem(config.tokenizer, weights=False)
        if problem:
            raise ValueError(problem)
    except ValueError as exc:
        print(f"kvmesh router: {exc}", file=sys.stderr)
        return 2
    if config.inference_objectives:
        from kvmesh.router.shedding import load_objectives

        try:
            load_objectives(config.inference_objectives)
        except ValueError as exc:
            print(f"kvmesh router: {exc}", file=sys.stderr)
            return 2
    if config.ext_proc_port is not None:
        try:
            import kvmesh.router.ext_proc  # noqa: F401  # grpcio and xds-protos
        except ImportError as exc:
            need = "--ext-proc-port needs grpcio and xds-protos"
            print(f"kvmesh router: {need} ({exc})", file=sys.stderr)
            return 2

    from kvmesh.router.block_size import BlockSizeMismatch
    from kvmesh.router.engine_model import EngineModelMismatch
    from kvmesh.router.k8s_discovery import K8sDiscoveryError

    refused: list[str] = []

    async def main() -> None:
        try:
            router, runner = await start_router_from(config, args.host, args.port)
        except (BlockSizeMismatch, EngineModelMismatch, K8sDiscoveryError) as exc:
            refused.append(str(exc))
            return
        except OSError as exc:  # its port taken since `kvmesh up` checked it, or never free
            if exc.errno != errno.EADDRINUSE:
                raise
            refused.append(f"cannot listen: {exc}")
            return
        # what the router serves now: the endpoints file read or the pods listed, servers split
        # into their data-parallel ranks; the port bound (--port 0: the one the system chose)
        port = runner.server.sockets[0].getsockname()[1] if runner.server.sockets else args.port
        endpoints = router.pool.endpoints.values()
        healthy = sum(1 for e in endpoints if e.healthy)
        ext_proc, also = None, ""
        if config.ext_proc_port is not None:  # Envoy's endpoint picker, beside the HTTP proxy
            from kvmesh.router.ext_proc_server import serve_ext_proc

            ext_port, fail_open = config.ext_proc_port, config.ext_proc_fail_open
            ext_proc, bound = await serve_ext_proc(router, args.host, ext_port, fail_open)
            also = f", ext_proc grpc://{args.host}:{bound}"
        listed = plural(len(endpoints), "endpoint")
        print(
            f"kvmesh router ready: http://{args.host}:{port}/v1 ({listed}, "
            f"{healthy} healthy, preset {config.preset}){also}",
            flush=True,
        )
        try:
            await wait_for_shutdown()
            await drain(runner, ext_proc, config.shutdown_timeout)
        finally:
            if ext_proc is not None:
                await ext_proc.stop(0)
            await runner.cleanup()

    from kvmesh.engine.server import run

    run(main())
    if refused:
        print(f"kvmesh router: {refused[0]}", file=sys.stderr)
        return 2
    return 0
