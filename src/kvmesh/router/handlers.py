"""The router's HTTP routes: an inference request is parsed, scheduled and forwarded, retrying
elsewhere before the first byte, and the chosen endpoint's answer streams back byte for byte."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from kvmesh.protocol.auth import UNAUTHORIZED, bearer_matches
from kvmesh.protocol.openai import APIError
from kvmesh.router.backlog import uncached_tokens
from kvmesh.router.pd import prefill_remotely
from kvmesh.router.peer_source import PEER_HEADER, PeerSource, select_source
from kvmesh.router.proxy import Exchange, IdleWatch, StreamIdle, Upstream, UpstreamError

if TYPE_CHECKING:
    from kvmesh.router.app import Router
    from kvmesh.router.endpoints import Endpoint
    from kvmesh.router.frontdoor import FrontDoor, Request
    from kvmesh.router.plugins import SchedulingRequest

logger = logging.getLogger(__name__)
INFERENCE_PATHS = frozenset(("/v1/completions", "/v1/chat/completions"))
_BROKE = b'data: {"error": {"message": "upstream stream broke", "type": "InternalServerError", "code": 502}}\n\n'  # noqa: E501
_STALLED = b'data: {"error": {"message": "upstream stream stalled", "type": "InternalServerError", "code": 504}}\n\n'  # noqa: E501


class _Stream(msgspec.Struct):
    stream: bool = False


_stream_flag = msgspec.json.Decoder(_Stream)


def _non_streaming_patience(router: Router, body: bytes) -> float:
    """Seconds to wait beyond the first-byte timeout: a non-streaming answer's head comes only
    with the whole completion. Read only once the first-byte timeout has passed."""
    try:
        if _stream_flag.decode(body).stream:
            return 0.0
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    cfg = router.config
    return max(0.0, cfg.non_streaming_first_byte_timeout - cfg.first_byte_timeout)


def upstream_auth(router: Router, request: Request) -> str:
    """The Authorization header line sent to an endpoint (RouterConfig says which)."""
    auth = router.config.upstream_authorization(request.headers.get("authorization"))
    return f"Authorization: {auth}\r\n" if auth else ""


async def handle(router: Router, door: FrontDoor, request: Request) -> None:
    path, method = request.path, request.method
    key, auth = router.config.api_key, request.headers.get("authorization")
    if key and path.startswith("/v1") and not bearer_matches(auth, key):  # as vLLM: /v1/* only
        return door.respond_error(401, UNAUTHORIZED, "WWW-Authenticate: Bearer\r\n")
    if path in INFERENCE_PATHS:
        if method != "POST":
            return door.respond_error(405, f"{method} is not allowed on {path}.")
        return await handle_inference(router, door, request)
    if method != "GET" or path not in ("/v1/models", "/health", "/metrics"):
        return door.respond_error(404, f"No route for {method} {path}.")
    if path == "/health":
        return door.respond(200 if router.pool.candidates() else 503, b"", "text/plain")
    if path == "/metrics":
        return door.respond(200, router.render_metrics(), "text/plain; version=0.0.4")
    for e in router.pool.candidates():
        link = router.link(e)
        auth = upstream_auth(router, request)
        head = f"GET /v1/models HTTP/1.1\r\n{link.headers}{auth}\r\n".encode("latin-1")
        sent = await _send(router, door, e, [head], 5.0)
        if isinstance(sent, tuple) and sent[0].status < 500:
            await _relay(router, door, e, *sent)
            return
    door.respond_error(503, "No healthy endpoint.", "Retry-After: 1\r\n")


async def handle_inference(router: Router, door: FrontDoor, request: Request) -> None:
    t0 = time.perf_counter()
    try:
        req = await router.parser.parse(request)
    except APIError as exc:  # limits, untrusted templates: the client's error, OpenAI-shaped
        return door.respond_error(exc.status, exc.message)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        return door.respond_error(400, f"Invalid request: {exc}")
    except Exception as exc:  # a chat template that rejects the messages, etc.
        return door.respond_error(400, f"Could not tokenize the request: {exc}")
    if router.warm_until:  # just started: the engines' KV-event replay is still coming in
        await router.wait_index_warm()
    tried: set[str] = set()
    for attempt in range(router.config.max_retries + 1):
        result = router.pick(req, tried)
        if attempt == 0:
            router.metrics.scheduling.observe(time.perf_counter() - t0)
        if result is None:
            break
        endpoint = result.primary
        tried.add(endpoint.name)
        if attempt:
            router.metrics.retries.inc()
        send, source = request.body, None
        if result.prefill is not None:  # P/D: the decode endpoint gets its KV from prefill
            send = await prefill_remotely(router, request.path, send, req, result.prefill)
        elif router.peer_sources is not None:
            candidates = router.pool.candidates()
            source = select_source(
                router.precise_index, candidates, endpoint, req, router.peer_sources, tried
            )
        if await _forward(router, door, request, send, req, endpoint, source):
            return
    door.respond_error(503, "No healthy endpoint could serve the request.", "Retry-After: 1\r\n")


async def _forward(
    router: Router,
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
    link = router.link(e)
    peer = f"{PEER_HEADER}: {source.address}\r\n" if source else ""
    head = (
        f"POST {request.target} HTTP/1.1\r\n{link.headers}Content-Type: application/json\r\n"
        f"X-Request-Id: {req.request_id}\r\nContent-Length: {len(body)}\r\n{peer}"
        f"{upstream_auth(router, request)}\r\n"
    ).encode("latin-1")
    tokens, prefill = len(req.token_ids), uncached_tokens(req, e.name)
    e.in_flight += 1
    e.in_flight_tokens += tokens
    e.pending_prefill_tokens += prefill
    answered = False

    def first_byte() -> None:  # e has prefilled this prompt: its backlog shrinks, once
        nonlocal answered
        if not answered:
            answered = True
            e.pending_prefill_tokens -= prefill

    try:
        sent = await _send(
            router,
            door,
            e,
            [head, body],
            router.config.first_byte_timeout,
            first_byte,
            lambda: _non_streaming_patience(router, body),
        )
        if isinstance(sent, str):
            router.metrics.count(e.name, sent)
            return False
        ex, conn = sent
        if ex.status >= 500:
            router.metrics.count(e.name, f"http_{ex.status}")
            router.pool.request_failed(e, "5xx")
            return False
        _record_decision(router, req, e)
        if source is not None:
            router.metrics.peer_sourced.labels(source.endpoint.name).inc()
            router.metrics.peer_lead_tokens.inc(source.lead_tokens)
        await _relay(router, door, e, ex, conn)
        return True
    finally:
        first_byte()
        e.in_flight -= 1
        e.in_flight_tokens -= tokens


async def _send(
    router: Router,
    door: FrontDoor,
    e: Endpoint,
    parts: list[bytes],
    first_byte_timeout: float,
    first_body=None,
    patience=None,
) -> tuple[Exchange, Upstream] | str:
    """Send parts to e; once its answer's head is in (passed on unless 5xx), the exchange;
    before that, the failure as a metrics outcome (an unreachable e leaves rotation; a timeout
    counts towards its ejection). A pooled connection that the endpoint had closed meanwhile
    is retried on a fresh one. ``patience()``: asked when first_byte_timeout has passed, the
    seconds more to wait."""
    link = router.link(e)
    loop = asyncio.get_running_loop()

    def expire(ex: Exchange) -> None:
        nonlocal timer
        more = patience() if patience is not None else 0.0
        if more > 0 and not ex.head.done():
            timer = loop.call_later(more, ex.on_timeout)
        else:
            ex.on_timeout()

    for fresh in (False, True):
        conn = None if fresh else link.pool.take()
        reused = conn is not None
        if conn is None:
            try:
                conn = await link.pool.connect(5.0)
            except (OSError, TimeoutError):
                router.pool.unreachable(e)
                return "connect_error"
        ex = Exchange(door, link.tag, first_body)
        door.upstream = conn
        conn.send(parts, ex)
        timer = loop.call_later(first_byte_timeout, expire, ex)
        try:
            await ex.head
        except UpstreamError:
            if reused and not conn.got_bytes:
                continue  # the endpoint had closed this idle connection
            router.pool.unreachable(e)
            return "connect_error"
        except TimeoutError:
            conn.abort()
            router.pool.request_failed(e, "timeout")
            return "timeout"
        except asyncio.CancelledError:  # the client went away
            if conn.sink is ex:  # still ours: not finished and handed back to the pool
                conn.abort()
            raise
        finally:
            timer.cancel()
        return ex, conn
    return "connect_error"


async def _relay(
    router: Router, door: FrontDoor, e: Endpoint, ex: Exchange, conn: Upstream
) -> None:
    """Wait while the rest of e's answer streams to the client; one that stops mid-way (its
    connection broke, or no byte came for the stream idle timeout: this counts towards e's
    ejection) ends with an SSE error event."""
    limit = router.config.stream_idle_timeout
    watch = IdleWatch(ex, conn, limit) if limit > 0 and not ex.done.done() else None
    try:
        await ex.done
    except UpstreamError as exc:  # the client has bytes already: end its answer
        idle = isinstance(exc, StreamIdle)
        router.metrics.count(e.name, "stream_idle_timeout" if idle else "stream_error")
        if idle:
            router.pool.request_failed(e, "timeout")
        logger.warning("stream from %s %s: %s", e.name, "stalled" if idle else "broke", exc)
        event = _STALLED if idle else _BROKE
        if ex.chunks is not None and ex.chunks.at_boundary and not door.closed:
            door.transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
        else:
            door.must_close = True
        return
    except asyncio.CancelledError:
        if conn.sink is ex:
            conn.abort()
        raise
    finally:
        if watch is not None:
            watch.cancel()
    e.errors = 0  # an answer in full: the outlier count starts again
    router.metrics.count(e.name, "ok" if ex.status < 400 else f"http_{ex.status}")


def _record_decision(router: Router, req: SchedulingRequest, e: Endpoint) -> None:
    if req.block_keys:
        router.approximate_index.record(e.name, req.block_keys)
    hit = max((req.precise or {}).get(e.name, 0.0), (req.approximate or {}).get(e.name, 0))
    if hit:
        router.metrics.predicted_cached.inc(hit * req.block_size)
    router.metrics.prompt_tokens.inc(len(req.token_ids))
