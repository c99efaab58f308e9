"""Requests read off a client connection by llhttp (httptools), strictly: a head within
MAX_HEAD bytes and MAX_HEADERS lines, a Content-Length or chunked body within the size limit,
no second Content-Length or Host, no upgrade; what breaks a rule is the error to answer."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass

import httptools

from kvmesh.protocol.http_limits import (
    COMPRESSED_BODY,
    HEAD_TOO_LARGE,
    MAX_HEADER_LINES,
    UNSUPPORTED_TRANSFER_CODING,
)
from kvmesh.router.proxy import MAX_HEAD

logger = logging.getLogger(__name__)
MAX_HEADERS = MAX_HEADER_LINES  # header (and trailer) lines per request
_MAX_RAW = 2 * MAX_HEADERS  # names and values
_UNIQUE = frozenset(("content-length", "host"))  # a second one is a smuggling attempt


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


class RequestReader:
    """The reading half of a front door (router.frontdoor). Invariants: ``queue`` holds the
    requests read in full, and an error to answer, (status, message, extra header lines), is its
    last item; once ``stopped`` no byte is parsed again. ``timer``: the deadline of the message
    in progress (the front door sets it), cancelled once the message is in or failed."""

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request | tuple[int, str, str]] = deque()
        self.stopped = False  # an error or the last request was read
        self.timer: asyncio.TimerHandle | None = None  # the deadline of the message in progress
        # the message in progress (on_message_begin resets it)
        self._in_message = self._in_head = self._expect = False
        self._url = b""
        self._headers: dict[str, str] = {}
        self._raw: list[bytes] = []  # the head's header names and values, in turn, as read
        self._body: list[bytes] = []
        self._body_size = self._head_size = self._head_reads = self._lines = 0

    def feed(self, data: bytes) -> None:
        """Parse data: requests read in full go to ``queue``, an error found to ``_fail``."""
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
            self._fail(431, HEAD_TOO_LARGE)

    # ---- httptools callbacks: they run inside feed_data ---------------------------------------
    def on_message_begin(self) -> None:
        self._in_message = self._in_head = True
        self._expect = False
        self._url, self._headers, self._body, self._raw = b"", {}, [], []
        self._body_size = self._head_size = self._head_reads = self._lines = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)
        if self._head_size > MAX_HEAD:
            raise _Reject(431, "Request target too long.")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:  # a chunked body's trailer: never a request header
            size = self._head_size = self._head_size + len(name) + len(value) + 4
            lines = self._lines = self._lines + 1
            if size > MAX_HEAD or lines > MAX_HEADERS:
                raise _Reject(431, HEAD_TOO_LARGE)
            return
        raw = self._raw  # names and values, in turn: decoded together once the head ends
        raw += (name, value)
        if len(raw) > _MAX_RAW:
            raise _Reject(431, HEAD_TOO_LARGE)

    def on_headers_complete(self) -> None:
        self._in_head = False
        raw, self._raw = self._raw, []
        n = self._lines = len(raw) // 2
        size = self._head_size = self._head_size + sum(map(len, raw)) + 4 * n
        if size > MAX_HEAD:
            raise _Reject(431, HEAD_TOO_LARGE)
        headers = self._headers = _decoded(raw, n)
        parser = self.parser
        if parser.should_upgrade():
            raise _Reject(400, "Protocol upgrades and CONNECT are not supported.")
        if parser.get_http_version() not in ("1.1", "1.0"):
            raise _Reject(400, "Unsupported HTTP version.")
        coding = headers.get("transfer-encoding")
        if coding is not None and coding.lower() != "chunked":
            raise _Reject(400, UNSUPPORTED_TRANSFER_CODING)
        coding = headers.get("content-encoding")
        if coding is not None and coding.strip().lower() not in ("identity", ""):
            raise _Reject(415, COMPRESSED_BODY)
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
        if self.timer is not None:
            self._cancel_timer()
        if not keep:
            self.stopped = True  # llhttp reads nothing after a closing request

    def _fail(self, status: int, message: str, extra: str = "") -> None:
        """Stop reading; answer status (with ``extra`` header lines) after the requests already
        queued, then close."""
        self.stopped = True
        self._in_message = self._in_head = self._expect = False
        self._cancel_timer()
        self.queue.append((status, message, extra))

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def _decoded(raw: list[bytes], n: int) -> dict[str, str]:
    """The ``n`` headers of ``raw`` (names and values in turn, as llhttp read them): names in
    lower case, values without the trailing blanks llhttp keeps (it skips the leading ones),
    a repeated header's values joined with ", ", a second Content-Length or Host refused.
    Decoded as two joined strings (a NUL is in no name, and a value with one is decoded alone):
    a head's headers cost a few C calls, not a Python loop each."""
    if not n:
        return {}
    names = b"\0".join(raw[0::2]).decode("latin-1").lower().split("\0")
    joined = b"\0".join(raw[1::2]).decode("latin-1")
    values = joined.split("\0")
    if len(values) != n:  # (a NUL inside a value)
        values = [v.decode("latin-1") for v in raw[1::2]]
    if " \0" in joined or "\t\0" in joined or joined.endswith((" ", "\t")):
        values = [v.rstrip(" \t") for v in values]
    headers = dict(zip(names, values, strict=True))
    if len(headers) == n:
        return headers
    headers = {}
    for key, text in zip(names, values, strict=True):
        known = headers.get(key)
        if known is None:
            headers[key] = text
        elif key in _UNIQUE:
            raise _Reject(400, f"More than one {key} header.")
        else:
            headers[key] = f"{known}, {text}"
    return headers
