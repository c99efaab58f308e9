"""The router's lean HTTP/1.1 client: keep-alive connections to the endpoints (pooled by
router.upstream_pool). An engine's answer goes back as the engine framed it (status line, headers
less the hop-by-hop ones, Content-Length or chunked body): chunk boundaries are tracked to find
the end of a response (router.chunked), never re-encoded. Both sides set TCP_NODELAY; a slow
client pauses the upstream read. Everything here runs in the connections' callbacks: what an
exchange's milestones mean (timeouts, retries, metrics) is router.forward's.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from time import monotonic
from typing import Protocol

from kvmesh.router.chunked import ChunkTracker

logger = logging.getLogger(__name__)
MAX_HEAD = 64 * 1024
_HOP = re.compile(rb"\r\n(?:connection|keep-alive|proxy-connection)[ \t]*:[^\r]*", re.I)


def _field(low: bytes, name: bytes) -> bytes | None:
    """The value of the last header line ``name`` (lower case, colon included) in a lower-cased
    head, if any."""
    i = low.rfind(name)
    if i < 0:
        return None
    i += len(name)
    end = low.find(b"\r", i)
    return low[i:] if end < 0 else low[i:end]


class UpstreamError(ConnectionError):
    """The endpoint failed; ``started`` when bytes of its answer already reached the client."""

    def __init__(self, message: str, started: bool = False) -> None:
        super().__init__(message)
        self.started = started


class StreamIdle(UpstreamError):
    """The endpoint sent no byte for the stream idle timeout in the middle of its answer."""


def nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Client(Protocol):
    """The client connection an exchange answers on (router.frontdoor.FrontDoor is the one):
    ``upstream`` is the connection whose reading pauses while the client reads slowly."""

    transport: asyncio.Transport | None
    upstream: Upstream | None
    sent_head: bool  # the current answer's status line went out
    must_close: bool  # the connection closes once the answer is out
    closed: bool


class Pool(Protocol):
    """Where an Upstream goes back once idle (router.upstream_pool.UpstreamPool is the one)."""

    def give_back(self, conn: Upstream) -> None: ...

    def forget(self, conn: Upstream) -> None: ...


class Exchange:
    """One request's trip to an endpoint: its answer passes to the client as it comes, with
    ``extra`` header lines. The head is held until the answer's first token, so that an
    endpoint that sends its head early (as vLLM does, before queueing and the prefill) and then
    fails or times out can still be left for another: the first token is the first body bytes,
    or for an SSE answer the first bytes holding a ``data:`` line (comments before it are held
    too, up to MAX_HEAD). A 5xx answer is never passed on. Subclasses say what the milestones
    mean: ``headed(status)`` once the head is in (a 5xx: its connection is closed already),
    ``first_body()`` when the first token passes to the client, ``ended()`` once the answer is
    in full, ``failed(error)`` when the connection failed before that (``error.started``: the
    client has bytes of the answer). ``last``: when bytes of the answer last came (monotonic).
    """

    __slots__ = ("door", "extra", "status", "started", "chunks", "pending", "held", "sse")
    __slots__ += ("last", "bodied")

    def __init__(self, door: Client, extra: bytes) -> None:
        self.door, self.extra = door, extra
        self.status, self.started = 0, False
        self.chunks: ChunkTracker | None = None
        self.pending = b""  # the answer's head, held until the first token (or the end)
        self.held = b""  # body bytes before an SSE answer's first data line
        self.sse = False  # a text/event-stream answer: its first token is its first data line
        self.last = 0.0
        self.bodied = False  # the first token passed to the client

    def headed(self, status: int) -> None:
        pass

    def first_body(self) -> None:
        """Called once, when the first token (with the head) passes to the client."""

    def ended(self) -> None:
        pass

    def failed(self, error: UpstreamError) -> None:
        pass

    def on_head(
        self, status: int, head: bytes, delimited: bool, hop: bool = True, sse: bool = False
    ) -> None:
        """head: the status line and header lines, without the blank line; status < 500.
        ``hop``: it may hold hop-by-hop header lines (dropped); ``sse``: its content type is
        text/event-stream."""
        self.status, self.sse = status, sse
        door = self.door
        if not delimited:  # the body ends when the engine closes: so must the client's
            door.must_close = True
        if hop:
            head = _HOP.sub(b"", head)
        close = b"\r\nConnection: close" if door.must_close else b""
        self.pending = b"HTTP/1.1%s\r\n%s%s\r\n\r\n" % (head[8:], self.extra, close)
        self.started = True
        self.last = monotonic()
        self.headed(status)

    def flush(self) -> None:
        """The held head (and held bytes) to the client: the answer ended with no token."""
        if self.pending:
            door = self.door
            door.sent_head = True
            if not door.closed:
                door.transport.write(self.pending + self.held)
        self.pending = self.held = b""

    def on_body(self, data: bytes) -> None:
        if not self.bodied:
            held = self.held + data
            if self.sse and b"data:" not in held and len(held) <= MAX_HEAD:
                self.held = held  # no token yet (an SSE comment, a keep-alive blank line)
                return
            data, self.pending, self.held = self.pending + held, b"", b""
            self.bodied = self.door.sent_head = True
            self.first_body()
        self.last = monotonic()
        if not self.door.closed:
            self.door.transport.write(data)

    def on_end(self) -> None:
        self.flush()
        self.ended()

    def on_error(self, message: str, kind: type[UpstreamError] = UpstreamError) -> None:
        """The connection failed: a held head is dropped (the client has nothing yet)."""
        self.pending = self.held = b""
        self.failed(kind(message, self.bodied))


class Upstream(asyncio.Protocol):
    """A keep-alive connection to one endpoint, serving one Exchange (``sink``) at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.sink: Exchange | None = None
        self.hbuf = b""  # a head in progress
        self.in_head = True
        self.remaining = -1  # Content-Length left; -1: chunked or until close
        self.chunks: ChunkTracker | None = None
        self.reusable = True
        self.got_bytes = False
        self.closed = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        nodelay(transport)

    def send(self, data: list[bytes], sink: Exchange) -> None:
        self.sink, self.in_head, self.got_bytes = sink, True, False
        self.transport.writelines(data)

    def abort(self) -> None:
        self.sink = None
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:  # nothing was asked: a confused peer
            self.transport.close()
            return
        self.got_bytes = True
        if self.in_head:
            if self.hbuf:
                data, self.hbuf = self.hbuf + data, b""
            end = data.find(b"\r\n\r\n")
            while end >= 0 and data[9:10] == b"1":  # an interim (1xx) answer: the head follows
                data = data[end + 4 :]
                end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > MAX_HEAD:
                    self._fail("response head too large")
                else:
                    self.hbuf = data
                return
            head, data = data[:end], data[end + 4 :]
            if not self._head(head, sink):
                return
            if self.remaining == 0:
                self._finish()
                return
            if not data:  # the head is held until the first token or the end
                return
        if self.remaining > 0:
            if len(data) >= self.remaining:
                sink.on_body(data[: self.remaining] if len(data) > self.remaining else data)
                self._finish()
                return
            self.remaining -= len(data)
            sink.on_body(data)
        elif self.chunks is not None:
            end = self.chunks.feed(data)
            sink.on_body(data if end < 0 else data[:end])
            if end >= 0:
                self._finish()
        else:
            sink.on_body(data)

    def _head(self, head: bytes, sink: Exchange) -> bool:
        low = head.lower()
        length = _field(low, b"\r\ncontent-length:")
        coding = _field(low, b"\r\ntransfer-encoding:")
        connection = _field(low, b"\r\nconnection:")
        try:
            status = int(head[9:12])
            self.remaining = int(length) if length is not None else -1
        except ValueError:
            self._fail("malformed status line or Content-Length")
            return False
        self.chunks = ChunkTracker() if coding is not None and b"chunked" in coding else None
        closes = connection is not None and b"close" in connection
        self.reusable = head[:8] == b"HTTP/1.1" and not closes
        self.in_head = False
        if status >= 500:  # held back, unread: the router tries another endpoint
            self.reusable, self.sink = False, None
            self.transport.close()
            sink.status = status
            sink.headed(status)
            return False
        if status in (204, 304):
            self.remaining = 0
        delimited = self.remaining >= 0 or self.chunks is not None
        if not delimited:
            self.reusable = False
        if self.chunks is not None:
            self.remaining = -1
            sink.chunks = self.chunks
        hop = connection is not None or b"keep-alive" in low  # hop-by-hop lines to drop
        sink.on_head(status, head, delimited, hop, b"text/event-stream" in low)
        return True

    def _finish(self) -> None:
        sink, self.sink = self.sink, None
        self.in_head = True
        if self.reusable and not self.closed:
            self.pool.give_back(self)
        else:
            self.transport.close()
        if sink is not None:
            sink.on_end()

    def _fail(self, message: str) -> None:
        sink, self.sink = self.sink, None
        self.transport.abort()
        if sink is not None:
            sink.on_error(message)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool.forget(self)
        sink, self.sink = self.sink, None
        if sink is None:
            return
        if not self.in_head and self.remaining < 0 and self.chunks is None:
            sink.on_end()  # the body was delimited by the close
        else:
            sink.on_error(f"connection closed: {exc or 'by the endpoint'}")
