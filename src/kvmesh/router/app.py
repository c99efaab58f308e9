"""The router: its state (endpoints, indexes, pipeline, tokenizer, metrics) and its lifecycle,
and the scheduling decision. Its configuration is router.config (RouterConfig, importable from
here too), its HTTP routes router.handlers, the request body's parsing router.request_parser,
the wire router.proxy."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from kvmesh.protocol.auth import CHALLENGE_LINE, UNAUTHORIZED, bearer_matches
from kvmesh.router import handlers
from kvmesh.router.approx_index import ApproximateIndex
from kvmesh.router.block_size import EngineBlockSize
from kvmesh.router.config import RouterConfig
from kvmesh.router.endpoints import Endpoint, EndpointPool
from kvmesh.router.engine_model import EngineModelCheck
from kvmesh.router.events import EventIngest
from kvmesh.router.frontdoor import FrontDoor, Request
from kvmesh.router.index import PreciseIndex
from kvmesh.router.k8s_discovery import K8sDiscovery
from kvmesh.router.listener import RouterServer, serve
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.peer_source import PeerSourceConfig
from kvmesh.router.pipeline import Pipeline, SchedulingResult
from kvmesh.router.plugins import SchedulingRequest
from kvmesh.router.request_parser import RequestParser
from kvmesh.router.upstream_pool import Link

decisions = logging.getLogger("kvmesh.router.decisions")
SHUTTING_DOWN = "The router is shutting down; retry the request."


class Router:
    """The router's state (router.state.RouterState, as its routes and forwards read it), its
    lifecycle, and the handler its front doors call."""

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
        self.metrics = RouterMetrics()
        # the one home of the block size: whatever keys or sizes blocks reads or follows it
        self.block_size = EngineBlockSize(config.block_size, self.metrics)
        size = self.block_size.value
        self.tokens = PromptTokenizer(tokenizer, size, config.prefix_caching_hash_algo)
        # a profile of load scorers alone never reads token ids: do not tokenize for it
        self.parser = RequestParser(self.tokens, self.pipeline.reads_tokens, size)
        self.parser.trust_request_chat_template = config.trust_request_chat_template
        endpoints = [Endpoint(u, kv_events=config.kv_events) for u in config.endpoints]
        self.pool = EndpointPool(
            endpoints,
            config.scrape_interval,
            config.endpoints_file,
            on_removed=self._removed,
            discover_data_parallel=config.discover_data_parallel,
            outlier=config.outlier_detection(),
        )
        self.discovery = (
            K8sDiscovery(
                self.pool,
                inference_pool=config.k8s_inference_pool,
                selector=config.k8s_selector,
                target_port=config.k8s_target_port,
                namespace=config.k8s_namespace,
                kubeconfig=config.kubeconfig,
                kv_events=config.kv_events,
            )
            if config.k8s_inference_pool or config.k8s_selector
            else None
        )
        self.peer_sources = (
            PeerSourceConfig(config.kv_peer_min_cached_token_delta, size)
            if config.kv_peer_min_cached_token_delta
            else None
        )
        self.block_size.on_change.append(self._block_size_changed)
        self.pool.metrics = self.metrics
        self.model_check = EngineModelCheck(config, tokenizer, self.pool)
        self.parser.context_limit = self.model_check.largest_context
        self.parser.max_choices_per_request = config.max_choices_per_request
        self.session: aiohttp.ClientSession | None = None
        self.events: EventIngest | None = None
        self.warm_until = 0.0  # monotonic: requests wait for the index until then (0: never)
        self.links: dict[str, Link] = {}
        self._settling = False  # a settle() is due on the loop
        # shutting down: requests in progress finish, new ones are answered 503 (/metrics
        # still answers, so a liveness probe does not restart a router that drains)
        self.draining = False

    def settle_soon(self) -> None:
        """Once the loop has run what is ready: apply the bookkeeping that the requests just
        sent deferred (tokenizer cache entries, index records and touches), so their bytes
        went out first. Every reader applies it before reading anyway."""
        if not self._settling:
            self._settling = True
            asyncio.get_running_loop().call_soon(self.settle)

    def settle(self) -> None:
        self._settling = False
        self.parser.settle()
        self.approximate_index.settle()
        self.precise_index.settle()

    def link(self, e: Endpoint) -> Link:
        link = self.links.get(e.name)
        if link is None or link.url != e.url:
            link = self.links[e.name] = Link.of(e)
        return link

    def _block_size_changed(self, size: int) -> None:
        """Prompts are keyed in blocks of the new size from the next request on; what the
        approximate index learnt was keyed in the old one, so it is dropped."""
        self.parser.set_block_size(size)
        if self.peer_sources is not None:
            self.peer_sources.block_size = size
        for name in list(self.pool.endpoints):
            self.approximate_index.remove_endpoint(name)

    def _removed(self, name: str) -> None:
        link = self.links.pop(name, None)
        if link is not None:
            link.pool.close()
        self.block_size.forget(name)
        self.approximate_index.remove_endpoint(name)
        if self.events is not None:
            self.events.forget(name)
        else:
            self.precise_index.remove_endpoint(name)

    def _lost(self, name: str) -> None:
        self.approximate_index.remove_endpoint(name)
        self.precise_index.remove_endpoint(name)
        if self.events is not None:  # once back, its whole replay buffer is read again
            self.events.resync(name)

    async def start(self) -> None:
        """Reads every endpoint's /metrics once first (a few seconds at most): raises
        BlockSizeMismatch, with nothing left running, when their block sizes refuse a start,
        and EngineModelMismatch when one that answered serves another model or tokenizer."""
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False)
        self.events = EventIngest(
            self.precise_index, self.session, self.metrics, block_size=self.block_size
        )
        # KV events feed the precise index only: skipped when neither the pipeline nor peer
        # source selection reads it
        subscribe = self.pipeline.reads_precise_index or self.peer_sources is not None

        def added(e: Endpoint) -> None:
            e.kv_events = e.kv_events or self.config.kv_events
            if subscribe:
                self.events.watch(e)

        self.pool.on_added = added
        self.pool.on_lost = self._lost
        try:
            if self.discovery is not None:  # its pods join the first scrape, as a file's would
                await self.discovery.start()
            await self.pool.scrape_once()
            self.block_size.start(self.pool.endpoints.values())
            await self.model_check.start(self.session)
        except BaseException:
            if self.discovery is not None:
                await self.discovery.stop()
            await self.events.stop()
            await self.session.close()
            raise
        self.pool.check_block_size = self.block_size.check
        self.pool.check_model = self.model_check.later
        if self.config.kv_events and subscribe:
            self.warm_until = time.monotonic() + self.config.kv_index_warmup_timeout
            for e in self.pool.endpoints.values():
                e.kv_events = e.kv_events or self.config.kv_events
                self.events.watch(e)
        await self.pool.start()

    async def wait_index_warm(self) -> None:
        """Until every endpoint's replay is in the precise index or the warm-up time is over."""
        while self.events is not None and not self.events.all_warm():
            left = self.warm_until - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(0.02, left))
        self.warm_until = 0.0  # once warm (or out of time), requests never wait again

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.pool.stop()
        await self.model_check.stop()
        if self.events is not None:
            await self.events.stop()
        if self.session is not None:
            await self.session.close()
        for link in self.links.values():
            link.pool.close()
        self.parser.close()

    def handle(self, door: FrontDoor, request: Request) -> handlers.Work | None:
        if self.draining and request.path != "/metrics":
            door.must_close = True  # the client reconnects, to a router that serves
            return door.respond_error(503, SHUTTING_DOWN, "Retry-After: 1\r\n")
        return handlers.handle(self, door, request)  # the front door's Handler

    def key_refused(self, path: str, headers: dict[str, str]) -> bool:
        """Whether a request lacks the key its path needs (as vLLM: /v1/* only, when set)."""
        key = self.config.api_key
        return (
            bool(key)
            and path.startswith("/v1")
            and not bearer_matches(headers.get("authorization"), key)
        )

    def continue_gate(self, path: str, headers: dict[str, str]) -> tuple[int, str, str] | None:
        """The front door's Gate: no `100 Continue` for a request without its key."""
        return (401, UNAUTHORIZED, CHALLENGE_LINE) if self.key_refused(path, headers) else None

    def scheduling_request(
        self, body: bytes, path: str, headers: dict[str, str]
    ) -> SchedulingRequest:
        return self.parser.scheduling_request(body, path, headers)

    def pick(
        self, req: SchedulingRequest, exclude: set[str], everywhere: bool = True
    ) -> SchedulingResult | None:
        # everywhere: with no endpoint in rotation (missed scrapes of busy engines, say) try
        # them all; a dead one fails before the first byte and the request moves on (the HTTP
        # path retries). Never one of another block size or model: its prefix keys would be
        # wrong, however healthy it is. Without everywhere (the endpoint picker, which cannot
        # retry) no endpoint in rotation is None: the gateway answers 503
        candidates = self.pool.candidates()
        if not candidates and everywhere:
            candidates = [
                e
                for e in self.pool.endpoints.values()
                if not (e.block_size_mismatch or e.model_mismatch)
            ]
        if exclude:
            candidates = [e for e in candidates if e.name not in exclude]
        if not candidates:
            return None
        explain = self.pipeline.explain = decisions.isEnabledFor(logging.DEBUG)
        result = self.pipeline.schedule(req, candidates)
        if explain:
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

    def render_metrics(self) -> bytes:
        m = self.metrics
        m.index_entries.labels("precise").set(self.precise_index.num_entries())
        m.index_entries.labels("approximate").set(self.approximate_index.num_entries())
        if self.events is not None:
            m.event_lag.set(self.events.lag_seconds)
        now = time.monotonic()
        for e in self.pool.endpoints.values():
            m.healthy.labels(e.name).set(1 if e.healthy else 0)
            m.ejected.labels(e.name).set(1 if e.ejected_until > now else 0)
            m.in_flight.labels(e.name).set(e.in_flight)
        return m.render()


async def start_router(router: Router, host: str, port: int) -> RouterServer:
    """The router started and listening; on a failure to listen (a port taken), stopped."""
    await router.start()
    try:
        return await serve(router, host, port, router.config.max_body_bytes)
    except BaseException:
        await router.stop()
        raise
