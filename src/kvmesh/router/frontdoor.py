"""The router's front door: a lean HTTP/1.1 server protocol on llhttp (httptools), strict.
Requests (Content-Length or chunked bodies, size-limited, Expect: 100-continue honoured) are
served one at a time per connection by a handler task that is cancelled when the client goes,
and answered in order. Malformed input gets an OpenAI-style 4xx and the connection closes."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httptools
import msgspec

from kvmesh.protocol.openai import error_body
from kvmesh.router.proxy import MAX_HEAD, nodelay

if TYPE_CHECKING:
    from kvmesh.router.proxy import Upstream

logger = logging.getLogger(__name__)
MAX_HEADERS = 100  # header (and trailer) lines per request
LINGER = 2.0  # seconds an answered bad connection drops the client's bytes before closing
_UNIQUE = frozenset(("content-length", "host"))  # a second one is a smuggling attempt
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 408: "Request Timeout", 413: "Payload Too Large",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}  # fmt: skip


@dataclass(slots=True)
class Request:
    method: str
    target: str  # as sent: path and query (llhttp admits no CR, LF, NUL or space in it)
    path: str
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes
    keep_alive: bool


class _Reject(Exception):
    """Raised in a parser callback; httptools hands it back as the parse error's context."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class FrontDoor(asyncio.Protocol):
    """One client connection. Invariants: at most one handler task runs; ``queue`` holds the
    requests read in full behind it (reading pauses while one waits), and an error to answer,
    (status, message), is its last item; once ``stopped`` no byte is parsed again. The
    client's EOF closes the connection, which cancels the handler."""

    def __init__(
        self,
        handler: Callable[[FrontDoor, Request], Awaitable[None]],
        max_body: int,
        doors: set[FrontDoor],
        request_timeout: float = 30.0,
    ) -> None:
        self.handler, self.max_body, self.doors = handler, max_body, doors
        self.request_timeout = request_timeout
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request | tuple[int, str]] = deque()
        self.task: asyncio.Task | None = None
        self.upstream: Upstream | None = None  # paused while the client reads slowly
        self.sent_head = False  # the current answer's status line went out
        self.must_close = False
        self.closed = False
        self.seen = True  # data came since the last idle sweep
        self.stopped = False  # an error or the last request was read
        self.paused = False  # reading paused by us: a read request waits behind the task
        self.timer: asyncio.TimerHandle | None = None  # the deadline of the message in progress
        # the message in progress (on_message_begin resets it)
        self._in_message = self._in_head = self._expect = False
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_size = self._head_size = self._head_reads = self._lines = 0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport, self.loop = transport, asyncio.get_running_loop()
        nodelay(transport)
        self.doors.add(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.doors.discard(self)
        self._cancel_timer()
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
        if self.stopped:
            return
        # a head's size: its parts as llhttp reports them (a header once it ends), and whole
        # reads that start inside it (an unfinished line in memory counts before it ends)
        if self._in_head:
            self._head_reads += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            error = exc.__context__  # what the callback raised
            if isinstance(error, _Reject):
                self._fail(error.status, error.message)
            else:
                logger.error("front door callback failed", exc_info=error)
                self._fail(500, "Internal router error.")
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if not self.stopped:  # else: bytes after the last request, dropped
                self._fail(400, f"Malformed HTTP request: {exc}.")
        if not self.stopped and self._in_head and self._head_reads > MAX_HEAD:
            self._fail(431, "Request header fields too large.")
        if self._in_message and self.timer is None and not self.stopped:
            self.timer = self.loop.call_later(self.request_timeout, self._timed_out)
        if self.task is None:
            self._next()
        if self.task is not None and self.queue and not self.stopped and not self.paused:
            self.paused = True  # pipelined: wait for the answer in progress
            self.transport.pause_reading()
            self._cancel_timer()

    # ---- httptools callbacks: they run inside feed_data ---------------------------------------
    def on_message_begin(self) -> None:
        self._in_message = self._in_head = True
        self._expect = False
        self._url, self._headers, self._body = b"", {}, []
        self._body_size = self._head_size = self._head_reads = self._lines = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)
        if self._head_size > MAX_HEAD:
            raise _Reject(431, "Request target too long.")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        self._lines += 1
        if self._head_size > MAX_HEAD or self._lines > MAX_HEADERS:
            raise _Reject(431, "Request header fields too large.")
        if not self._in_head:
            return  # a chunked body's trailer: never a request header
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1").strip(" \t")
        known = self._headers.get(key)
        if known is None:
            self._headers[key] = text
        elif key in _UNIQUE:
            raise _Reject(400, f"More than one {key} header.")
        else:
            self._headers[key] = f"{known}, {text}"

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser, headers = self.parser, self._headers
        if parser.should_upgrade():
            raise _Reject(400, "Protocol upgrades and CONNECT are not supported.")
        if parser.get_http_version() not in ("1.1", "1.0"):
            raise _Reject(400, "Unsupported HTTP version.")
        coding = headers.get("transfer-encoding")
        if coding is not None and coding.lower() != "chunked":
            raise _Reject(400, "Unsupported Transfer-Encoding: only chunked is accepted.")
        length = headers.get("content-length")
        if length is not None and int(length) > self.max_body:  # llhttp checked the digits
            raise _Reject(413, f"Request body larger than {self.max_body} bytes.")
        self._expect = headers.get("expect", "").lower() == "100-continue"

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self.max_body:
            raise _Reject(413, f"Request body larger than {self.max_body} bytes.")
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser = self.parser
        keep = parser.should_keep_alive()
        target = self._url.decode("latin-1")
        body = b"".join(self._body)
        method = parser.get_method().decode("ascii")
        self.queue.append(
            Request(method, target, target.partition("?")[0], self._headers, body, keep)
        )
        self._in_message = self._expect = False
        self._cancel_timer()
        if not keep:
            self.stopped = True  # llhttp reads nothing after a closing request

    # ---- serving ------------------------------------------------------------------------------
    def _next(self) -> None:
        """With no handler running: serve the next queued item, or read on."""
        if self.queue:
            item = self.queue.popleft()
            if not isinstance(item, Request):
                self.queue.clear()
                self.must_close = True
                self.respond_error(*item)
                self._linger()
                return
            self.sent_head, self.must_close = False, not item.keep_alive
            self.task = self.loop.create_task(self._serve(item))
            return
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
            if self._in_message and not self.stopped:  # the deadline runs while we read
                self.timer = self.loop.call_later(self.request_timeout, self._timed_out)
        if self._expect and not self.stopped:
            self._expect = False
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

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
        self._next()

    def _fail(self, status: int, message: str) -> None:
        """Stop reading; answer status after the requests already queued, then close."""
        self.stopped = True
        self._in_message = self._in_head = self._expect = False
        self._cancel_timer()
        self.queue.append((status, message))

    def _timed_out(self) -> None:
        self.timer = None
        if self.closed or self.stopped or not self._in_message:
            return
        self._fail(408, f"Request not received in full within {self.request_timeout:g} s.")
        if self.task is None:
            self._next()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _linger(self) -> None:
        """Close after an error answer. Closing with unread client bytes would reset the
        connection and could destroy the answer: send FIN, drop what still comes, close soon."""
        transport = self.transport
        if self.paused:
            self.paused = False
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(LINGER, transport.close)
        else:
            transport.close()

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
