"""The router's HTTP/1.1 wire against scripted engines: bytes pass through unchanged, failures
before the first byte go elsewhere, a client that leaves cancels its upstream, stale keep-alive
connections are replaced, and the front door enforces limits and answers errors in JSON."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest

from kvmesh.router.app import Router, RouterConfig, start_router
from kvmesh.router.chunked import ChunkTracker

CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: keep-alive\r\nX-Engine: e\r\n\r\n"
    b"7;ext=1\r\ndata: 1\r\n2\r\n\n\n\r\n5\r\nxyz\r\n\r\n0\r\nTrailer: t\r\n\r\n"
)


class Engine:
    """A scripted engine: answers /metrics with an empty page and inference requests per
    ``mode``; records the requests it got and when a client connection closed."""

    def __init__(self, mode: str = "ok", close_idle: bool = False) -> None:
        self.mode, self.close_idle = mode, close_idle
        self.page = b""  # the /metrics page
        self.requests: list[tuple[bytes, dict[str, str], bytes]] = []
        self.lost = asyncio.Event()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> Engine:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                target = lines[0].split(" ")[1].encode()
                if target == b"/metrics":
                    page = self.page
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(page))
                    writer.write(page)
                    continue
                self.requests.append((target, headers, body))
                if not await self._answer(reader, writer, body):
                    return
                if self.close_idle:
                    await writer.drain()
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.lost.set()

    async def _answer(self, reader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        if self.mode == "hangup":
            writer.close()
            return False
        if self.mode == "503":
            writer.write(b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy")
        elif self.mode == "chunked":
            writer.write(CHUNKED)
        elif self.mode in ("slow", "break"):
            writer.write(CHUNKED.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n7\r\ndata: 1\r\n")
            await writer.drain()
            if self.mode == "break":
                writer.close()
                return False
            await asyncio.wait_for(reader.read(1), 30)  # returns when the router hangs up
            return False
        else:
            out = json.dumps({"echo": json.loads(body)}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(out), out))
        await writer.drain()
        return True


@contextlib.asynccontextmanager
async def routed(tokenizer, engines: list[Engine], preset: str = "round-robin", **config):
    for e in engines:
        await e.start()
    config.setdefault("engine_model_check", False)  # these fakes echo; they serve no model
    cfg = RouterConfig([e.url for e in engines], preset=preset, kv_events=None, **config)
    router = Router(cfg, tokenizer)
    server = await start_router(router, "127.0.0.1", 0)
    port = server.server.sockets[0].getsockname()[1]
    try:
        yield router, port
    finally:
        await server.cleanup()
        for e in engines:
            e.server.close()


async def exchange(port: int, raw: bytes, until: bytes | None = None) -> bytes:
    """Send raw bytes; read until the server closes or ``until`` ends what was read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    out = b""
    try:
        while not (until and out.endswith(until)):
            data = await asyncio.wait_for(reader.read(65536), 10)
            if not data:
                break
            out += data
    finally:
        writer.close()
    return out


def post(path: str, body: dict, extra: str = "", close: bool = True) -> bytes:
    data = json.dumps(body).encode()
    conn = "Connection: close\r\n" if close else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: r\r\nContent-Length: {len(data)}\r\n{extra}{conn}\r\n"
    ).encode() + data


def test_chunk_tracker_finds_the_end_across_any_split() -> None:
    body = CHUNKED.split(b"\r\n\r\n", 1)[1]
    for step in (1, 2, 5, len(body)):
        chunks, ends = ChunkTracker(), []
        for i in range(0, len(body), step):
            end = chunks.feed(body[i : i + step])
            if end >= 0:
                ends.append(i + end)
        assert ends == [len(body)], step
    half = ChunkTracker()
    half.feed(b"7\r\ndata")
    assert not half.at_boundary
    half.feed(b": 1\r\n")
    assert half.at_boundary


async def test_chunked_answer_passes_through_byte_for_byte(tokenizer) -> None:
    async with routed(tokenizer, [Engine("chunked")]) as (router, port):
        raw = await exchange(port, post("/v1/completions", {"prompt": "hi", "stream": True}))
    head, body = raw.split(b"\r\n\r\n", 1)
    assert body == CHUNKED.split(b"\r\n\r\n", 1)[1]
    lines = head.lower().split(b"\r\n")
    assert b"x-engine: e" in lines and b"transfer-encoding: chunked" in lines
    assert b"connection: keep-alive" not in lines
    assert any(ln.startswith(b"x-kvmesh-endpoint: http://127.0.0.1:") for ln in lines)


async def test_failure_before_first_byte_goes_to_another_endpoint(tokenizer) -> None:
    for bad in ("hangup", "503"):
        engines = [Engine(bad), Engine("ok")]
        async with routed(tokenizer, engines) as (router, port):
            for i in range(4):
                raw = await exchange(port, post("/v1/completions", {"prompt": f"p{i}"}))
                assert raw.startswith(b"HTTP/1.1 200"), (bad, raw)
                assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["echo"]["prompt"] == f"p{i}"
            assert router.metrics.retries._value.get() >= 1
        assert len(engines[1].requests) == 4


async def test_all_endpoints_failing_is_a_json_503(tokenizer) -> None:
    async with routed(tokenizer, [Engine("503"), Engine("503")]) as (_, port):
        raw = await exchange(port, post("/v1/completions", {"prompt": "x"}))
    assert raw.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in raw
    assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 503


async def test_client_disconnect_cancels_the_upstream(tokenizer) -> None:
    engine = Engine("slow")
    async with routed(tokenizer, [engine]) as (router, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/v1/completions", {"prompt": "x", "stream": True}))
        assert b"data: 1" in await asyncio.wait_for(reader.readuntil(b"data: 1"), 10)
        writer.close()
        await asyncio.wait_for(engine.lost.wait(), 10)
        (e,) = router.pool.endpoints.values()
        assert e.in_flight == 0


async def test_stream_broken_mid_way_ends_with_an_error_event(tokenizer) -> None:
    async with routed(tokenizer, [Engine("break")]) as (router, port):
        raw = await exchange(port, post("/v1/completions", {"prompt": "x", "stream": True}))
    body = raw.split(b"\r\n\r\n", 1)[1]
    assert body.startswith(b"7\r\ndata: 1\r\n") and body.endswith(b"\r\n0\r\n\r\n")
    assert b"upstream stream broke" in body


async def test_stale_keep_alive_connection_is_replaced(tokenizer) -> None:
    engine = Engine("ok", close_idle=True)
    async with routed(tokenizer, [engine]) as (router, port):
        for i in range(3):
            raw = await exchange(port, post("/v1/completions", {"prompt": f"p{i}"}))
            assert raw.startswith(b"HTTP/1.1 200"), raw
            await asyncio.sleep(0.05)  # the engine's close reaches the router first
        (e,) = router.pool.endpoints.values()
        assert e.healthy and e.failures == 0 and len(engine.requests) == 3


async def test_headers_forwarded_and_keep_alive_pipelining(tokenizer) -> None:
    engine = Engine("ok")
    async with routed(tokenizer, [engine]) as (_, port):
        passed = "X-Session-Id: s-1\r\ntraceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f0-01\r\n"
        raw = post(
            "/v1/completions", {"prompt": "a"}, f"X-Request-Id: rid-7\r\n{passed}", close=False
        )
        raw += post("/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}]})
        out = await exchange(port, raw)
    assert out.count(b"HTTP/1.1 200") == 2
    assert out.index(b'"prompt": "a"') < out.index(b'"content": "b"')
    (t1, h1, _), (t2, h2, _) = engine.requests
    assert (t1, t2) == (b"/v1/completions", b"/v1/chat/completions")
    assert h1["x-request-id"] == "rid-7" and len(h2["x-request-id"]) == 32
    # session and trace context go on (a router replica or a tracing engine reads them)
    assert h1["x-session-id"] == "s-1" and h1["traceparent"].startswith("00-4bf92f")
    assert "x-session-id" not in h2 and h1["host"].startswith("127.0.0.1:")  # not the client's


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET /nowhere HTTP/1.1\r\nConnection: close\r\n\r\n", 404),
        (b"GET /v1/completions HTTP/1.1\r\nConnection: close\r\n\r\n", 405),
        (b"NONSENSE\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 999999\r\n\r\n", 413),
        (post("/v1/completions", {"prompt": 5}), 400),
        (b"POST /v1/completions HTTP/1.1\r\nConnection: close\r\n\r\n{bad", 400),
    ],
)
async def test_front_door_errors_are_openai_json(tokenizer, raw: bytes, status: int) -> None:
    async with routed(tokenizer, [Engine("ok")], max_body_bytes=1000) as (_, port):
        out = await exchange(port, raw)
    assert out.startswith(b"HTTP/1.1 %d" % status), out
    assert json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["code"] == status


async def test_expect_continue_and_chunked_request_body(tokenizer) -> None:
    engine = Engine("ok")
    async with routed(tokenizer, [engine]) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n"
            b"Expect: 100-continue\r\nConnection: close\r\n\r\n"
        )
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == (
            b"HTTP/1.1 100 Continue\r\n\r\n"
        )
        writer.write(b'5\r\n{"pro\r\nb\r\nmpt": "ch"}\r\n0\r\n\r\n')
        out = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert out.startswith(b"HTTP/1.1 200") and engine.requests[0][2] == b'{"prompt": "ch"}'


async def test_a_small_request_passes_a_large_prompt_being_tokenized(tokenizer) -> None:
    """A large prompt is tokenized on the tokenizer thread, which holds the tokenizer's caches;
    held there (a gate), the loop answers /health and a small request completes, its prompt
    encoded on the loop without the caches; once the thread is free, with them again."""
    async with routed(tokenizer, [Engine("ok")], preset="approx-prefix") as (router, port):
        tokens, seen = router.tokens, []
        cached, uncached = tokens.ids_and_keys, tokens.uncached_ids_and_keys
        entered, release = threading.Event(), threading.Event()

        def watched(real, how: str):
            def encode(prompt: str, special: bool, salt: str | None):
                seen.append((how, len(prompt) > 60_000, threading.current_thread().name))
                if len(prompt) > 60_000:
                    entered.set()
                    assert release.wait(30)
                return real(prompt, special, salt)

            return encode

        tokens.ids_and_keys = watched(cached, "cached")
        tokens.uncached_ids_and_keys = watched(uncached, "uncached")
        big = asyncio.create_task(
            exchange(port, post("/v1/completions", {"prompt": "w " * 40_000}))
        )
        try:
            assert await asyncio.to_thread(entered.wait, 30)
            health = await exchange(port, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
            small = asyncio.create_task(
                exchange(port, post("/v1/completions", {"prompt": "small one"}))
            )
            done, _ = await asyncio.wait({small, big}, timeout=30, return_when="FIRST_COMPLETED")
            assert done == {small}  # answered while the large prompt is still being tokenized
        finally:
            release.set()
        assert health.startswith(b"HTTP/1.1 200") and small.result().startswith(b"HTTP/1.1 200")
        assert (await big).startswith(b"HTTP/1.1 200")
        again = await exchange(port, post("/v1/completions", {"prompt": "small two"}))
        assert again.startswith(b"HTTP/1.1 200")
        loop_thread = threading.main_thread().name
        assert seen == [
            ("cached", True, seen[0][2]),
            ("uncached", False, loop_thread),  # the thread held the caches: none touched
            ("cached", False, loop_thread),  # the thread free: the caches again
        ]
        assert seen[0][2].startswith("kvmesh-tokenize")


async def test_idle_client_connections_are_closed(tokenizer) -> None:
    from kvmesh.router.listener import serve

    engine = await Engine("ok").start()
    cfg = RouterConfig([engine.url], preset="round-robin", kv_events=None, engine_model_check=False)
    router = Router(cfg, tokenizer)
    await router.start()
    server = await serve(router, "127.0.0.1", 0, 1000, idle_timeout=0.1)
    port = server.server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/v1/completions", {"prompt": "x"}, close=False))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200") and b"Connection: close" not in head
        idle, _ = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(idle.read(), 10) == b""  # never sent a byte: closed
        await asyncio.wait_for(reader.read(), 10)  # the answered one too, once idle
        assert reader.at_eof()
        writer.close()
    finally:
        await server.cleanup()
        engine.server.close()
