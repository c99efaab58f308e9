"""The router's front door: a lean HTTP/1.1 server protocol. Requests are read (Content-Length
or chunked bodies, size-limited, Expect: 100-continue honoured), served one at a time per
connection by a handler task that is cancelled when the client goes, and answered in order."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from kvmesh.protocol.openai import error_body
from kvmesh.router.proxy import MAX_HEAD, nodelay

if TYPE_CHECKING:
    from kvmesh.router.proxy import Upstream

logger = logging.getLogger(__name__)
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            413: "Payload Too Large", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 503: "Service Unavailable"}  # fmt: skip


@dataclass(slots=True)
class Request:
    method: str
    target: str  # as sent: path and query
    path: str
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes
    keep_alive: bool


class FrontDoor(asyncio.Protocol):
    """One client connection."""

    def __init__(
        self,
        handler: Callable[[FrontDoor, Request], Awaitable[None]],
        max_body: int,
        doors: set[FrontDoor],
    ) -> None:
        self.handler, self.max_body, self.doors = handler, max_body, doors
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.task: asyncio.Task | None = None
        self.upstream: Upstream | None = None  # paused while the client reads slowly
        self.sent_head = False  # the current answer's status line went out
        self.must_close = False
        self.closed = False
        self.seen = True  # data came since the last idle sweep
        self._continued = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        nodelay(transport)
        self.doors.add(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.doors.discard(self)
        if self.task is not None:
            self.task.cancel()

    def pause_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.seen = True
        self.buf += data
        if self.task is None:
            self._next()
        elif len(self.buf) > MAX_HEAD:
            self.transport.pause_reading()  # pipelined: wait for the answer in progress

    def _next(self) -> None:
        req = self._parse()
        if req is not None:
            self.sent_head, self.must_close = False, not req.keep_alive
            self.task = asyncio.get_running_loop().create_task(self._serve(req))

    async def _serve(self, req: Request) -> None:
        try:
            await self.handler(self, req)
        except asyncio.CancelledError:
            return
        except Exception:
            logger.exception("router error in %s %s", req.method, req.path)
            if not self.sent_head:
                self.respond_error(500, "Internal router error.")
            else:
                self.must_close = True
        finally:
            self.task, self.upstream, self.seen = None, None, True
        if self.closed:
            return
        if self.must_close:
            self.transport.close()
            return
        self.transport.resume_reading()
        if self.buf:
            self._next()

    def _parse(self) -> Request | None:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD:
                self._reject(431, "Request header fields too large.")
            return None
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._reject(400, "Malformed HTTP request line.")
            return None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                self._reject(400, "Malformed HTTP header.")
                return None
            name, value = name.strip().lower(), value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        start = end + 4
        if "chunked" in headers.get("transfer-encoding", "").lower():
            found = _dechunk(buf, start, self.max_body)
            if found == -1:
                self._reject(413, f"Request body larger than {self.max_body} bytes.")
                return None
            if found is None:
                return self._wait_body(headers)
            body, stop = found
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                self._reject(400, "Invalid Content-Length.")
                return None
            if length > self.max_body or length < 0:
                self._reject(413, f"Request body larger than {self.max_body} bytes.")
                return None
            if len(buf) < start + length:
                return self._wait_body(headers)
            stop = start + length
            body = bytes(buf[start:stop])
        del buf[:stop]
        self._continued = False
        conn = headers.get("connection", "").lower()
        keep = parts[2] == "HTTP/1.1" and "close" not in conn
        target = parts[1]
        return Request(parts[0], target, target.partition("?")[0], headers, body, keep)

    def _wait_body(self, headers: dict[str, str]) -> None:
        if not self._continued and headers.get("expect", "").lower() == "100-continue":
            self._continued = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    def _reject(self, status: int, message: str) -> None:
        self.buf.clear()
        self.must_close = True
        self.respond_error(status, message)
        self.transport.close()

    # ---- answers ----------------------------------------------------------------------------
    def respond(
        self, status: int, body: bytes, content_type: str = "application/json", extra: str = ""
    ) -> None:
        close = "Connection: close\r\n" if self.must_close else ""
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\nContent-Type: {content_type}"
            f"\r\nContent-Length: {len(body)}\r\n{extra}{close}\r\n"
        )
        self.sent_head = True
        self.transport.write(head.encode("latin-1") + body)

    def respond_error(self, status: int, message: str, extra: str = "") -> None:
        self.respond(status, msgspec.json.encode(error_body(message, status)), extra=extra)


def _dechunk(buf: bytearray, pos: int, limit: int) -> tuple[bytes, int] | int | None:
    """A whole chunked body at buf[pos:]: (payload, end); None: incomplete; -1: over limit."""
    out = bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0] or b"0", 16)
        if size == 0:
            end = buf.find(b"\r\n\r\n", eol)
            return (bytes(out), end + 4) if end >= 0 else None
        if len(out) + size > limit:
            return -1
        if len(buf) < eol + 4 + size:
            return None
        out += buf[eol + 2 : eol + 2 + size]
        pos = eol + 4 + size


@dataclass(slots=True)
class RouterServer:
    router: Any  # kvmesh.router.app.Router
    server: asyncio.AbstractServer
    doors: set[FrontDoor]
    sweeper: asyncio.Task | None = None

    async def cleanup(self) -> None:
        self.server.close()
        if self.sweeper is not None:
            self.sweeper.cancel()
        for door in list(self.doors):
            if door.transport is not None:
                door.transport.close()
        await self.router.stop()


async def _close_idle(doors: set[FrontDoor], every: float) -> None:
    """Close client connections idle for a whole sweep interval (so after every..2*every
    seconds): no request in progress, none finished and no byte received, a request head left
    unfinished included."""
    while True:
        await asyncio.sleep(every)
        for door in list(doors):
            if door.task is None and not door.seen and door.transport is not None:
                door.transport.close()
            door.seen = False


async def serve(
    router: Any, host: str, port: int, max_body: int, idle_timeout: float = 75.0
) -> RouterServer:
    """Listen on host:port; each connection's requests go to router.handle."""
    doors: set[FrontDoor] = set()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: FrontDoor(router.handle, max_body, doors), host, port, backlog=1024
    )
    return RouterServer(router, server, doors, loop.create_task(_close_idle(doors, idle_timeout)))
