"""The router's HTTP front door: parse, tokenize, schedule, then stream the chosen endpoint's
answer back byte for byte (no re-encoding), retrying elsewhere before the first byte."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from kvmesh.protocol.openai import error_body
from kvmesh.router.endpoints import Endpoint, EndpointPool
from kvmesh.router.events import EventIngest
from kvmesh.router.index import ApproximateIndex, PreciseIndex
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.pd import prefill_remotely
from kvmesh.router.pipeline import Pipeline, SchedulingResult
from kvmesh.router.plugins import SchedulingRequest

logger = logging.getLogger(__name__)
decisions = logging.getLogger("kvmesh.router.decisions")
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


@dataclass(slots=True)
class RouterConfig:
    endpoints: list[str] = field(default_factory=list)
    endpoints_file: str | None = None
    scheduler_config: str | None = None  # EndpointPickerConfig YAML file
    preset: str = "kvmesh"
    tokenizer: str | None = None  # None: the embedded default model's tokenizer
    block_size: int = 16
    prefix_caching_hash_algo: str = "sha256"
    kv_events: str | None = "auto"  # "auto": ask each endpoint's /kv_event_sources; None: off
    scrape_interval: float = 0.1
    max_retries: int = 2
    max_body_bytes: int = 32 * 2**20
    index_capacity: int = 2_000_000
    approx_capacity_per_endpoint: int = 31_250
    first_byte_timeout: float = 600.0
    prefill_max_retries: int = 0  # P/D: prefill attempts beyond the first before falling back


class ChatFields(msgspec.Struct):
    model: str | None = None
    prompt: Any = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool = True
    cache_salt: str | None = None


_decoder = msgspec.json.Decoder(ChatFields)


class Router:
    def __init__(self, config: RouterConfig, tokenizer) -> None:
        from kvmesh.router.tokens import PromptTokenizer

        self.config = config
        self.precise_index = PreciseIndex(config.index_capacity)
        self.approximate_index = ApproximateIndex(config.approx_capacity_per_endpoint)
        if config.scheduler_config:
            with open(config.scheduler_config) as f:
                self.pipeline = Pipeline.from_yaml(f.read(), self)
        else:
            self.pipeline = Pipeline.preset(config.preset, self)
        self.tokens = PromptTokenizer(tokenizer, config.block_size, config.prefix_caching_hash_algo)
        endpoints = [Endpoint(u, kv_events=config.kv_events) for u in config.endpoints]
        self.pool = EndpointPool(
            endpoints, config.scrape_interval, config.endpoints_file, on_removed=self._removed
        )
        self.metrics = RouterMetrics()
        self.session: aiohttp.ClientSession | None = None
        self.events: EventIngest | None = None

    def _removed(self, name: str) -> None:
        self.approximate_index.remove_endpoint(name)
        if self.events is not None:
            self.events.forget(name)
        else:
            self.precise_index.remove_endpoint(name)

    def _lost(self, name: str) -> None:
        self.approximate_index.remove_endpoint(name)
        self.precise_index.remove_endpoint(name)

    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False)
        self.events = EventIngest(self.precise_index, self.session)
        if self.config.kv_events:
            for e in self.pool.endpoints.values():
                e.kv_events = e.kv_events or self.config.kv_events
                self.events.watch(e)

        def added(e: Endpoint) -> None:
            e.kv_events = e.kv_events or self.config.kv_events
            self.events.watch(e)

        self.pool.on_added = added
        self.pool.on_lost = self._lost
        await self.pool.start(self.session)

    async def stop(self) -> None:
        await self.pool.stop()
        if self.events is not None:
            await self.events.stop()
        if self.session is not None:
            await self.session.close()

    # ---- scheduling -----------------------------------------------------------------------
    def scheduling_request(self, body: bytes, path: str, headers) -> SchedulingRequest:
        fields = _decoder.decode(body)
        if path.endswith("/chat/completions"):
            if not fields.messages:
                raise ValueError("messages must be a non-empty list")
            ids = self.tokens.encode_chat(
                fields.messages,
                tools=fields.tools,
                add_generation_prompt=fields.add_generation_prompt,
                **(fields.chat_template_kwargs or {}),
            )
        else:
            p = fields.prompt
            if isinstance(p, list) and p and isinstance(p[0], (str, list)):
                p = p[0]  # a batch: route by its first prompt
            if isinstance(p, str):
                ids = self.tokens.encode_completion(p, fields.add_special_tokens)
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                ids = list(p)
            else:
                raise ValueError("prompt must be a string or a list of token ids")
        rid = headers.get("X-Request-Id") or uuid.uuid4().hex
        keys = self.tokens.block_keys(ids, cache_salt=fields.cache_salt)
        hdrs = {k.lower(): v for k, v in headers.items()}
        return SchedulingRequest(rid, fields.model, ids, keys, hdrs, self.config.block_size)

    def pick(self, req: SchedulingRequest, exclude: set[str]) -> SchedulingResult | None:
        candidates = [e for e in self.pool.candidates() if e.name not in exclude]
        if not candidates:
            return None
        result = self.pipeline.schedule(req, candidates)
        if decisions.isEnabledFor(logging.DEBUG):
            for pname, pr in result.profiles.items():
                decisions.debug(
                    "request %s profile %s -> %s totals=%s scores=%s",
                    req.request_id,
                    pname,
                    pr.endpoint and pr.endpoint.name,
                    pr.totals,
                    pr.scores,
                )
        return result if result.primary is not None else None

    # ---- HTTP -----------------------------------------------------------------------------
    async def handle_inference(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        t0 = time.perf_counter()
        try:
            req = self.scheduling_request(body, request.path, request.headers)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return _error(f"Invalid request: {exc}", 400)
        except Exception as exc:  # a chat template that rejects the messages, etc.
            return _error(f"Could not tokenize the request: {exc}", 400)
        tried: set[str] = set()
        for attempt in range(self.config.max_retries + 1):
            result = self.pick(req, tried)
            if attempt == 0:
                self.metrics.scheduling.observe(time.perf_counter() - t0)
            if result is None:
                break
            endpoint = result.primary
            tried.add(endpoint.name)
            if attempt:
                self.metrics.retries.inc()
            send = body
            if result.prefill is not None:
                send = await prefill_remotely(self, request.path, body, req, result.prefill)
            resp = await self._forward(request, send, req, endpoint)
            if resp is not None:
                return resp
        return _error("No healthy endpoint could serve the request.", 503, {"Retry-After": "1"})

    async def _forward(
        self, request: web.Request, body: bytes, req: SchedulingRequest, e: Endpoint
    ) -> web.StreamResponse | None:
        """Stream e's answer back; None when e failed before the first byte (try another)."""
        assert self.session is not None
        headers = {"Content-Type": "application/json", "X-Request-Id": req.request_id}
        e.in_flight += 1
        e.in_flight_tokens += len(req.token_ids)
        resp: web.StreamResponse | None = None
        try:
            try:
                upstream = await self.session.post(
                    e.url + request.path,
                    data=body,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(sock_connect=5, sock_read=None, total=None),
                )
            except (TimeoutError, aiohttp.ClientError, OSError):
                e.mark_failure(time.monotonic())
                self.metrics.requests.labels(e.name, "connect_error").inc()
                return None
            async with upstream:
                if upstream.status >= 500:
                    self.metrics.requests.labels(e.name, f"http_{upstream.status}").inc()
                    return None
                self._record_decision(req, e)
                resp = web.StreamResponse(
                    status=upstream.status,
                    headers={
                        **{
                            k: v
                            for k, v in upstream.headers.items()
                            if k.lower() not in HOP_HEADERS
                        },
                        "x-kvmesh-endpoint": e.name,
                    },
                )
                await resp.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                self.metrics.requests.labels(
                    e.name, "ok" if upstream.status < 400 else f"http_{upstream.status}"
                ).inc()
                return resp
        except (TimeoutError, aiohttp.ClientError, ConnectionResetError) as exc:
            # failed mid-stream: the client already has bytes, so end its stream
            self.metrics.requests.labels(e.name, "stream_error").inc()
            logger.warning("stream from %s broke: %s", e.name, exc)
            if resp is not None:
                with contextlib.suppress(Exception):
                    await resp.write(
                        b'data: {"error": {"message": "upstream stream broke", '
                        b'"type": "InternalServerError", "code": 502}}\n\n'
                    )
                return resp
            return None
        finally:
            e.in_flight -= 1
            e.in_flight_tokens -= len(req.token_ids)

    def _record_decision(self, req: SchedulingRequest, e: Endpoint) -> None:
        self.approximate_index.record(e.name, req.block_keys)
        hit = max((req.precise or {}).get(e.name, 0.0), (req.approximate or {}).get(e.name, 0))
        self.metrics.predicted_cached.inc(hit * req.block_size)
        self.metrics.prompt_tokens.inc(len(req.token_ids))

    async def handle_models(self, request: web.Request) -> web.Response:
        assert self.session is not None
        for e in self.pool.candidates():
            try:
                async with self.session.get(
                    e.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)
                ) as up:
                    return web.Response(
                        body=await up.read(), status=up.status, content_type="application/json"
                    )
            except (TimeoutError, aiohttp.ClientError, OSError):
                continue
        return _error("No healthy endpoint.", 503, {"Retry-After": "1"})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.pool.candidates() else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        m = self.metrics
        m.index_entries.labels("precise").set(self.precise_index.num_entries())
        m.index_entries.labels("approximate").set(self.approximate_index.num_entries())
        if self.events is not None:
            m.event_lag.set(self.events.lag_seconds)
        for e in self.pool.endpoints.values():
            m.healthy.labels(e.name).set(1 if e.healthy else 0)
            m.in_flight.labels(e.name).set(e.in_flight)
        return web.Response(
            body=m.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )


def _error(message: str, status: int, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(error_body(message, status)),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def build_router_app(router: Router) -> web.Application:
    app = web.Application(
        client_max_size=router.config.max_body_bytes, middlewares=[_errors_as_json]
    )
    app.router.add_post("/v1/completions", router.handle_inference)
    app.router.add_post("/v1/chat/completions", router.handle_inference)
    app.router.add_get("/v1/models", router.handle_models)
    app.router.add_get("/health", router.handle_health)
    app.router.add_get("/metrics", router.handle_metrics)

    async def on_startup(app: web.Application) -> None:
        await router.start()

    async def on_cleanup(app: web.Application) -> None:
        await router.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.reason, exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("router error in %s %s", request.method, request.path)
        return _error("Internal router error.", 500)


async def start_router(router: Router, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(build_router_app(router), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
