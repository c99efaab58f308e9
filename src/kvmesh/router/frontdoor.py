"""The router's front door: a lean HTTP/1.1 server protocol on llhttp (httptools), strict.
Requests (Content-Length or chunked bodies, size-limited, Expect: 100-continue honoured) are
served one at a time per connection, in order: the handler answers at once, or takes the
request over on callbacks, or hands back a coroutine run as a task; what serves the request is
cancelled when the client goes. Malformed input gets an OpenAI-style 4xx and the connection
closes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import msgspec

from kvmesh.protocol.http_limits import REQUEST_READ_TIMEOUT_S
from kvmesh.protocol.openai import error_body
from kvmesh.router.proxy import nodelay
from kvmesh.router.request_reader import Request, RequestReader

if TYPE_CHECKING:
    from kvmesh.router.proxy import Upstream
    from kvmesh.router.state import Serving

logger = logging.getLogger(__name__)
LINGER = 2.0  # seconds an answered bad connection drops the client's bytes before closing
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 408: "Request Timeout", 413: "Payload Too Large",
            415: "Unsupported Media Type",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}  # fmt: skip


# a handler answers at once (None), or takes the request over on callbacks (None, having set
# the door's ``task``; it calls door.finish() once done), or returns the coroutine that serves it
Handler = Callable[["FrontDoor", Request], "Coroutine[Any, Any, None] | None"]
# before `100 Continue`: (status, message, extra header lines) to answer instead, or None; it is
# given the request's path and headers (lower-case names)
Gate = Callable[[str, dict[str, str]], "tuple[int, str, str] | None"]


class FrontDoor(RequestReader, asyncio.Protocol):
    """One client connection (the router's routes know it as router.state.Door). Invariants:
    at most one request is served at a time (``task``, None when none); ``queue`` holds the
    requests read in full behind it (reading pauses while one waits), and an error to answer,
    (status, message, extra header lines), is its last item; once ``stopped`` no byte is
    parsed again. The client's EOF closes the connection, which cancels ``task``."""

    def __init__(
        self,
        handler: Handler,
        max_body: int,
        doors: set[FrontDoor],
        request_timeout: float = REQUEST_READ_TIMEOUT_S,
        gate: Gate | None = None,
    ) -> None:
        self.handler, self.doors, self.gate = handler, doors, gate
        self.request_timeout = request_timeout
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: Serving | None = None
        self.upstream: Upstream | None = None  # paused while the client reads slowly
        self.sent_head = False  # the current answer's status line went out
        self.must_close = False
        self.closed = False
        self.seen = True  # data came since the last idle sweep
        self.paused = False  # reading paused by us: a read request waits behind the task
        RequestReader.__init__(self, max_body)

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
        self.feed(data)
        if self._in_message and self.timer is None and not self.stopped:
            self.timer = self.loop.call_later(self.request_timeout, self._timed_out)
        if self.task is None:
            self._next()
        if self.task is not None and self.queue and not self.stopped and not self.paused:
            self.paused = True  # pipelined: wait for the answer in progress
            self.transport.pause_reading()
            self._cancel_timer()

    # ---- serving ------------------------------------------------------------------------------
    def _next(self) -> None:
        """With no request in progress: serve the queued items (those answered at once, one
        after another), or read on."""
        while self.queue:
            item = self.queue.popleft()
            if not isinstance(item, Request):
                self.queue.clear()
                self.must_close = True
                self.respond_error(*item)
                self._linger()
                return
            self.sent_head, self.must_close = False, not item.keep_alive
            try:
                work = self.handler(self, item)
            except Exception:
                work = None
                if self.task is not None:  # taken over on callbacks, then failed: dropped
                    self.task.cancel()
                    self.task = self.upstream = None
                self._failed(item)
            if work is not None:
                self.go_on(work, item)
                return
            if self.task is not None:
                return  # taken over on callbacks
            if self.must_close:
                self.transport.close()
                return
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
            if self._in_message and not self.stopped:  # the deadline runs while we read
                self.timer = self.loop.call_later(self.request_timeout, self._timed_out)
        if self._expect and not self.stopped:
            self._expect = False
            path = self._url.decode("latin-1").partition("?")[0]
            refusal = self.gate(path, self._headers) if self.gate is not None else None
            if refusal is None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            else:  # never invite a body the request may not send
                self._fail(*refusal)
                self._next()

    def finish(self) -> None:
        """The request in progress is answered: on to the next."""
        self.task, self.upstream, self.seen = None, None, True
        if self.closed:
            return
        if self.must_close:
            self.transport.close()
            return
        self._next()

    def go_on(self, work: Coroutine[Any, Any, None], req: Request | None = None) -> None:
        """The request in progress goes on in a task running work."""
        task = self.task = self.loop.create_task(self._serve(work, req))
        task.add_done_callback(lambda _: work.close())  # cancelled before it ran: never run

    async def _serve(self, work: Coroutine[Any, Any, None], req: Request | None) -> None:
        try:
            await work
        except asyncio.CancelledError:
            self.task, self.upstream = None, None
            return
        except Exception:
            self._failed(req)
        self.finish()

    def _failed(self, req: Request | None) -> None:
        what = f" in {req.method} {req.path}" if req is not None else ""
        logger.exception("router error%s", what)
        if not self.sent_head:
            self.respond_error(500, "Internal router error.")
        else:
            self.must_close = True

    def _timed_out(self) -> None:
        self.timer = None
        if self.closed or self.stopped or not self._in_message:
            return
        self._fail(408, f"Request not received in full within {self.request_timeout:g} s.")
        if self.task is None:
            self._next()

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
