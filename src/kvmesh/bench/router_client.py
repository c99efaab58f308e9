"""A lean HTTP/1.1 client for router overhead: keep-alive sockets, TCP_NODELAY, an incremental
response parser (Content-Length or chunked), so the client adds microseconds, not the
milliseconds a full client library would add to what is being measured.

``Conn`` is blocking (one request at a time, for latency); ``closed_loop`` runs many
connections on one asyncio loop (for the sustained request rate). Times are perf_counter s.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlparse

from kvmesh.bench.http_load import WORDS

_CRLF = b"\r\n"


class Response:
    """Fed bytes as they arrive; knows when the headers, the first body byte and the end came."""

    __slots__ = ("buf", "status", "length", "chunked", "pos", "done", "body_seen", "close")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.status = 0
        self.length = -1
        self.chunked = False
        self.pos = -1  # start of the unparsed body; -1 until the headers are complete
        self.done = False
        self.body_seen = False
        self.close = False

    def feed(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if self.pos < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            self.status = int(lines[0].split(" ", 2)[1])
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name, value = name.strip().lower(), value.strip().lower()
                if name == "content-length":
                    self.length = int(value)
                elif name == "transfer-encoding" and "chunked" in value:
                    self.chunked = True
                elif name == "connection" and value == "close":
                    self.close = True
            self.pos = end + 4
        if len(buf) > self.pos:
            self.body_seen = True
        if self.chunked:
            self._chunks()
        elif self.length >= 0:
            self.done = len(buf) - self.pos >= self.length
        # neither: the body ends when the server closes (handled by the caller)

    def _chunks(self) -> None:
        buf, pos = self.buf, self.pos
        while True:
            eol = buf.find(_CRLF, pos)
            if eol < 0:
                break
            size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
            if size == 0:
                self.done = buf.find(b"\r\n\r\n", eol) >= 0  # no trailers: "0\r\n\r\n"
                break
            if len(buf) < eol + 2 + size + 2:
                break
            pos = eol + 2 + size + 2
        self.pos = pos

    def body(self) -> bytes:
        return bytes(self.buf[self.buf.find(b"\r\n\r\n") + 4 :])


def request_bytes(url: str, path: str, body: dict) -> bytes:
    u = urlparse(url)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


class Conn:
    """One keep-alive connection; reconnects when the server closed it."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        u = urlparse(url)
        self.addr = (u.hostname or "127.0.0.1", u.port or 80)
        self.timeout = timeout
        self.sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.addr, timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def send(self, raw: bytes) -> tuple[Response, float, float]:
        """(response, seconds to the first body byte, seconds to the end)."""
        for attempt in (0, 1):
            if self.sock is None:
                self.sock = self._connect()
            resp = Response()
            t0 = time.perf_counter()
            first = 0.0
            try:
                self.sock.sendall(raw)
                while not resp.done:
                    data = self.sock.recv(262144)
                    if not data:
                        if resp.pos >= 0 and not resp.chunked and resp.length < 0:
                            resp.done = True  # body delimited by close
                            break
                        raise ConnectionResetError("server closed the connection")
                    resp.feed(data)
                    if not first and resp.body_seen:
                        first = time.perf_counter() - t0
            except OSError:
                self.close()
                if attempt or resp.pos >= 0:
                    raise
                continue  # a stale keep-alive connection: retry once on a fresh one
            total = time.perf_counter() - t0
            if resp.close:
                self.close()
            return resp, first or total, total
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def prompt_text(kind: str, seed: int = 0) -> str:
    """'small': a few words; 'long': about 8,000 characters of common words."""
    rng = random.Random(seed)
    if kind == "small":
        return "Say hello to the router benchmark"
    words: list[str] = []
    size = 0
    while size < 8000:
        words.append(rng.choice(WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)


def completion_body(model: str | None, prompt: str, stream: bool = False) -> dict:
    body = {"prompt": prompt, "max_tokens": 4 if stream else 1, "temperature": 0}
    if stream:
        body["stream"] = True
    if model:
        body["model"] = model
    return body


# ---- closed loop (sustained rate) ----------------------------------------------------------


@dataclass
class LoopStats:
    ok: int = 0
    errors: int = 0
    counting: bool = False
    statuses: dict[int, int] = field(default_factory=dict)


class _Proto(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.resp = Response()
        self.waiter: asyncio.Future | None = None
        self.lost = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.resp.feed(data)
        if self.resp.done and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.resp)

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionResetError("connection lost"))


RequestMaker = Callable[[int, int], bytes]  # (connection k, its i-th request) -> raw request


def prompt_requests(url: str, model: str | None, text: str, repeated: int = 0) -> RequestMaker:
    """Requests of ``text`` with a tail: new on every request of every connection (as an
    agent's next turn: a known prefix, a new ending), or with ``repeated`` > 0 one of that many
    tails in turn (a labelled extra case: a router's whole-prompt caches answer repeats)."""

    def distinct(k: int, i: int) -> bytes:
        return request_bytes(url, "/v1/completions", completion_body(model, f"{text} #{k}.{i}"))

    if repeated <= 0:
        return distinct
    cycle = [
        request_bytes(url, "/v1/completions", completion_body(model, f"{text} #{i}"))
        for i in range(repeated)
    ]
    return lambda k, i: cycle[(k + i) % repeated]


async def _worker(
    url: str, k: int, make: RequestMaker, stats: LoopStats, stop: asyncio.Event
) -> None:
    loop = asyncio.get_running_loop()
    u = urlparse(url)
    proto: _Proto | None = None
    i = 0
    while not stop.is_set():
        if proto is None or proto.lost:
            _, proto = await loop.create_connection(_Proto, u.hostname, u.port)
        raw = make(k, i)
        proto.resp = Response()
        proto.waiter = loop.create_future()
        assert proto.transport is not None
        proto.transport.write(raw)
        i += 1
        try:
            resp = await asyncio.wait_for(proto.waiter, 30)
        except (ConnectionError, TimeoutError):
            proto.transport.close()
            proto = None
            if stats.counting:
                stats.errors += 1
            continue
        if stats.counting:
            stats.statuses[resp.status] = stats.statuses.get(resp.status, 0) + 1
            if resp.status == 200:
                stats.ok += 1
            else:
                stats.errors += 1
        if resp.close:
            proto.transport.close()
            proto = None
    if proto is not None and proto.transport is not None:
        proto.transport.close()


async def closed_loop(
    urls: list[str],
    makers: list[RequestMaker],
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    on_window: tuple,
) -> tuple[LoopStats, float]:
    """``concurrency`` connections (spread over ``urls``, the requests to urls[j] made by
    makers[j]) each send its next request when the last is answered. Counts the answers within
    the measured window; ``on_window`` = (start_callback, end_callback) run at the window's
    edges. Returns (stats, window seconds)."""
    stats, stop = LoopStats(), asyncio.Event()
    n = len(urls)
    tasks = [
        asyncio.create_task(_worker(urls[k % n], k, makers[k % n], stats, stop))
        for k in range(concurrency)
    ]
    await asyncio.sleep(warmup_s)
    on_window[0]()
    stats.counting, t0 = True, time.perf_counter()
    await asyncio.sleep(duration_s)
    stats.counting, wall = False, time.perf_counter() - t0
    on_window[1]()
    stop.set()
    done, pending = await asyncio.wait(tasks, timeout=35)
    for t in pending:
        t.cancel()
    for t in done:
        if t.exception() is not None and stats.ok == 0:
            raise t.exception()  # type: ignore[misc]
    return stats, wall
