"""The engine's HTTP connections, held to the router's front-door rules (router.frontdoor):
aiohttp's request handler, with

- a read deadline: a request's head and body arrive in full within ``request_timeout`` seconds
  of its first byte, else 408 (a body still missing fails the handler's read instead);
- HTTP/1.0 and 1.1 only: an HTTP/0.9 or HTTP/2.0 request line gets 505 at once;
- no content coding on a body (415: aiohttp would inflate it, unbounded) and no transfer coding
  but chunked (400);
- parse failures answered with OpenAI error bodies, in words that never quote the request (a
  malformed header line may hold a credential), and logged in the same words;
- a gate (the credential check) before aiohttp answers ``Expect: 100-continue``, so no client
  without the key is invited to send its body.

Invariant: the deadline runs from the first byte read while no message is in progress until the
body of the last message parsed is in; parsed messages wait in aiohttp's queue as before. (The
start of a message read together with the end of the one before is bounded by the idle
timeout instead.)
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.streams import StreamReader
from aiohttp.web_log import AccessLogger
from aiohttp.web_protocol import RequestHandler

from kvmesh.protocol.http_limits import (
    COMPRESSED_BODY,
    HEAD_TOO_LARGE,
    IDLE_TIMEOUT_S,
    MAX_HEADER_LINES,
    REQUEST_READ_TIMEOUT_S,
    UNSUPPORTED_TRANSFER_CODING,
)
from kvmesh.protocol.openai import APIError, encode_json, error_body

logger = logging.getLogger(__name__)
Gate = Callable[[web.BaseRequest], "web.StreamResponse | None"]
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
# aiohttp words an llhttp failure "<llhttp's reason>:\n\n  <the bytes>": only the reason is kept
_LLHTTP_REASON = re.compile(r"(?:Bad status line:\s*)?([A-Za-z][A-Za-z ,/'-]{0,80}):\n\n")
_REQUEST_LINE = re.compile(rb"[A-Z]+ [^ ]+(?: HTTP/(\d\.\d))?")
_SUPPORTED = ((1, 1), (1, 0))


class RequestReadTimeout(APIError, TimeoutError):
    """A body that did not arrive in time: the handler's read fails with this 408 (a
    TimeoutError, so aiohttp's lingering read of the rest stops on it too)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(not_received(seconds), 408)


def not_received(seconds: float) -> str:
    return f"Request not received in full within {seconds:g} s."


def error_response(status: int, message: str, headers: Any = None) -> web.Response:
    body = encode_json(error_body(message, status))
    return web.Response(body=body, status=status, content_type="application/json", headers=headers)


def parse_failure(exc: BaseException | None) -> tuple[int, str]:
    """The status and words for a request aiohttp could not parse; never the request's bytes."""
    if isinstance(exc, LineTooLong):
        return 431, HEAD_TOO_LARGE
    message = exc.message if isinstance(exc, BadHttpMessage) else ""
    if not isinstance(message, str):
        message = ""
    if message.startswith("Too many headers"):
        return 431, HEAD_TOO_LARGE
    found = _LLHTTP_REASON.match(message)
    reason = found.group(1) if found else "invalid request line or header"
    return 400, f"Malformed HTTP request: {reason}."


def head_problem(request: web.BaseRequest) -> tuple[int, str] | None:
    """What a parsed head breaks of the rules above (status, words), if anything."""
    version = request.version
    if (version.major, version.minor) not in _SUPPORTED:
        return 505, f"HTTP/{version.major}.{version.minor} is not supported: use HTTP/1.1."
    headers = request.headers
    if "Transfer-Encoding" in headers:
        coding = ",".join(headers.getall("Transfer-Encoding")).replace(" ", "").lower()
        if coding != "chunked":
            return 400, UNSUPPORTED_TRANSFER_CODING
    if "Content-Encoding" in headers:
        codings = ",".join(headers.getall("Content-Encoding")).lower().split(",")
        if {c.strip() for c in codings} - {"identity", ""}:
            return 415, COMPRESSED_BODY
    expect = headers.get("Expect")
    if expect is not None and expect.strip().lower() != "100-continue":
        return 417, "Only `Expect: 100-continue` is understood."
    return None


def guarded(handle: Handler, gate: Gate | None) -> Handler:
    """``handle`` behind the head rules and, for a request that waits for 100 Continue, the
    gate (aiohttp sends 100 Continue as ``handle`` starts)."""

    async def checked(request: web.BaseRequest) -> web.StreamResponse:
        problem = head_problem(request)
        if problem is not None:
            refusal: web.StreamResponse | None = error_response(*problem)
        elif gate is not None and "Expect" in request.headers:
            refusal = gate(request)
        else:
            refusal = None
        if refusal is None:
            return await handle(request)
        refusal.force_close()  # its body, if any, was never read
        return refusal

    return checked


class GuardedRequestHandler(RequestHandler):
    """One client connection (see the module's invariant)."""

    def __init__(self, manager: web.Server, *, request_timeout: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.request_timeout = request_timeout
        self.deadline: asyncio.TimerHandle | None = None
        self.body: StreamReader | None = None  # the body still arriving, once its head is in

    def data_received(self, data: bytes) -> None:
        if not data or self._force_close or self._close or self._upgraded:
            super().data_received(data)
            return
        if self.deadline is None:  # a message begins
            if self._refused_request_line(data):
                return
            self.deadline = self._loop.call_later(self.request_timeout, self._timed_out)
        count = self._request_count
        super().data_received(data)
        if self._request_count != count and self._messages:
            body = self.body = self._messages[-1][1]
            body.on_eof(lambda: self._received(body))

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status == 400:
            status, text = parse_failure(exc)
            logger.debug("refused a request from %s: %s", request.remote, text)
        else:
            text = HTTPStatus(status).phrase + "."
            self.log_exception("error handling a request from %s", request.remote, exc_info=exc)
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was under way; the error cannot be sent")
        resp = error_response(status, text)
        resp.force_close()
        return resp

    # ---- the deadline -------------------------------------------------------------------------
    def _received(self, body: StreamReader) -> None:
        if body is self.body:  # the last message parsed is in full
            self.body = None
            self._disarm()

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _timed_out(self) -> None:
        self.deadline = None
        if self.transport is None or self._force_close:
            return
        body, self.body = self.body, None
        if body is not None:  # the head is in: whoever reads the body gets the 408
            body.set_exception(RequestReadTimeout(self.request_timeout))
            self.close()
        else:
            self._answer_now(408, not_received(self.request_timeout))

    def _refused_request_line(self, data: bytes) -> bool:
        """At a message's first byte: refuse a complete request line of HTTP/0.9 (no version)
        or of a version other than 1.0 and 1.1, which aiohttp would otherwise serve."""
        start = len(data) - len(data.lstrip(b"\r\n"))
        end = data.find(b"\n", start, start + self.max_line_size)
        ended = end > start and data[end - 1] == 13  # by CRLF: a bare LF is left to the parser
        line = _REQUEST_LINE.fullmatch(data[start : end - 1]) if ended else None
        if line is None or line.group(1) in (b"1.1", b"1.0"):
            return False
        version = (line.group(1) or b"0.9").decode()
        self._answer_now(505, f"HTTP/{version} is not supported: use HTTP/1.1.")
        return True

    def _answer_now(self, status: int, message: str) -> None:
        """Answer a request that never reached a handler, and close. With an answer under way
        there is no room for this one: the connection closes once that answer is sent."""
        if self._request_in_progress or self._messages:
            self.close()
            return
        logger.debug("refused a request from %s: %s", self.peername, message)
        body = encode_json(error_body(message, status))
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        assert self.transport is not None
        self.transport.write(head.encode("ascii") + body)
        self.force_close()


class GuardedServer(web.Server):
    """aiohttp's server, serving each connection with a GuardedRequestHandler."""

    def __init__(self, base: web.Server, request_timeout: float, gate: Gate | None) -> None:
        super().__init__(
            guarded(base.request_handler, gate),
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
        )
        self.request_timeout = request_timeout
        self.loop = asyncio.get_running_loop()

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(
            self,
            loop=self.loop,
            request_timeout=self.request_timeout,
            keepalive_timeout=IDLE_TIMEOUT_S,
            max_headers=MAX_HEADER_LINES,
            auto_decompress=False,  # a compressed body gets 415 (head_problem)
            access_log=None,
            access_log_class=AccessLogger,
        )


class GuardedRunner(web.AppRunner):
    """An AppRunner whose connections follow the module's rules; handlers are cancelled when
    their client goes away. ``gate``: answers a request that may not send its body (None:
    it may)."""

    def __init__(
        self,
        app: web.Application,
        gate: Gate | None = None,
        request_timeout: float = REQUEST_READ_TIMEOUT_S,
    ) -> None:
        super().__init__(app, handler_cancellation=True, access_log=None)
        self.gate, self.request_timeout = gate, request_timeout

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()  # the app started and frozen
        return GuardedServer(base, self.request_timeout, self.gate)
