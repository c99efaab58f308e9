"""The router's lean HTTP/1.1 client: keep-alive connections to the endpoints (pooled by
router.upstream_pool). An engine's answer goes back as the engine framed it (status line, headers
less the hop-by-hop ones, Content-Length or chunked body): chunk boundaries are tracked to find
the end of a response (router.chunked), never re-encoded. Both sides set TCP_NODELAY; a slow
client pauses the upstream read.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from time import monotonic
from typing import TYPE_CHECKING

from kvmesh.router.chunked import ChunkTracker

if TYPE_CHECKING:
    from kvmesh.router.frontdoor import FrontDoor
    from kvmesh.router.upstream_pool import UpstreamPool

logger = logging.getLogger(__name__)
MAX_HEAD = 64 * 1024
_DROP = frozenset((b"connection", b"keep-alive", b"proxy-connection"))


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


class Exchange:
    """One request's trip to an endpoint. A 5xx answer is held back (the router tries another
    endpoint); any other passes to the client as it comes, with ``extra`` header lines.
    ``last``: when bytes of the answer last came (monotonic), read by the idle watch."""

    __slots__ = (
        "door", "extra", "head", "done", "status", "started", "chunks", "pending", "first_body",
        "last",
    )  # fmt: skip

    def __init__(self, door: FrontDoor, extra: bytes, first_body=None) -> None:
        loop = asyncio.get_running_loop()
        self.door, self.extra = door, extra
        self.first_body = first_body  # called once, when the first body bytes arrive
        self.head: asyncio.Future = loop.create_future()
        self.done: asyncio.Future = loop.create_future()
        self.status, self.started = 0, False
        self.chunks: ChunkTracker | None = None
        self.pending = b""  # the answer's head, sent with the first body bytes when they came too
        self.last = 0.0

    def on_head(self, status: int, lines: list[bytes], delimited: bool) -> bool:
        self.status = status
        if status >= 500:
            self.head.set_result(status)
            return False
        door = self.door
        if not delimited:  # the body ends when the engine closes: so must the client's
            door.must_close = True
        out = [b"HTTP/1.1" + lines[0][8:]]
        for line in lines[1:]:
            if line[: line.find(b":")].strip().lower() not in _DROP:
                out.append(line)
        out.append(self.extra)
        if door.must_close:
            out.append(b"Connection: close")
        out.append(b"\r\n")
        door.sent_head = self.started = True
        self.pending = b"\r\n".join(out)
        self.last = monotonic()
        self.head.set_result(status)
        return True

    def flush(self) -> None:
        if self.pending and not self.door.closed:
            self.door.transport.write(self.pending)
        self.pending = b""

    def on_body(self, data: bytes) -> None:
        self.last = monotonic()
        if self.first_body is not None:
            call, self.first_body = self.first_body, None
            call()
        if self.pending:
            data, self.pending = self.pending + data, b""
        if not self.door.closed:
            self.door.transport.write(data)

    def on_end(self) -> None:
        self.flush()
        if not self.done.done():
            self.done.set_result(None)

    def on_error(self, message: str, kind: type[UpstreamError] = UpstreamError) -> None:
        self.flush()
        err = kind(message, self.started)
        fut = self.head if not self.head.done() else self.done
        if not fut.done():
            fut.set_exception(err)

    def on_timeout(self) -> None:
        if not self.head.done():
            self.head.set_exception(TimeoutError("no answer before the first-byte timeout"))


class IdleWatch:
    """Cuts an answer that sent no byte for ``limit`` seconds mid-way (the exchange fails with
    StreamIdle); time the reading was paused for a slow client does not count."""

    __slots__ = ("ex", "conn", "limit", "timer")

    def __init__(self, ex: Exchange, conn: Upstream, limit: float) -> None:
        self.ex, self.conn, self.limit = ex, conn, limit
        self.timer = asyncio.get_running_loop().call_later(limit, self.check)

    def check(self) -> None:
        ex, conn = self.ex, self.conn
        if ex.done.done():
            return
        quiet = monotonic() - ex.last
        if conn.transport is not None and not conn.transport.is_reading():
            ex.last, quiet = monotonic(), 0.0  # paused for the client: not the endpoint's fault
        if quiet < self.limit:
            self.timer = asyncio.get_running_loop().call_later(self.limit - quiet, self.check)
            return
        conn.abort()
        ex.on_error(f"no byte for {self.limit:g} s", StreamIdle)

    def cancel(self) -> None:
        self.timer.cancel()


class Upstream(asyncio.Protocol):
    """A keep-alive connection to one endpoint, serving one Exchange at a time."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.sink: Exchange | None = None
        self.hbuf = bytearray()
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
            self.hbuf += data
            while True:
                end = self.hbuf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.hbuf) > MAX_HEAD:
                        self._fail("response head too large")
                    return
                lines = bytes(self.hbuf[:end]).split(b"\r\n")
                data = bytes(self.hbuf[end + 4 :])
                self.hbuf.clear()
                if lines[0][9:10] != b"1":
                    break
                self.hbuf += data  # an interim (1xx) answer: the real head follows
            if not self._head(lines, sink):
                return
            if self.remaining == 0:
                self._finish()
                return
            if not data:
                sink.flush()
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

    def _head(self, lines: list[bytes], sink: Exchange) -> bool:
        try:
            version, status = lines[0][:8], int(lines[0][9:12])
        except ValueError:
            self._fail("malformed status line")
            return False
        self.remaining, self.chunks = -1, None
        self.reusable = version == b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                self.remaining = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                self.chunks = ChunkTracker()
            elif name == b"connection" and b"close" in value.lower():
                self.reusable = False
        if status in (204, 304):
            self.remaining = 0
        delimited = self.remaining >= 0 or self.chunks is not None
        if not delimited:
            self.reusable = False
        if self.chunks is not None:
            self.remaining = -1
            sink.chunks = self.chunks
        self.in_head = False
        if not sink.on_head(status, lines, delimited):
            self.reusable = False
            self.sink = None
            self.transport.close()
            return False
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
