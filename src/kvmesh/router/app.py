"""The router: parse, tokenize, schedule, then stream the chosen endpoint's answer back byte for
byte (no re-encoding), retrying elsewhere before the first byte. The wire is router.proxy."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from kvmesh.router.endpoints import Endpoint, EndpointPool
from kvmesh.router.events import EventIngest
from kvmesh.router.frontdoor import FrontDoor, Request, RouterServer, serve
from kvmesh.router.index import ApproximateIndex, PreciseIndex
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.pd import prefill_remotely
from kvmesh.router.peer_source import PEER_HEADER, PeerSource, PeerSourceConfig, select_source
from kvmesh.router.pipeline import Pipeline, SchedulingResult
from kvmesh.router.plugins import SchedulingRequest, needs_tokens, reads_precise_index
from kvmesh.router.proxy import Exchange, Link, Upstream, UpstreamError

logger = logging.getLogger(__name__)
decisions = logging.getLogger("kvmesh.router.decisions")
_ids = random.Random()  # request ids: seeded from the OS once, no system call per request
OFF_LOOP_BYTES = 64 * 1024  # bodies this large are tokenized on a thread, off the event loop
INFERENCE_PATHS = frozenset(("/v1/completions", "/v1/chat/completions"))
_BROKE = b'data: {"error": {"message": "upstream stream broke", "type": "InternalServerError", "code": 502}}\n\n'  # noqa: E501


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
    # a server whose /metrics shows several engine="<rank>" series: one endpoint per rank
    discover_data_parallel: bool = True
    # peer sharing: name another endpoint as the chosen one's KV source when it holds at least
    # this many more leading prompt tokens (precise index); 0: off
    kv_peer_min_cached_token_delta: int = 0

    def __post_init__(self) -> None:
        if self.kv_peer_min_cached_token_delta < 0:
            raise ValueError("--kv-peer-min-cached-token-delta must be 0 (off) or positive")


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
        # a profile of load scorers alone never reads token ids: do not tokenize for it
        self.tokenize = needs_tokens(self.pipeline)
        endpoints = [Endpoint(u, kv_events=config.kv_events) for u in config.endpoints]
        self.pool = EndpointPool(
            endpoints,
            config.scrape_interval,
            config.endpoints_file,
            on_removed=self._removed,
            discover_data_parallel=config.discover_data_parallel,
        )
        self.peer_sources = (
            PeerSourceConfig(config.kv_peer_min_cached_token_delta, config.block_size)
            if config.kv_peer_min_cached_token_delta
            else None
        )
        self.metrics = RouterMetrics()
        self.session: aiohttp.ClientSession | None = None
        self.events: EventIngest | None = None
        self.links: dict[str, Link] = {}
        self._tokenizer_free = asyncio.Event()  # clear while a thread holds self.tokens
        self._tokenizer_free.set()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-tokenize")

    def link(self, e: Endpoint) -> Link:
        link = self.links.get(e.name)
        if link is None or link.url != e.url:
            link = self.links[e.name] = Link.of(e)
        return link

    def _removed(self, name: str) -> None:
        link = self.links.pop(name, None)
        if link is not None:
            link.pool.close()
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
        # KV events feed the precise index only: skipped when neither the pipeline nor peer
        # source selection reads it
        subscribe = reads_precise_index(self.pipeline) or self.peer_sources is not None
        if self.config.kv_events and subscribe:
            for e in self.pool.endpoints.values():
                e.kv_events = e.kv_events or self.config.kv_events
                self.events.watch(e)

        def added(e: Endpoint) -> None:
            e.kv_events = e.kv_events or self.config.kv_events
            if subscribe:
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
        for link in self.links.values():
            link.pool.close()
        self._thread.shutdown(wait=False)

    # ---- scheduling -----------------------------------------------------------------------
    async def parse(self, request: Request) -> SchedulingRequest:
        """scheduling_request, with a large prompt tokenized on a thread (its regex split and
        the Rust tokenizer release the GIL, so the event loop runs meanwhile). One thread at a
        time holds the tokenizer and its caches: requests that need it wait, requests in flight
        keep streaming."""
        if not self.tokenize:
            return self.scheduling_request(request.body, request.path, request.headers)
        while not self._tokenizer_free.is_set():
            await self._tokenizer_free.wait()
        if len(request.body) < OFF_LOOP_BYTES:
            return self.scheduling_request(request.body, request.path, request.headers)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(
            self._thread, self.scheduling_request, request.body, request.path, request.headers
        )
        self._tokenizer_free.clear()

        def released(f: asyncio.Future) -> None:
            self._tokenizer_free.set()
            if not f.cancelled():
                f.exception()  # retrieved here when the client left meanwhile

        work.add_done_callback(released)
        return await asyncio.shield(work)

    def scheduling_request(
        self, body: bytes, path: str, headers: dict[str, str]
    ) -> SchedulingRequest:
        """Headers with lower-case names, as the front door gives them."""
        fields = _decoder.decode(body)
        ids: list[int] = []
        if path.endswith("/chat/completions"):
            if not fields.messages:
                raise ValueError("messages must be a non-empty list")
            if self.tokenize:
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
                if self.tokenize:
                    ids = self.tokens.encode_completion(p, fields.add_special_tokens)
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                ids = list(p)
            else:
                raise ValueError("prompt must be a string or a list of token ids")
        rid = headers.get("x-request-id") or f"{_ids.getrandbits(128):032x}"
        keys = self.tokens.block_keys(ids, cache_salt=fields.cache_salt) if self.tokenize else []
        return SchedulingRequest(rid, fields.model, ids, keys, headers, self.config.block_size)

    def pick(self, req: SchedulingRequest, exclude: set[str]) -> SchedulingResult | None:
        candidates = self.pool.candidates()
        if exclude:
            candidates = [e for e in candidates if e.name not in exclude]
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
    async def handle(self, door: FrontDoor, request: Request) -> None:
        path, method = request.path, request.method
        if path in INFERENCE_PATHS:
            if method != "POST":
                return door.respond_error(405, f"{method} is not allowed on {path}.")
            return await self.handle_inference(door, request)
        if method != "GET" or path not in ("/v1/models", "/health", "/metrics"):
            return door.respond_error(404, f"No route for {method} {path}.")
        if path == "/health":
            return door.respond(200 if self.pool.candidates() else 503, b"", "text/plain")
        if path == "/metrics":
            return door.respond(200, self.render_metrics(), "text/plain; version=0.0.4")
        for e in self.pool.candidates():
            link = self.link(e)
            head = f"GET /v1/models HTTP/1.1\r\n{link.headers}\r\n".encode("latin-1")
            sent = await self._send(door, e, [head], 5.0)
            if isinstance(sent, tuple) and sent[0].status < 500:
                await self._relay(door, e, *sent)
                return
        door.respond_error(503, "No healthy endpoint.", "Retry-After: 1\r\n")

    async def handle_inference(self, door: FrontDoor, request: Request) -> None:
        t0 = time.perf_counter()
        try:
            req = await self.parse(request)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return door.respond_error(400, f"Invalid request: {exc}")
        except Exception as exc:  # a chat template that rejects the messages, etc.
            return door.respond_error(400, f"Could not tokenize the request: {exc}")
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
            send, source = request.body, None
            if result.prefill is not None:  # P/D: the decode endpoint gets its KV from prefill
                send = await prefill_remotely(self, request.path, send, req, result.prefill)
            elif self.peer_sources is not None:
                candidates = self.pool.candidates()
                source = select_source(
                    self.precise_index, candidates, endpoint, req, self.peer_sources, tried
                )
            if await self._forward(door, request, send, req, endpoint, source):
                return
        door.respond_error(
            503, "No healthy endpoint could serve the request.", "Retry-After: 1\r\n"
        )

    async def _forward(
        self,
        door: FrontDoor,
        request: Request,
        body: bytes,
        req: SchedulingRequest,
        e: Endpoint,
        source: PeerSource | None = None,
    ) -> bool:
        """Stream e's answer back: True once the client has it (whole, or broken mid-stream);
        False when e failed before the first byte (try another). `source`: the peer e pulls
        the prefix it lacks from (named in the header llm-d's P2P flow uses)."""
        link = self.link(e)
        auth = request.headers.get("authorization")
        peer = f"{PEER_HEADER}: {source.address}\r\n" if source else ""
        head = (
            f"POST {request.target} HTTP/1.1\r\n{link.headers}Content-Type: application/json\r\n"
            f"X-Request-Id: {req.request_id}\r\nContent-Length: {len(body)}\r\n{peer}"
            + (f"Authorization: {auth}\r\n\r\n" if auth else "\r\n")
        ).encode("latin-1")
        tokens = len(req.token_ids)
        e.in_flight += 1
        e.in_flight_tokens += tokens
        try:
            sent = await self._send(door, e, [head, body], self.config.first_byte_timeout)
            if isinstance(sent, str):
                self.metrics.count(e.name, sent)
                return False
            ex, conn = sent
            if ex.status >= 500:
                self.metrics.count(e.name, f"http_{ex.status}")
                return False
            self._record_decision(req, e)
            if source is not None:
                self.metrics.peer_sourced.labels(source.endpoint.name).inc()
                self.metrics.peer_lead_tokens.inc(source.lead_tokens)
            await self._relay(door, e, ex, conn)
            return True
        finally:
            e.in_flight -= 1
            e.in_flight_tokens -= tokens

    async def _send(
        self, door: FrontDoor, e: Endpoint, parts: list[bytes], first_byte_timeout: float
    ) -> tuple[Exchange, Upstream] | str:
        """Send parts to e; once its answer's head is in (passed on unless 5xx), the exchange;
        before that, the failure as a metrics outcome. A pooled connection that the endpoint
        had closed meanwhile is retried on a fresh one."""
        link = self.link(e)
        loop = asyncio.get_running_loop()
        for fresh in (False, True):
            conn = None if fresh else link.pool.take()
            reused = conn is not None
            if conn is None:
                try:
                    conn = await link.pool.connect(5.0)
                except (OSError, TimeoutError):
                    e.mark_failure(time.monotonic())
                    return "connect_error"
            ex = Exchange(door, link.tag)
            door.upstream = conn
            conn.send(parts, ex)
            timer = loop.call_later(first_byte_timeout, ex.on_timeout)
            try:
                await ex.head
            except UpstreamError:
                if reused and not conn.got_bytes:
                    continue  # the endpoint had closed this idle connection
                e.mark_failure(time.monotonic())
                return "connect_error"
            except TimeoutError:
                conn.abort()
                e.mark_failure(time.monotonic())
                return "timeout"
            except asyncio.CancelledError:  # the client went away
                if conn.sink is ex:  # still ours: not finished and handed back to the pool
                    conn.abort()
                raise
            finally:
                timer.cancel()
            return ex, conn
        return "connect_error"

    async def _relay(self, door: FrontDoor, e: Endpoint, ex: Exchange, conn: Upstream) -> None:
        """Wait while the rest of e's answer streams to the client."""
        try:
            await ex.done
        except UpstreamError as exc:  # the client has bytes already: end its answer
            self.metrics.count(e.name, "stream_error")
            logger.warning("stream from %s broke: %s", e.name, exc)
            if ex.chunks is not None and ex.chunks.at_boundary and not door.closed:
                door.transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(_BROKE), _BROKE))
            else:
                door.must_close = True
            return
        except asyncio.CancelledError:
            if conn.sink is ex:
                conn.abort()
            raise
        self.metrics.count(e.name, "ok" if ex.status < 400 else f"http_{ex.status}")

    def _record_decision(self, req: SchedulingRequest, e: Endpoint) -> None:
        if req.block_keys:
            self.approximate_index.record(e.name, req.block_keys)
        hit = max((req.precise or {}).get(e.name, 0.0), (req.approximate or {}).get(e.name, 0))
        if hit:
            self.metrics.predicted_cached.inc(hit * req.block_size)
        self.metrics.prompt_tokens.inc(len(req.token_ids))

    def render_metrics(self) -> bytes:
        m = self.metrics
        m.index_entries.labels("precise").set(self.precise_index.num_entries())
        m.index_entries.labels("approximate").set(self.approximate_index.num_entries())
        if self.events is not None:
            m.event_lag.set(self.events.lag_seconds)
        for e in self.pool.endpoints.values():
            m.healthy.labels(e.name).set(1 if e.healthy else 0)
            m.in_flight.labels(e.name).set(e.in_flight)
        return m.render()


async def start_router(router: Router, host: str, port: int) -> RouterServer:
    await router.start()
    return await serve(router, host, port, router.config.max_body_bytes)
