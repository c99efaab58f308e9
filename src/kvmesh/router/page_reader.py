"""How the router reads its endpoints' /metrics pages: a GET on a keep-alive connection per
server, the answer read by llhttp (httptools, strictly: framed by Content-Length, chunks or the
server's close, as an HTTP/1.0 exporter frames it; at most MAX_PAGE bytes). A general HTTP
client costs a scrape several times as much CPU, and a router scrapes every endpoint ten times
a second: with a fleet of a hundred engines that was most of a core spent reading gauges.

Not thread-safe: one event loop uses it.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from urllib.parse import urlsplit

import httptools

MAX_PAGE = 32 * 1024 * 1024  # bytes of one page (vLLM's is ~100 KB per engine core)


class PageError(OSError):
    """The page could not be read: connect, timeout, framing, status or size."""


class PageTimeout(PageError):
    """No answer within the time given: the server may be alive but too busy to answer."""


class _Reading(asyncio.Protocol):
    """One keep-alive connection; one GET at a time (``answer`` is its future)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[str] | None = None
        self.parts: list[bytes] = []
        self.size = 0
        self.reusable = False  # the last answer ended and the server keeps the connection
        self.closed = False
        self.headed = False  # the answer's head is in
        self.framed = False  # ... and says where its body ends (else: at the close)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.answer is not None and self.headed and not self.framed and exc is None:
            self.on_message_complete()  # a body that ends with the connection
        self._fail(f"connection closed: {exc or 'by the server'}")

    def data_received(self, data: bytes) -> None:
        if self.answer is None:  # unasked bytes: a confused server
            self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"malformed answer: {exc}")
            self.transport.abort()

    def on_message_begin(self) -> None:
        self.headed = self.framed = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headed = True

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > MAX_PAGE:
            self._fail(f"page larger than {MAX_PAGE} bytes")
            self.transport.abort()
        else:
            self.parts.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        self.reusable = not self.closed and self.parser.should_keep_alive()
        answer, self.answer = self.answer, None
        body, self.parts, self.size = b"".join(self.parts), [], 0
        if answer is None or answer.done():
            return
        if status != 200:
            answer.set_exception(PageError(f"status {status}"))
        else:
            answer.set_result(body.decode("utf-8", "replace"))

    def _fail(self, why: str) -> None:
        answer, self.answer = self.answer, None
        self.reusable = False
        if answer is not None and not answer.done():
            answer.set_exception(PageError(why))


class PageReader:
    """GETs of small text pages (/metrics), each server's connection kept between reads."""

    def __init__(self) -> None:
        self._idle: dict[str, list[_Reading]] = {}  # "scheme://host:port" -> idle connections
        self._ssl: _ssl.SSLContext | None = None

    async def read(self, url: str, timeout: float) -> str:
        """The body of a 200 answer to GET url, decoded as UTF-8; PageError otherwise."""
        u = urlsplit(url)
        secure = u.scheme == "https"
        port = u.port or (443 if secure else 80)
        key = f"{u.scheme}://{u.hostname}:{port}"
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        head = f"GET {target} HTTP/1.1\r\nHost: {u.netloc}\r\nAccept: text/plain\r\n\r\n"
        conn = self._take(key)
        try:
            async with asyncio.timeout(timeout):
                if conn is None:
                    conn = await self._connect(u.hostname or "127.0.0.1", port, secure)
                conn.answer = asyncio.get_running_loop().create_future()
                conn.reusable = False
                conn.transport.write(head.encode("latin-1"))
                page = await conn.answer
        except TimeoutError:
            self._drop(conn)
            raise PageTimeout(f"no answer within {timeout:g} s") from None
        except OSError as exc:
            self._drop(conn)
            raise exc if isinstance(exc, PageError) else PageError(str(exc)) from exc
        except BaseException:  # cancelled: the connection may be mid-answer
            self._drop(conn)
            raise
        if conn.reusable and not conn.closed:
            self._idle.setdefault(key, []).append(conn)
        else:
            conn.transport.close()
        return page

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.transport.close()
        self._idle.clear()

    def _take(self, key: str) -> _Reading | None:
        conns = self._idle.get(key)
        while conns:
            conn = conns.pop()
            if not conn.closed:
                return conn
        return None

    async def _connect(self, host: str, port: int, secure: bool) -> _Reading:
        if secure and self._ssl is None:
            self._ssl = _ssl.create_default_context()
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            _Reading, host, port, ssl=self._ssl if secure else None
        )
        return conn

    @staticmethod
    def _drop(conn: _Reading | None) -> None:
        if conn is not None:
            conn.answer = None
            if conn.transport is not None:
                conn.transport.abort()
