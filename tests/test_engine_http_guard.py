"""The engine's HTTP connections (engine.http_guard) over raw sockets: a request head or body that
never completes gets 408 (with a tiny deadline here), unsupported versions and codings get clear
OpenAI-style errors, parse failures never quote the request (a credential included), and
`100 Continue` is sent only once the key is checked. A small app stands in for the engine's
routes; its credential check is the engine's own."""

from __future__ import annotations

import json
import logging
import socket

import pytest
from aiohttp import web

from kvmesh.engine.auth import EngineKeys, auth_middleware, expect_gate
from kvmesh.engine.http_guard import GuardedRunner
from kvmesh.engine.server import error_middleware
from tests.helpers import loop_thread

KEY = "sk-guard-test-0123456789"
SECRET = "sk-SECRET-do-not-echo-4242"
DEADLINE = 0.3  # seconds: the read deadline of the stand-in server
POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
AUTHORIZED = POST + f"Authorization: Bearer {KEY}\r\n".encode()


async def echo(request: web.Request) -> web.Response:
    return web.json_response({"echo": json.loads(await request.read())})


async def health(request: web.Request) -> web.Response:
    return web.Response()


@pytest.fixture(scope="module")
def port():
    async def start() -> GuardedRunner:
        keys = EngineKeys(api=KEY)
        app = web.Application(middlewares=[error_middleware, auth_middleware(keys)])
        app.router.add_post("/v1/completions", echo)
        app.router.add_get("/health", health)
        runner = GuardedRunner(app, gate=expect_gate(keys), request_timeout=DEADLINE)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    async def stop(runner: GuardedRunner) -> None:
        await runner.cleanup()

    with loop_thread(start, stop) as (runner, _):
        yield runner.addresses[0][1]


def exchange(port: int, *parts: bytes, answers: int = 0) -> bytes:
    """Send parts; read until the server closes (or, given ``answers``, until as many bodies
    of the stand-in's echo came back)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for part in parts:
            sock.sendall(part)
        out = b""
        while (not answers or out.count(b"}}") < answers) and (data := sock.recv(65536)):
            out += data
        return out


def error_of(answer: bytes, status: int) -> str:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == str(status).encode(), answer[:300]
    err = json.loads(body)["error"]
    assert err["code"] == status and err["type"] and err["message"]
    return err["message"]


@pytest.mark.parametrize(
    "partial",
    [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le", b"GET /heal"],
    ids=["half a head", "half a request line"],
)
def test_a_head_that_never_completes_gets_408(port, partial):
    message = error_of(exchange(port, partial), 408)
    assert f"within {DEADLINE:g} s" in message


def test_a_body_that_never_completes_gets_408(port):
    answer = exchange(port, AUTHORIZED + b'Content-Length: 100\r\n\r\n{"prompt":')
    assert "within" in error_of(answer, 408)


def test_a_request_in_full_is_served_and_the_connection_kept(port):
    body = b'{"prompt": "hi"}'
    request = AUTHORIZED + b"Content-Length: %d\r\n\r\n" % len(body) + body
    answer = exchange(port, request, request, answers=2)
    assert answer.count(b"HTTP/1.1 200 OK") == 2


@pytest.mark.parametrize(
    "raw,status",
    [
        (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"GET /health HTTP/0.9\r\n\r\n", 505),
        (b"GET /health\r\n", 505),  # HTTP/0.9: no version, no headers
        (AUTHORIZED + b"Content-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}", 415),
        (AUTHORIZED + b"Content-Encoding: br\r\nContent-Length: 2\r\n\r\n{}", 415),
        (AUTHORIZED + b"Transfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 400),
        (AUTHORIZED + b"Expect: teapot\r\nContent-Length: 2\r\n\r\n{}", 417),
        (POST + b"X-A: a\x00b\r\n\r\n", 400),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64)), 400),
    ],
    ids=["HTTP/2.0", "HTTP/0.9", "bare 0.9", "gzip", "br", "gzip,chunked", "expect", "NUL", "TLS"],
)
def test_unsupported_requests_get_an_openai_error_and_close(port, raw, status):
    error_of(exchange(port, raw), status)


@pytest.mark.parametrize(
    "line,status",
    [
        (f"Authorization: Bearer {SECRET}\x01x".encode(), 400),
        (f"Authorization: Bearer {SECRET}{'z' * 9000}".encode(), 431),
        (f"X-Note: {SECRET}\x7f".encode(), 400),
    ],
    ids=["control char", "too long", "other header"],
)
def test_a_malformed_header_line_is_never_quoted(port, caplog, line, status):
    caplog.set_level(logging.DEBUG)
    answer = exchange(port, POST + line + b"\r\nContent-Length: 2\r\n\r\n{}")
    message = error_of(answer, status)
    assert SECRET not in answer.decode("latin-1") and "\\x01" not in message
    assert caplog.records and not [r for r in caplog.records if SECRET in r.getMessage()]
    assert not [r for r in caplog.records if r.exc_info and SECRET in str(r.exc_info[1])]


def test_100_continue_only_after_the_key_is_checked(port):
    wait = b"Content-Length: 2\r\nExpect: 100-continue\r\n\r\n"
    refused = exchange(port, POST + b"Authorization: Bearer wrong\r\n" + wait)
    assert b"100 Continue" not in refused
    error_of(refused, 401)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(AUTHORIZED + wait)
        assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"{}")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")
