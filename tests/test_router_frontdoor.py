"""The router's front door over a real loopback socket, with a trivial handler: strict parsing
(every malformed case of issue 16 gets a JSON 4xx and a closed connection, none reaches the
handler), limits, deadlines, pipelining, 100-continue, and a property test on mutated input."""

from __future__ import annotations

import asyncio
import json
import socket

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.router.frontdoor import FrontDoor, Request
from kvmesh.router.listener import serve
from tests.helpers import loop_thread

MAX_BODY = 1000
TIMEOUT = 10.0  # generous socket timeout: a hang fails the test, never a slow machine
ERRORS = (400, 408, 413, 415, 431)


class Echo:
    """A trivial router: answers each request with what the front door handed it."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    async def handle(self, door: FrontDoor, req: Request) -> None:
        self.requests.append(req)
        if req.path == "/slow":
            await asyncio.sleep(0.1)
        if req.path == "/close":
            door.must_close = True
        seen = {"target": req.target, "method": req.method, "headers": req.headers}
        door.respond(200, json.dumps({**seen, "body": req.body.decode("latin-1")}).encode())

    async def stop(self) -> None:
        pass


@pytest.fixture(scope="module")
def door():
    echo = Echo()

    async def start():
        return await serve(echo, "127.0.0.1", 0, MAX_BODY, idle_timeout=0.5, request_timeout=0.3)

    async def stop(server) -> None:
        await server.cleanup()

    with loop_thread(start, stop) as (server, _):
        yield echo, server.server.sockets[0].getsockname()[1]


def talk(port: int, *parts: bytes) -> bytes:
    """Send parts (one write each); everything read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        for part in parts:
            sock.sendall(part)
        out = b""
        while data := sock.recv(65536):  # a timeout here raises: the server hung
            out += data
        return out


def responses(raw: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each HTTP/1.1 response in raw, parsed by llhttp."""
    found: list[tuple[int, bytes]] = []

    class Sink:
        body = b""

        def on_body(self, data: bytes) -> None:
            self.body += data

        def on_message_complete(self) -> None:
            found.append((parser.get_status_code(), self.body))
            self.body = b""

    parser = httptools.HttpResponseParser(Sink())
    parser.feed_data(raw)
    return found


def assert_error(answer: tuple[int, bytes], status: int | None = None) -> None:
    code, body = answer
    assert code in ERRORS and (status is None or code == status), answer
    error = json.loads(body)["error"]
    assert error["code"] == code and error["message"] and error["type"], body


def assert_responsive(port: int) -> None:
    out = responses(talk(port, b"GET /ping HTTP/1.1\r\nConnection: close\r\n\r\n"))
    assert [code for code, _ in out] == [200]


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
CHUNKED = HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
MALFORMED = {
    "negative chunk size": (CHUNKED + b"-6\r\n", 400),
    "chunk size zz": (CHUNKED + b"zz\r\nab\r\n0\r\n\r\n", 400),
    "chunk size 0x1e": (CHUNKED + b"0x1e\r\n" + b"a" * 30 + b"\r\n0\r\n\r\n", 400),
    "chunk size 1_e": (CHUNKED + b"1_e\r\n" + b"a" * 30 + b"\r\n0\r\n\r\n", 400),
    "bare LF in a header value": (
        HEAD + b"X-Request-Id: a\nx-kv-cache-source-host-port: 10.0.0.9:9\r\n\r\n",
        400,
    ),
    "LF in the target": (b"GET /v1/models\nX: y HTTP/1.1\r\n\r\n", 400),
    "NUL in a header value": (HEAD + b"X-A: a\x00b\r\n\r\n", 400),
    "Content-Length with Transfer-Encoding": (
        HEAD + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
    "obs-fold": (HEAD + b"X-A: a\r\n  folded\r\nContent-Length: 0\r\n\r\n", 400),
    "xchunked": (HEAD + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", 400),
    "gzip, chunked": (HEAD + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 400),
    "gzip body": (HEAD + b"Content-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}", 415),
    "negative Content-Length": (HEAD + b"Content-Length: -1\r\n\r\n", 400),
    "two Content-Length": (HEAD + b"Content-Length: 1\r\nContent-Length: 1\r\n\r\nx", 400),
    "two Host": (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    "Upgrade": (b"GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", 400),
    "CONNECT": (b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com\r\n\r\n", 400),
    "HTTP/2.0 request line": (b"GET / HTTP/2.0\r\n\r\n", 400),
    "nonsense": (b"NONSENSE\r\n\r\n", 400),
    "head over 64 KiB in one read": (HEAD + b"X-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
    "101 header lines": (HEAD + b"X-A: 1\r\n" * 101 + b"\r\n", 431),
    "declared body too large": (HEAD + b"Content-Length: 1001\r\n\r\n", 413),
    "chunked body too large": (CHUNKED + b"3e8\r\n" + b"a" * 1000 + b"\r\n1\r\na\r\n", 413),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_request_gets_json_error_and_close(door, case: str) -> None:
    echo, port = door
    raw, status = MALFORMED[case]
    before = len(echo.requests)
    out = responses(talk(port, raw))  # talk returns once the server closed
    assert len(out) == 1, out
    assert_error(out[0], status)
    assert len(echo.requests) == before  # nothing reached the handler
    assert_responsive(port)


def test_head_over_64_kib_across_reads_gets_431(door) -> None:
    _, port = door
    parts = [HEAD + b"X-Big: ", *[b"a" * 30_000] * 3, b"\r\n\r\n"]
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        out = b""
        for part in parts:
            try:
                sock.sendall(part)
            except OSError:  # the server answered and stopped reading
                break
        while data := sock.recv(65536):
            out += data
    (answer,) = responses(out)
    assert_error(answer, 431)


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\n",  # head never finished
        HEAD + b"Content-Length: 10\r\n\r\nabc",  # body never finished
    ],
)
def test_slow_client_gets_408(door, raw: bytes) -> None:
    _, port = door
    (answer,) = responses(talk(port, raw))
    assert_error(answer, 408)


def test_pipelined_requests_are_answered_in_order(door) -> None:
    echo, port = door
    raw = (
        b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
        + HEAD
        + b"Content-Length: 3\r\n\r\nabc"
        + CHUNKED
        + b"2\r\nde\r\n0\r\nX-Trailer: t\r\n\r\n"
        + b"GET /last?q=1 HTTP/1.1\r\nConnection: close\r\n\r\n"
    )
    out = responses(talk(port, raw))
    seen = [json.loads(body) for _, body in out]
    assert [code for code, _ in out] == [200] * 4
    assert [s["target"] for s in seen] == [
        "/slow",
        "/v1/completions",
        "/v1/completions",
        "/last?q=1",
    ]
    assert [s["body"] for s in seen] == ["", "abc", "de", ""]
    assert all("x-trailer" not in s["headers"] for s in seen)  # a trailer is never a header
    assert echo.requests[-1].path == "/last" and not echo.requests[-1].keep_alive


def test_error_after_pipelined_request_follows_its_answer(door) -> None:
    _, port = door
    out = responses(talk(port, b"GET /slow HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\nX-A: a\nb\r\n\r\n"))
    assert [code for code, _ in out] == [200, 400]
    assert_error(out[1], 400)


def test_expect_100_continue(door) -> None:
    echo, port = door
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(HEAD + b"Content-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        interim = b""
        while not interim.endswith(b"\r\n\r\n"):
            interim += sock.recv(1)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"hello")
        (answer,) = responses(sock.recv(65536))
    assert answer[0] == 200 and json.loads(answer[1])["body"] == "hello"
    assert echo.requests[-1].headers["expect"] == "100-continue"


def test_headers_reach_the_handler_lower_cased_and_joined(door) -> None:
    echo, port = door
    raw = b"GET /h HTTP/1.1\r\nX-A:  1 \r\nx-a: 2\r\nConnection: close\r\n\r\n"
    assert [code for code, _ in responses(talk(port, raw))] == [200]
    assert echo.requests[-1].headers["x-a"] == "1, 2"


def test_http10_keeps_alive_only_when_asked(door) -> None:
    _, port = door
    one = b"GET /a HTTP/1.0\r\n\r\n"
    assert [code for code, _ in responses(talk(port, one + one))] == [200]  # closed after one
    kept = b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    assert [code for code, _ in responses(talk(port, kept + one))] == [200, 200]


def test_handler_must_close_closes(door) -> None:
    _, port = door
    out = responses(talk(port, b"GET /close HTTP/1.1\r\n\r\nGET /a HTTP/1.1\r\n\r\n"))
    assert [code for code, _ in out] == [200]


# ---- property: mutated and random input --------------------------------------------------------
BASES = (
    HEAD + b'Content-Length: 13\r\nX-Request-Id: r1\r\n\r\n{"prompt": 1}',
    CHUNKED + b"4\r\nabcd\r\n0\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n",
    HEAD + b"X-Request-Id: a\nX-Injected: 1\r\nContent-Length: 0\r\n\r\n",
)
LAST = b"GET /last HTTP/1.1\r\nConnection: close\r\n\r\n"  # ends the connection when it parses
SPECIAL = b"\r\n\x00 \t:;-0fx\x7f\xff"


@st.composite
def mutated(draw) -> bytes:
    raw = bytearray(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(0, 3))):
        pos = draw(st.integers(0, len(raw) - 1))
        op = draw(st.sampled_from(("insert", "delete", "replace", "repeat")))
        byte = draw(st.sampled_from(SPECIAL) | st.integers(0, 255))
        if op == "insert":
            raw.insert(pos, byte)
        elif op == "delete":
            del raw[pos : pos + draw(st.integers(1, 8))]
        elif op == "replace":
            raw[pos] = byte
        else:
            raw[pos:pos] = raw[pos : pos + draw(st.integers(1, 40))]
        if not raw:
            raw = bytearray(b"\r\n")
    return bytes(raw)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.one_of(mutated(), st.binary(max_size=200)))
def test_any_input_gets_a_4xx_or_the_handlers_answer(door, raw: bytes) -> None:
    echo, port = door
    before = len(echo.requests)
    answers = responses(talk(port, raw + LAST))
    for i, answer in enumerate(answers):
        if answer[0] in (100, 200):
            continue
        assert_error(answer)
        assert i == len(answers) - 1  # talk() saw the close: nothing after an error
    sent = (raw + LAST).lower()
    for req in echo.requests[before:]:
        for name, value in req.headers.items():
            assert not any(c in value for c in "\r\n\x00"), (name, value)
            assert b"\r\n" + name.encode("latin-1") + b":" in sent  # a CRLF-started line
        assert not any(c in req.target for c in "\r\n\x00 ")
    assert_responsive(port)


def reference_headers(pairs: list[tuple[bytes, bytes]]) -> dict[str, str] | str:
    """A header at a time: lower-case names, trailing blanks off, repeats joined, a second
    Content-Length or Host an error."""
    out: dict[str, str] = {}
    for name, value in pairs:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1").rstrip(" \t")
        if key in out and key in ("content-length", "host"):
            return f"More than one {key} header."
        out[key] = f"{out[key]}, {text}" if key in out else text
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([b"X-A", b"x-a", b"Host", b"Accept", b"X-\xe9", b"Content-Length"]),
            st.binary(max_size=6).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
        ),
        max_size=8,
    )
)
def test_a_head_decodes_as_one_header_at_a_time_would(pairs) -> None:
    """request_reader._decoded (two joined strings) against a loop over the headers."""
    from kvmesh.router.request_reader import _decoded, _Reject

    raw = [part for pair in pairs for part in pair]
    want = reference_headers(pairs)
    try:
        got = _decoded(raw, len(pairs))
    except _Reject as exc:
        got = exc.message
    assert got == want
