"""The floor of the router's HTTP path: the typed interfaces that its routes (router.handlers),
its forwards (router.forward) and its front door (router.frontdoor) are written against, so
that none of them imports the module that implements another.

    app          the Router: implements RouterState, wires the front door to the routes
    listener     the listening socket: a FrontDoor per connection
    frontdoor    HTTP/1.1 server connections: implements Door, calls a Handler
    handlers     the routes: parse, pick, forward, retry (on RouterState and Door)
    forward      one request to one endpoint over one connection (on RouterState)
    state        this module: RouterState, Door, Serving
    request_parser, upstream_pool, proxy, request_reader, chunked: the router's parts and
                 the HTTP/1.1 wire, which know nothing above them

Each module imports only from the floors below it (tests/test_layers.py holds the order).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from kvmesh.router.proxy import Client

if TYPE_CHECKING:
    import aiohttp

    from kvmesh.router.approx_index import ApproximateIndex
    from kvmesh.router.config import RouterConfig
    from kvmesh.router.endpoints import Endpoint, EndpointPool
    from kvmesh.router.events import EventIngest
    from kvmesh.router.index import PreciseIndex
    from kvmesh.router.metrics import RouterMetrics
    from kvmesh.router.peer_source import PeerSourceConfig
    from kvmesh.router.pipeline import SchedulingResult
    from kvmesh.router.plugins import SchedulingRequest
    from kvmesh.router.request_parser import RequestParser
    from kvmesh.router.request_reader import Request
    from kvmesh.router.upstream_pool import Link


class RouterState(Protocol):
    """What the routes and forwards read of the router (router.app.Router is the one)."""

    config: RouterConfig
    pool: EndpointPool
    metrics: RouterMetrics
    parser: RequestParser
    precise_index: PreciseIndex
    approximate_index: ApproximateIndex
    peer_sources: PeerSourceConfig | None  # None: endpoints pull no prefix from peers
    session: aiohttp.ClientSession | None  # set once started (P/D's prefill leg uses it)
    warm_until: float  # monotonic: requests wait for the index until then (0: never)
    events: EventIngest | None  # the KV event subscriptions, once started

    def link(self, e: Endpoint) -> Link:
        """How the router reaches e: its connection pool, header lines and watchdog."""
        ...

    def key_refused(self, path: str, headers: dict[str, str]) -> bool:
        """Whether a request lacks the API key its path needs."""
        ...

    def pick(self, req: SchedulingRequest, exclude: set[str]) -> SchedulingResult | None:
        """The scheduling decision over the endpoints in rotation but ``exclude``."""
        ...

    def settle_soon(self) -> None:
        """Deferred bookkeeping applied once the loop has run what is ready."""
        ...

    async def wait_index_warm(self) -> None:
        """Until the engines' KV-event replay is in the precise index, or the warm-up ends."""
        ...

    def render_metrics(self) -> bytes:
        """The router's /metrics page."""
        ...


class Serving(Protocol):
    """What serves a front door's request in progress: a task, or a forward on callbacks."""

    def cancel(self) -> Any: ...


class Door(Client, Protocol):
    """A client connection as a route answers on it (router.frontdoor.FrontDoor is the one):
    at once, or by taking the request over (``task``, then finish()), or in a task (go_on)."""

    task: Serving | None

    def respond(
        self, status: int, body: bytes, content_type: str = "application/json", extra: str = ""
    ) -> None: ...

    def respond_error(self, status: int, message: str, extra: str = "") -> None: ...

    def finish(self) -> None: ...

    def go_on(self, work: Coroutine[Any, Any, None], req: Request | None = None) -> None: ...
