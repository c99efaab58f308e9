"""The router's HTTP routes: an inference request is parsed, scheduled and forwarded, retrying
elsewhere before the first byte, and the chosen endpoint's answer streams back byte for byte.

One behaviour, two paths. The common case (a prompt prepared without waiting, no P/D leg, an
idle keep-alive connection to the chosen endpoint) runs in callbacks alone, from the front
door's read to the answer's last byte (router.forward). Whatever must wait (a tokenizer thread,
a connect, a prefill leg, a retry) goes on in a task from where the callbacks stopped."""

from __future__ import annotations

import types
from collections.abc import Coroutine, Generator
from time import perf_counter
from typing import TYPE_CHECKING, Any

import msgspec

from kvmesh.protocol.auth import CHALLENGE_LINE, UNAUTHORIZED
from kvmesh.protocol.openai import APIError
from kvmesh.router import forward_load
from kvmesh.router.forward import ANSWERED, RETRY, STALE, Forward, attempt
from kvmesh.router.pd import prefill_remotely
from kvmesh.router.peer_source import PEER_HEADER, PeerSource, select_source

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint
    from kvmesh.router.pipeline import SchedulingResult
    from kvmesh.router.plugins import SchedulingRequest
    from kvmesh.router.request_reader import Request
    from kvmesh.router.state import Door, RouterState
    from kvmesh.router.upstream_pool import Link

INFERENCE_PATHS = frozenset(("/v1/completions", "/v1/chat/completions"))
_NONE: frozenset[str] = frozenset()
Work = Coroutine[Any, Any, None]


def upstream_auth(router: RouterState, request: Request) -> str:
    """The Authorization header line sent to an endpoint (RouterConfig says which)."""
    auth = router.config.upstream_authorization(request.headers.get("authorization"))
    return f"Authorization: {auth}\r\n" if auth else ""


def handle(router: RouterState, door: Door, request: Request) -> Work | None:
    """Serve request. None: it is answered, or being answered on callbacks (the door's ``task``
    is then the Forward, which calls door.finish()); else the coroutine that serves it."""
    path, method = request.path, request.method
    if router.key_refused(path, request.headers):
        return door.respond_error(401, UNAUTHORIZED, CHALLENGE_LINE)
    if path in INFERENCE_PATHS:
        if method != "POST":
            return door.respond_error(405, f"{method} is not allowed on {path}.")
        return handle_inference(router, door, request)
    if method != "GET" or path not in ("/v1/models", "/health", "/metrics"):
        return door.respond_error(404, f"No route for {method} {path}.")
    if path == "/health":
        return health(router, door)
    if path == "/metrics":
        return door.respond(200, router.render_metrics(), "text/plain; version=0.0.4")
    return _models(router, door, request)


def health(router: RouterState, door: Door) -> None:
    """Readiness: 503 while no endpoint is in rotation, or while a KV event subscription is
    refused (its index would stay empty unseen), with the reason as the body."""
    refused = router.events.refused if router.events is not None else {}
    if refused:
        reasons = "".join(f"KV events of {name}: {why}\n" for name, why in sorted(refused.items()))
        return door.respond(503, reasons.encode(), "text/plain")
    return door.respond(200 if router.pool.candidates() else 503, b"", "text/plain")


async def _models(router: RouterState, door: Door, request: Request) -> None:
    for e in router.pool.candidates():
        link = router.link(e)
        auth = upstream_auth(router, request)
        head = f"GET /v1/models HTTP/1.1\r\n{link.headers}{auth}\r\n".encode("latin-1")
        if await attempt(router, door, e, [head], 5.0):
            return
    door.respond_error(503, "No healthy endpoint.", "Retry-After: 1\r\n")


def handle_inference(router: RouterState, door: Door, request: Request) -> Work | None:
    """Parse and pick at once; forward on callbacks when the prompt needed no thread, the pick
    no prefill leg and the endpoint has an idle connection; else the task that goes on."""
    t0 = perf_counter()
    parsing = router.parser.parse(request)
    try:
        blocked = parsing.send(None)
    except StopIteration as parsed:
        req = parsed.value
    except Exception as exc:
        return refuse(door, exc)
    else:  # the prompt waits for a thread: so does the request
        return _parse_then_route(router, door, request, t0, parsing, blocked)
    if router.warm_until:  # just started: the engines' KV-event replay is still coming in
        return _route(router, door, request, req, set(), t0=t0)
    result = router.pick(req, _NONE)
    router.metrics.scheduling.observe(perf_counter() - t0)
    router.settle_soon()  # (runs once this callback, and so the send below, is done)
    if result is None:
        return no_endpoint(door)
    if result.prefill is None:
        e = result.primary
        link = router.link(e)
        conn = link.pool.take()
        if conn is not None:
            source = peer_source(router, req, e, {e.name}) if router.peer_sources else None
            fw = _Fast(router, door, e, link, conn, True, Charge(router, req, e, source))
            fw.request, fw.req, fw.result = request, req, result
            door.task = fw
            parts = _request_head(router, link, request, req, source)
            fw.start(parts, router.config.first_byte_timeout, request.body)
            return None
    return _route(router, door, request, req, set(), result)


def refuse(door: Door, exc: Exception) -> None:
    """The answer to a request whose prompt could not be prepared."""
    if isinstance(exc, APIError):  # limits, untrusted templates: the client's error
        door.respond_error(exc.status, exc.message)
    elif isinstance(exc, (msgspec.DecodeError, msgspec.ValidationError, ValueError)):
        door.respond_error(400, f"Invalid request: {exc}")
    else:  # a chat template that rejects the messages, etc.
        door.respond_error(400, f"Could not tokenize the request: {exc}")


def no_endpoint(door: Door) -> None:
    door.respond_error(503, "No healthy endpoint could serve the request.", "Retry-After: 1\r\n")


@types.coroutine
def _resume(work: Coroutine, blocked: Any) -> Generator[Any, Any, Any]:
    """The rest of a coroutine started by hand (``work.send(None)`` yielded ``blocked``), run
    in the awaiting task: what it yields goes to the task, what the task sends or throws goes
    back in; its return value is this one's."""
    while True:
        try:
            sent = yield blocked
        except GeneratorExit:
            work.close()
            raise
        except BaseException as exc:  # passed in, as `await` would
            try:
                blocked = work.throw(exc)
            except StopIteration as done:
                return done.value
            continue
        try:
            blocked = work.send(sent)
        except StopIteration as done:
            return done.value


async def _parse_then_route(
    router: RouterState, door: Door, request: Request, t0: float, parsing: Coroutine, blocked
) -> None:
    try:
        req = await _resume(parsing, blocked)
    except Exception as exc:
        return refuse(door, exc)
    await _route(router, door, request, req, set(), t0=t0)


async def _route(
    router: RouterState,
    door: Door,
    request: Request,
    req: SchedulingRequest,
    tried: set[str],
    result: SchedulingResult | None = None,
    t0: float | None = None,
    fresh: bool = False,
) -> None:
    """The task path, from the first attempt (``result``: its endpoints, if already picked;
    ``fresh``: on a new connection) or after failed ones (``tried``): at most max_retries
    attempts after the first, then a 503."""
    if router.warm_until:
        await router.wait_index_warm()
    while len(tried) <= router.config.max_retries:
        if result is None:
            result = router.pick(req, tried)
            if t0 is not None:
                router.metrics.scheduling.observe(perf_counter() - t0)
                t0 = None
            if result is None:
                break
        endpoint = result.primary
        if tried:
            router.metrics.retries.inc()
        tried.add(endpoint.name)
        send, source, charge = request.body, None, None
        if result.prefill is not None:  # P/D: the decode endpoint gets its KV from prefill
            # and is charged from the pick: while the prefill leg runs, later picks must see
            # the request it will decode (else they all pick the same idle decode endpoint)
            charge = Charge(router, req, endpoint, None, computes_prompt=False)
            try:
                send = await prefill_remotely(router, request.path, send, req, result.prefill)
            finally:
                if send is request.body:  # no KV came: the decode endpoint computes the prompt
                    charge.release()
                    charge = None
        else:
            source = peer_source(router, req, endpoint, tried)
        result = None
        if await _forward(router, door, request, send, req, endpoint, source, fresh, charge):
            return
        fresh = False
    no_endpoint(door)


def peer_source(
    router: RouterState, req: SchedulingRequest, e: Endpoint, tried: set[str]
) -> PeerSource | None:
    """The peer e is told to pull the prefix it lacks from (llm-d's P2P header), if any."""
    if router.peer_sources is None:
        return None
    candidates = router.pool.candidates()
    return select_source(router.precise_index, candidates, e, req, router.peer_sources, tried)


# end-to-end headers the client's request carries on to the endpoint: session affinity (a
# router behind this one, or an engine, may read it) and W3C trace context (vLLM's tracing)
PASSED_HEADERS = ("x-session-id", "traceparent", "tracestate")


def _request_head(
    router: RouterState,
    link: Link,
    request: Request,
    req: SchedulingRequest,
    source: PeerSource | None,
    body: bytes | None = None,
) -> list[bytes]:
    """What goes to the endpoint: head and body (``body``: in place of the client's)."""
    body = request.body if body is None else body
    peer = f"{PEER_HEADER}: {source.address}\r\n" if source else ""
    got = request.headers
    for name in PASSED_HEADERS:  # (the parser's values hold no CR or LF)
        if name in got:
            peer += f"{name}: {got[name]}\r\n"
    head = (
        f"POST {request.target} HTTP/1.1\r\n{link.headers}Content-Type: application/json\r\n"
        f"X-Request-Id: {req.request_id}\r\nContent-Length: {len(body)}\r\n{peer}"
        f"{upstream_auth(router, request)}\r\n"
    ).encode("latin-1")
    return [head, body]


async def _forward(
    router: RouterState,
    door: Door,
    request: Request,
    body: bytes,
    req: SchedulingRequest,
    e: Endpoint,
    source: PeerSource | None = None,
    fresh: bool = False,
    charge: Charge | None = None,
) -> bool:
    """Stream e's answer back: True once the client has it (whole, or broken mid-stream);
    False when e failed before the first byte (try another). `source`: the peer e pulls
    the prefix it lacks from (named in the header llm-d's P2P flow uses); `charge`: e's load
    when charged already (P/D: from the pick), released here."""
    link = router.link(e)
    parts = _request_head(router, link, request, req, source, body)
    if charge is None:
        # a body other than the client's carries the prefill endpoint's KV (P/D): e computes none
        charge = Charge(router, req, e, source, computes_prompt=body is request.body)
    try:
        timeout = router.config.first_byte_timeout
        return await attempt(router, door, e, parts, timeout, charge, body, fresh)
    finally:
        charge.release()


class _Fast(Forward):
    """The callback path's forward: alone to the end of the answer; a failure before the first
    byte hands the request to a task where the retry loop goes on (_route)."""

    __slots__ = ("request", "req", "result")
    door: Door

    def settled(self, outcome: str) -> None:
        self.charge.release()
        door = self.door
        if outcome == ANSWERED:
            door.finish()
        elif outcome == RETRY:
            work = _route(self.router, door, self.request, self.req, {self.e.name})
            door.go_on(work, self.request)
        elif outcome == STALE:  # the same endpoint on a new connection
            work = _route(self.router, door, self.request, self.req, set(), self.result, fresh=True)
            door.go_on(work, self.request)


class Charge:
    """A forward's load on its endpoint (router.forward_load, read by the scheduler), from its
    sending to its end, and the decision counted once its answer passes to the client."""

    __slots__ = ("router", "req", "e", "source", "load")

    def __init__(
        self,
        router: RouterState,
        req: SchedulingRequest,
        e: Endpoint,
        source: PeerSource | None,
        computes_prompt: bool = True,
    ) -> None:
        self.router, self.req, self.e, self.source = router, req, e, source
        self.load = forward_load.sent(e, req, router.approximate_index, computes_prompt)

    def first_byte(self) -> None:  # e has prefilled this prompt
        forward_load.prefilled(self.load)

    def passed(self) -> None:
        """e's answer (not a 5xx) passes to the client."""
        router, source, req = self.router, self.source, self.req
        hit = req.state.blocks_cached(self.e.name)
        if hit:
            router.metrics.predicted_cached.inc(hit * req.block_size)
        router.metrics.prompt_tokens.inc(len(req.token_ids))
        if source is not None:
            router.metrics.peer_sourced.labels(source.endpoint.name).inc()
            router.metrics.peer_lead_tokens.inc(source.lead_tokens)

    def release(self) -> None:
        forward_load.finished(self.load)
