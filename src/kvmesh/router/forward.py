"""One request forwarded to one endpoint over one connection, driven by the connection's
callbacks alone: no task, future or timer of its own. The endpoint's Watchdog
(router.upstream_pool) sweeps the forwards in flight for a late first byte and for a stalled
stream. A forward ends, once, in ``settled(outcome)`` (awaited by a task through ``attempt``),
one of:

ANSWERED   the client has the answer: in full, or cut mid-way and ended with an SSE error event
RETRY      failed before the first byte (counted against the endpoint): another may serve it
STALE      the pooled connection it was sent on had been closed by the endpoint meanwhile
CANCELLED  the client went away (the upstream exchange was aborted)
"""

from __future__ import annotations

import asyncio
import logging
from time import monotonic
from typing import TYPE_CHECKING, Protocol

import msgspec

from kvmesh.router.proxy import Client, Exchange, StreamIdle, Upstream, UpstreamError

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint
    from kvmesh.router.state import RouterState
    from kvmesh.router.upstream_pool import Link

logger = logging.getLogger(__name__)
ANSWERED, RETRY, STALE, CANCELLED = "answered", "retry", "stale", "cancelled"
_BROKE = b'data: {"error": {"message": "upstream stream broke", "type": "InternalServerError", "code": 502}}\n\n'  # noqa: E501
_STALLED = b'data: {"error": {"message": "upstream stream stalled", "type": "InternalServerError", "code": 504}}\n\n'  # noqa: E501


class _Stream(msgspec.Struct):
    stream: bool = False


_stream_flag = msgspec.json.Decoder(_Stream)


def non_streaming_patience(router: RouterState, body: bytes) -> float:
    """Seconds to wait beyond the first-byte timeout: a non-streaming answer's head comes only
    with the whole completion. Read only once the first-byte timeout has passed."""
    try:
        if _stream_flag.decode(body).stream:
            return 0.0
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    cfg = router.config
    return max(0.0, cfg.non_streaming_first_byte_timeout - cfg.first_byte_timeout)


class Charge(Protocol):
    """What a forward tells an inference request's bookkeeping (router.handlers.Charge)."""

    def first_byte(self) -> None: ...

    def passed(self) -> None: ...


class Forward(Exchange):
    """One request to endpoint ``e`` on ``conn`` (``reused``: taken from the pool). Until its
    first token (router.proxy.Exchange: the first body bytes, or an SSE answer's first data
    line), whatever the endpoint sent before it, it is cut after the first-byte timeout (a
    non-streaming inference request's ``body`` earns it the longer one) and goes to another
    endpoint; after that, once no byte came for the stream idle timeout (time the read was
    paused for a slow client does not count). ``charge``: the inference bookkeeping told of the
    answer's milestones (None: none)."""

    __slots__ = ("router", "e", "conn", "reused", "charge", "watchdog", "deadline", "body", "done")

    def __init__(
        self,
        router: RouterState,
        door: Client,
        e: Endpoint,
        link: Link,
        conn: Upstream,
        reused: bool,
        charge: Charge | None = None,
    ) -> None:
        super().__init__(door, link.tag)
        self.router, self.e, self.conn, self.reused, self.charge = router, e, conn, reused, charge
        self.watchdog = link.watchdog
        self.deadline = 0.0
        self.body: bytes | None = None
        self.done = False

    def settled(self, outcome: str) -> None:
        """Called once, with how the forward ended."""

    def start(self, parts: list[bytes], timeout: float, body: bytes | None = None) -> None:
        """Send parts; the first byte is due within timeout seconds (``body``: an inference
        request's, whose answer gets the non-streaming patience if it asks no stream)."""
        self.deadline, self.body = monotonic() + timeout, body
        self.door.upstream = self.conn
        self.conn.send(parts, self)
        idle = self.router.config.stream_idle_timeout
        self.watchdog.add(self, min(timeout, idle) if idle > 0 else timeout)

    def cancel(self) -> None:
        """The client went away: the upstream exchange is dropped."""
        if not self.done:
            if self.conn.sink is self:
                self.conn.abort()
            self._settle(CANCELLED)

    def check(self, now: float) -> None:
        """The watchdog's look at an unsettled forward."""
        if not self.bodied:  # no token yet: a head alone (sent before the prefill) is not one
            if now < self.deadline:
                return
            if self.body is not None:  # asked once, when the first-byte timeout passed
                more, self.body = non_streaming_patience(self.router, self.body), None
                if more > 0:
                    self.deadline = now + more
                    return
            self.conn.abort()  # the held head, if any, never reaches the client
            self.pending = self.held = b""
            self.router.pool.request_failed(self.e, "timeout")
            self.router.metrics.count(self.e.name, "timeout")
            self._settle(RETRY)
            return
        idle = self.router.config.stream_idle_timeout
        if idle <= 0:
            return
        transport = self.conn.transport
        if transport is not None and not transport.is_reading():
            self.last = now  # paused for the client: not the endpoint's fault
        elif now - self.last >= idle:
            self.conn.abort()
            self.on_error(f"no byte for {idle:g} s", StreamIdle)

    # ---- the exchange's milestones ------------------------------------------------------------
    def headed(self, status: int) -> None:
        if status >= 500:
            self.router.metrics.count(self.e.name, f"http_{status}")
            self.router.pool.request_failed(self.e, "5xx")
            self._settle(RETRY)

    def first_body(self) -> None:
        if self.charge is not None:
            self.charge.passed()
            self.charge.first_byte()

    def ended(self) -> None:
        if self.done:
            return
        if not self.bodied and self.charge is not None:  # an answer with no body passed
            self.charge.passed()
        self.e.errors = 0  # an answer in full: the outlier count starts again
        status = self.status
        self.router.metrics.count(self.e.name, "ok" if status < 400 else f"http_{status}")
        self._settle(ANSWERED)

    def failed(self, error: UpstreamError) -> None:
        if self.done:
            return
        router, e = self.router, self.e
        if not error.started:  # the client has nothing yet: another endpoint may answer
            if self.reused and not self.conn.got_bytes:
                self._settle(STALE)
                return
            # it took the request, then closed before the first token: this request may be what
            # broke it (as one that cannot be answered), so it counts towards ejection as a
            # failed request, never as an unreachable endpoint (a refused connect is one)
            outcome = "stream_error" if self.started else "dropped"
            router.pool.request_failed(e, outcome)
            router.metrics.count(e.name, outcome)
            self._settle(RETRY)
            return
        idle = isinstance(error, StreamIdle)  # the client has bytes already: end its answer
        router.metrics.count(e.name, "stream_idle_timeout" if idle else "stream_error")
        if idle:
            router.pool.request_failed(e, "timeout")
        logger.warning("stream from %s %s: %s", e.name, "stalled" if idle else "broke", error)
        event = _STALLED if idle else _BROKE
        door = self.door
        if self.chunks is not None and self.chunks.at_boundary and not door.closed:
            door.transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
        else:
            door.must_close = True
        self._settle(ANSWERED)

    def _settle(self, outcome: str) -> None:
        if not self.done:
            self.done = True
            self.watchdog.forwards.discard(self)
            self.settled(outcome)


async def attempt(
    router: RouterState,
    door: Client,
    e: Endpoint,
    parts: list[bytes],
    timeout: float,
    charge: Charge | None = None,
    body: bytes | None = None,
    fresh: bool = False,
) -> bool:
    """The task path's forward: parts sent to e on a pooled connection (unless ``fresh``),
    replaced by a new one if the endpoint had closed it. True once the client has e's answer,
    False when e failed before its first byte (counted; an unreachable e leaves rotation)."""
    link = router.link(e)
    loop = asyncio.get_running_loop()
    while True:
        conn = None if fresh else link.pool.take()
        if conn is None:
            try:
                conn = await link.pool.connect(5.0)
            except (OSError, TimeoutError):
                router.pool.unreachable(e)
                router.metrics.count(e.name, "connect_error")
                return False
        fw = _Awaited(router, door, e, link, conn, not fresh, charge)
        fw.outcome = loop.create_future()
        fw.start(parts, timeout, body)
        try:
            outcome = await fw.outcome
        except asyncio.CancelledError:  # the client went away
            fw.cancel()
            raise
        if outcome != STALE:
            return outcome == ANSWERED
        fresh = True


class _Awaited(Forward):
    """The task path's forward: its outcome is awaited."""

    __slots__ = ("outcome",)

    def settled(self, outcome: str) -> None:
        if not self.outcome.done():
            self.outcome.set_result(outcome)
