"""The engine's HTTP server: vLLM's OpenAI surface, /metrics, tokenizer routes, health."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

from aiohttp import web

from kvmesh.engine import openai_routes, shm_transfer
from kvmesh.engine.auth import EngineKeys, auth_middleware, expect_gate
from kvmesh.engine.builder import EngineBundle
from kvmesh.engine.http_guard import GuardedRunner, RequestReadTimeout
from kvmesh.engine.peer import BLOCKS_ROUTE, PeerPuller, parse_allowlist
from kvmesh.protocol.openai import (
    TOO_DEEP,
    APIError,
    DetokenizeRequest,
    TokenizeRequest,
    decode_request,
    encode_json,
    error_body,
)
from kvmesh.protocol.zmq_events import offset_endpoint

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 32 * 2**20
BUNDLE = web.AppKey("bundle", EngineBundle)
SEGMENTS = web.AppKey("shm_segments", shm_transfer.SegmentWriter)
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


def _json(obj, status: int = 200, headers=None) -> web.Response:
    return web.Response(
        body=encode_json(obj), status=status, content_type="application/json", headers=headers
    )


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every failure reaches the client as an OpenAI error body; tracebacks stay in the log."""
    try:
        return await handler(request)
    except APIError as exc:
        resp = _json(exc.body(), exc.status, exc.headers)
        if isinstance(exc, RequestReadTimeout):  # the rest of the body will not be read
            resp.force_close()
        return resp
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = (
            exc.reason
            if exc.status != 413
            else (f"Request body too large (limit {MAX_BODY_BYTES} bytes).")
        )
        return _json(error_body(message, exc.status), exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except RecursionError:  # JSON decoded before decode_request's limits (a peer's lookup)
        return _json(error_body(TOO_DEEP, 400), 400)
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return _json(error_body("Internal server error.", 500), 500)


async def health(request: web.Request) -> web.Response:
    failed = request.app[BUNDLE].engine.failed
    if failed is not None:  # e.g. a data-parallel peer is gone: this engine cannot step
        return _json(error_body(f"Engine stopped: {failed}", 503), 503)
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    b: EngineBundle = request.app[BUNDLE]
    card = {
        "id": b.model_name,
        "object": "model",
        "created": b.created,
        "owned_by": "kvmesh",
        "root": b.model_path,
        "parent": None,
        "max_model_len": b.max_model_len,
        "permission": [],
    }
    return _json({"object": "list", "data": [card]})


async def tokenize(request: web.Request) -> web.Response:
    b: EngineBundle = request.app[BUNDLE]
    body = await request.read()
    req: TokenizeRequest = decode_request(body, TokenizeRequest)
    b.serving.check_model(req.model)
    if req.messages is not None:  # the chat's prompt as chat completions make it
        ids = await b.serving.chat_ids(await b.serving.parse_chat(body), None, check=False)
    elif req.prompt is not None:
        ids = await b.serving.tokenize(req.prompt, req.add_special_tokens, None, "prompt", False)
    else:
        raise APIError("Either prompt or messages is required.", param="prompt")
    body = {
        "count": len(ids),
        "max_model_len": b.max_model_len,
        "tokens": ids,
        "token_strs": b.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
    }
    return _json(body)


async def detokenize(request: web.Request) -> web.Response:
    b: EngineBundle = request.app[BUNDLE]
    req: DetokenizeRequest = decode_request(await request.read(), DetokenizeRequest)
    b.serving.check_model(req.model)
    vocab = len(b.tokenizer)
    if any(t < 0 or t >= vocab for t in req.tokens):
        raise APIError(f"Token ids must be in [0, {vocab}).", param="tokens")
    return _json({"prompt": b.tokenizer.decode(req.tokens)})


async def metrics(request: web.Request) -> web.Response:
    b: EngineBundle = request.app[BUNDLE]
    return web.Response(
        body=b.metrics.render(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def load(request: web.Request) -> web.Response:
    return _json({"server_load": request.app[BUNDLE].engine.num_unfinished})


async def version(request: web.Request) -> web.Response:
    return _json({"version": "0.1.0"})


async def kv_event_sources(request: web.Request) -> web.Response:
    """{rank: its publisher's settings}, with the endpoints this rank binds (port + rank)."""
    b: EngineBundle = request.app[BUNDLE]
    rank, source = b.config.data_parallel_rank, b.kv_events_dict
    if source and rank:
        source = dict(source)
        for name in ("endpoint", "replay_endpoint"):
            if source.get(name):
                source[name] = offset_endpoint(source[name], rank)
    return _json({str(rank): source})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    b: EngineBundle = request.app[BUNDLE]
    ok = await b.engine.call(lambda core: core.reset_prefix_cache())
    if not ok:
        raise APIError("Prefix cache is in use by running requests; try again when idle.", 503)
    return web.Response(status=200)


async def kv_transfer(request: web.Request) -> web.Response:
    """The transfer route: a decode engine reads a finished prefill's blocks once, by the
    transfer id the prefill minted (remote_request_id), never by a request id."""
    b: EngineBundle = request.app[BUNDLE]
    tid = request.match_info["transfer_id"]
    payload = await b.engine.call(lambda core: core.export_held(tid))
    if payload is None:
        raise APIError(f"No KV blocks are held for transfer {tid!r}.", 404)
    return web.Response(body=payload, content_type="application/octet-stream")


async def kv_transfer_blocks(request: web.Request) -> web.Response:
    """The peer route: another engine asks for cached blocks by hash, from a first index; with
    "transport": "shm" from this host, they come in a shared-memory segment (shm_transfer)."""
    b: EngineBundle = request.app[BUNDLE]
    try:
        body = await request.json()
        hashes = [bytes.fromhex(h) for h in body["block_hashes"]]
        first = int(body.get("first_block", 0))
    except (ValueError, KeyError, TypeError):
        raise APIError("Expected {block_hashes: [hex], first_block: int}.") from None
    if not 0 <= first < len(hashes):
        raise APIError("first_block must index block_hashes.")
    parts = await b.engine.call(lambda core: core.export_prefix(hashes, first))
    if parts is None:
        raise APIError("None of these blocks is cached here.", 404)
    local = request.transport.get_extra_info("sockname") if request.transport else None
    if body.get("transport") == "shm" and shm_transfer.same_host(request.remote, local):
        # the puller shares this host: the payload goes in a segment, the answer names it
        segment = await request.app[SEGMENTS].answer(parts)
        if segment is not None:
            return _json(segment)
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.content_length = sum(len(p) for p in parts)
    await resp.prepare(request)
    for part in parts:  # the KV part is written from the runner's buffer, not copied first
        await resp.write(part)
    await resp.write_eof()
    return resp


def peer_middleware(puller: PeerPuller):
    """Before a completion runs, pull the blocks it lacks from the peer it names (if any)."""

    @web.middleware
    async def pull_first(request: web.Request, handler):
        if request.method == "POST" and request.path in GENERATE_PATHS:
            await puller.before_request(request.headers, request.path, await request.read())
        return await handler(request)

    return pull_first


def build_app(bundle: EngineBundle) -> web.Application:
    config = bundle.config
    keys = EngineKeys.of(config)
    # the credential is checked before anything else works for the request (engine.auth)
    middlewares = [error_middleware, auth_middleware(keys)]
    puller = PeerPuller(
        bundle,
        parse_allowlist(config.kv_peer_allowlist),
        transport=config.kv_peer_transport,
        key=keys.kv_transfer,
    )
    middlewares.append(peer_middleware(puller))
    if bundle.faults is not None:
        middlewares.append(bundle.faults.middleware())
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[BUNDLE] = bundle
    app[SEGMENTS] = shm_transfer.SegmentWriter()
    app[openai_routes.SERVING] = bundle.serving
    bundle.serving.trust_request_chat_template = config.trust_request_chat_template
    app[openai_routes.FAULTS] = bundle.faults
    if bundle.faults is not None and keys.admin is not None:  # no admin key: no admin routes
        app.router.add_routes(bundle.faults.routes())
    app.router.add_get("/health", health)
    app.router.add_route("*", "/ping", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/v1/completions", openai_routes.completions)
    app.router.add_post("/v1/chat/completions", openai_routes.chat_completions)
    app.router.add_get("/kv_transfer/{transfer_id}", kv_transfer)
    app.router.add_post(BLOCKS_ROUTE, kv_transfer_blocks)
    dev_mode = "1" in (os.environ.get("VLLM_SERVER_DEV_MODE"), os.environ.get("KVMESH_DEV_MODE"))
    if dev_mode and keys.admin is not None:
        app.router.add_post("/reset_prefix_cache", reset_prefix_cache)

    async def on_startup(app: web.Application) -> None:
        bundle.engine.start()

    async def on_cleanup(app: web.Application) -> None:
        app[SEGMENTS].close()
        bundle.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def start_server(bundle: EngineBundle, host: str, port: int) -> web.AppRunner:
    """Start serving in the running loop, by the front-door rules of engine.http_guard."""
    runner = GuardedRunner(build_app(bundle), gate=expect_gate(EngineKeys.of(bundle.config)))
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    port = runner.addresses[0][1]
    bundle.engine.core.advertise = (host, port)  # where decode engines read held blocks
    logger.info("serving %s on http://%s:%d", bundle.model_name, host, port)
    return runner


async def wait_for_shutdown() -> None:
    """Until SIGINT or SIGTERM (as Kubernetes sends); the caller then cleans up gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def run(coro) -> None:
    """Run a server's main coroutine on uvloop (when installed) until it returns."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    else:
        runner = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(coro)


def serve(bundle: EngineBundle, host: str = "127.0.0.1", port: int = 8000) -> None:

    async def main() -> None:
        runner = await start_server(bundle, host, port)
        bound = runner.addresses[0][1]  # --port 0: the port it got
        print(
            f"kvmesh engine ready: http://{host}:{bound}/v1  (model {bundle.model_name})",
            flush=True,
        )
        try:
            await wait_for_shutdown()
        finally:
            await runner.cleanup()

    bundle.created = int(time.time())
    run(main())
