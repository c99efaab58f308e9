"""The router's /metrics reader: one keep-alive connection per server, answers framed by
Content-Length or chunks, and every failure a PageError (which marks the endpoint unreachable)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from kvmesh.router import page_reader
from kvmesh.router.page_reader import PageError, PageReader
from tests.helpers import free_port

PAGE = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3.0\n" * 50


async def serve(routes: web.RouteTableDef):
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_pages_by_length_and_by_chunks_on_one_kept_connection():
    routes, peers = web.RouteTableDef(), []

    @routes.get("/metrics")
    async def metrics(request: web.Request):
        peers.append(request.transport.get_extra_info("peername"))
        return web.Response(text=PAGE)

    @routes.get("/chunked")
    async def chunked(request: web.Request):
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for part in (PAGE[:100], PAGE[100:1000], PAGE[1000:]):
            await resp.write(part.encode())
        await resp.write_eof()
        return resp

    runner, url = await serve(routes)
    reader = PageReader()
    try:
        for _ in range(5):
            assert await reader.read(url + "/metrics", 2.0) == PAGE
        assert await reader.read(url + "/chunked", 2.0) == PAGE
        assert len(set(peers)) == 1  # every read on the same connection
    finally:
        reader.close()
        await runner.cleanup()


async def test_every_failure_is_a_page_error(monkeypatch):
    routes = web.RouteTableDef()

    @routes.get("/busy")
    async def busy(request: web.Request):
        return web.Response(status=503, text="no")

    @routes.get("/slow")
    async def slow(request: web.Request):
        await asyncio.sleep(1)
        return web.Response(text=PAGE)

    @routes.get("/metrics")
    async def metrics(request: web.Request):
        return web.Response(text=PAGE)

    runner, url = await serve(routes)
    reader = PageReader()
    try:
        with pytest.raises(PageError, match="status 503"):
            await reader.read(url + "/busy", 2.0)
        with pytest.raises(PageError, match="no answer within"):
            await reader.read(url + "/slow", 0.2)
        monkeypatch.setattr(page_reader, "MAX_PAGE", 1000)
        with pytest.raises(PageError, match="larger than 1000"):
            await reader.read(url + "/metrics", 2.0)
        monkeypatch.undo()
        assert await reader.read(url + "/metrics", 2.0) == PAGE  # a fresh connection
        with pytest.raises(PageError):
            await reader.read(f"http://127.0.0.1:{free_port()}/metrics", 2.0)  # refused
    finally:
        reader.close()
        await runner.cleanup()


async def test_a_server_that_closes_after_each_answer_is_read_anew():
    routes = web.RouteTableDef()

    @routes.get("/metrics")
    async def metrics(request: web.Request):
        return web.Response(text=PAGE, headers={"Connection": "close"})

    runner, url = await serve(routes)
    reader = PageReader()
    try:
        for _ in range(3):
            assert await reader.read(url + "/metrics", 2.0) == PAGE
    finally:
        reader.close()
        await runner.cleanup()


async def test_a_page_that_ends_with_the_connection_is_read_whole():
    """An HTTP/1.0 exporter (prometheus_client's own server) sends no length: the body ends
    when the server closes; a close before the head is in is a failure."""
    body = PAGE.encode()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if writer.get_extra_info("sockname")[1] == bad_port:
            writer.close()
            return
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + body[:500])
        await writer.drain()
        writer.write(body[500:])
        writer.close()

    good = await asyncio.start_server(answer, "127.0.0.1", 0)
    bad = await asyncio.start_server(answer, "127.0.0.1", 0)
    good_port = good.sockets[0].getsockname()[1]
    bad_port = bad.sockets[0].getsockname()[1]
    reader = PageReader()
    try:
        for _ in range(2):
            assert await reader.read(f"http://127.0.0.1:{good_port}/metrics", 2.0) == PAGE
        with pytest.raises(PageError, match="connection closed"):
            await reader.read(f"http://127.0.0.1:{bad_port}/metrics", 2.0)
    finally:
        reader.close()
        good.close()
        bad.close()
