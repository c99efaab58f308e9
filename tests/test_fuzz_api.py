"""Bad input against the router and the engine behind it: a fixed corpus of the cases a security
review found (malformed HTTP, hostile JSON, request-supplied templates, huge prompts) and random
request bodies. Only 4xx for bad input, OpenAI-shaped error bodies, and both servers answering
/health after every case."""

from __future__ import annotations

import contextlib
import functools
import json
import socket
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.protocol.request_checks import MAX_CHAT_MESSAGES
from tests import test_router_e2e
from tests.helpers import http
from tests.test_router_e2e import stack

PATHS = ("/v1/completions", "/v1/chat/completions")
NESTED = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
LOOPS = "{% for i in range(8000) %}{% for j in range(8000) %}x{% endfor %}{% endfor %}"
HELLO = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
CHOOSE_OTHER = {"type": "function", "function": {"name": "delete_everything"}}

# (path, body): each must get a 4xx with an OpenAI error body from router and engine
BAD_BODIES: list[tuple[str, bytes]] = [
    ("/v1/completions", b"[" * 5000 + b"]" * 5000),
    ("/v1/completions", NESTED),
    ("/v1/completions", b"\xff\xfe not json"),
    ("/v1/completions", b"null"),
    ("/v1/completions", b"[]"),
    ("/v1/completions", b'"prompt"'),
    ("/v1/completions", b'{"prompt": 5}'),
    ("/v1/completions", b'{"prompt": [[-1]]}'),
    ("/v1/completions", b'{"prompt": [99999999]}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1e100}'),
    ("/v1/completions", b'{"prompt": "x", "n": 1000000}'),
    ("/v1/completions", b'{"prompt": "x", "logprobs": 1000}'),
    ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}'),
    ("/v1/completions", b'{"prompt": "x", "seed": 1180591620717411303424}'),
    ("/v1/completions", b'{"prompt": "x", "model": "no-such-model"}'),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": {"a": 1}}]}'),
    ("/v1/chat/completions", b'{"messages": "hi"}'),
    (
        "/v1/chat/completions",
        json.dumps({"messages": HELLO, "chat_template_kwargs": {"chat_template": LOOPS}}).encode(),
    ),
    ("/v1/chat/completions", json.dumps({"messages": HELLO, "chat_template": LOOPS}).encode()),
    # request ids that cannot go into a header or a log line
    *[
        ("/v1/completions", json.dumps({"prompt": "x", "request_id": rid}).encode())
        for rid in ("a\r\nX-Evil: 1", "a\x00b", "a\nb", "a\x1b[2J", "a\u2028b", "r" * 513)
    ],
    # nested past the 64 levels documented, in a field no schema reads
    *[
        ("/v1/completions", b'{"prompt": "x", "extra": ' + b"[" * n + b"]" * n + b"}")
        for n in (64, 100, 300)
    ],
    (
        "/v1/chat/completions",
        json.dumps({"messages": HELLO, "response_format": {"type": "x"}}).encode(),
    ),
    ("/v1/completions", json.dumps({"prompt": "x", "response_format": "json"}).encode()),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "kernel", "content": "hi"}]}).encode(),
    ),
    (
        "/v1/chat/completions",
        json.dumps({"messages": HELLO, "tools": [TOOL], "tool_choice": CHOOSE_OTHER}).encode(),
    ),
    ("/v1/chat/completions", json.dumps({"messages": HELLO, "tool_choice": "sometimes"}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": HELLO * (MAX_CHAT_MESSAGES + 1)}).encode()),
]

# raw requests the router's front door must refuse with a 4xx and a closed connection
BAD_HTTP: list[bytes] = [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n-6\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0x1e\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1_e\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\nx-kv-cache-source-host-port: "
    b"10.0.0.1:80\r\nContent-Length: 2\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-A: a\r\n folded\r\nContent-Length: 0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/comp\nletions HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64)),  # a TLS hello
]


# raw requests both servers answer with an OpenAI error body: (bytes, the engine's status)
POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
BODY = b'Content-Length: 15\r\n\r\n{"prompt": "x"}'
ANSWERED_HTTP: list[tuple[bytes, int]] = [
    (POST + b"Content-Encoding: gzip\r\n" + BODY, 415),
    (POST + b"Transfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 400),
    (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    (b"GET /health HTTP/0.9\r\n\r\n", 505),
    (POST + b"Authorization: Bearer sk-SECRET\x01\r\n" + BODY, 400),
    (POST + b"X-Request-Id: a\x01b\r\n" + BODY, 400),
    (POST + b"X-Request-Id: a\tb\r\n" + BODY, 400),
    (POST + "X-Request-Id: é\r\n".encode() + BODY, 400),
    (POST + b"X-Request-Id: " + b"r" * 513 + b"\r\n" + BODY, 400),
]


def answer_of(url: str, data: bytes) -> bytes:
    """The server's answer to data, read until it closes (the client does not half-close:
    aiohttp takes that for a client gone)."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(data.replace(b"\r\n", b"\r\nConnection: close\r\n", 1))
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


@pytest.mark.parametrize("data,status", ANSWERED_HTTP, ids=range(len(ANSWERED_HTTP)))
def test_unsupported_or_malformed_heads_get_openai_errors_from_both(fleet, data, status):
    for url in fleet:
        answer = answer_of(url, data)
        head, _, body = answer.partition(b"\r\n\r\n")
        code = int(head.split(b" ", 2)[1])
        assert code == status or (url == fleet[0] and 400 <= code < 500), answer[:300]
        assert_error_body(body, code)
        assert b"SECRET" not in answer
    assert_healthy(*fleet)


def test_a_non_ascii_request_id_comes_back_intact(fleet):
    for url in fleet:
        for path, body in (("/v1/completions", {"prompt": "x"}), (PATHS[1], {"messages": HELLO})):
            code, headers, raw = http(url + path, {**body, "max_tokens": 1, "request_id": "é-1"})
            assert code == 200, raw[:300]
            assert json.loads(raw)["id"].endswith("-é-1")
            assert "Ã" not in headers.get("X-Request-Id", "")


def raw_exchange(url: str, data: bytes, timeout: float = 30.0) -> bytes:
    """Everything the server sends back until it closes (or the timeout passes)."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def assert_error_body(raw: bytes, status: int) -> None:
    body = json.loads(raw)
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["code"] == status
    assert "Traceback" not in err["message"]


def assert_healthy(*urls: str) -> None:
    for url in urls:
        assert http(url + "/health")[0] == 200, f"{url} stopped answering"


CONTEXT = 1024  # tokens: see fleet


@pytest.fixture(scope="module")
def fleet(tokenizer):
    """A router in front of one emulated engine whose context is CONTEXT tokens, not the stack's
    32,768: a random chat body without max_tokens generates to the end of the context, which took
    ~3 s a body there (most of this module's time). Such bodies still take that default path."""
    with contextlib.ExitStack() as running:
        with pytest.MonkeyPatch.context() as mp:  # only while the stack builds its engines
            short = functools.partial(test_router_e2e.EngineConfig, max_model_len=CONTEXT)
            mp.setattr(test_router_e2e, "EngineConfig", short)
            started = stack(tokenizer, n=1, emulate_ttft_ms=1.0, emulate_itl_ms=0.1)
            url, router, *_ = running.enter_context(started)
        engine = router.config.endpoints[0]
        models = json.loads(http(engine + "/v1/models")[2])
        assert models["data"][0]["max_model_len"] == CONTEXT  # the short context took effect
        yield url, engine


def engine_url(fleet) -> str:
    return fleet[1]


@pytest.mark.parametrize("path,body", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_bodies_get_4xx_from_router_and_engine(fleet, path, body):
    for url in fleet:
        code, _, raw = http(url + path, body)
        assert 400 <= code < 500, (url, code, raw[:300])
        assert_error_body(raw, code)
        assert_healthy(*fleet)


@pytest.mark.parametrize("data", BAD_HTTP, ids=range(len(BAD_HTTP)))
def test_malformed_http_is_refused_and_the_connection_closed(fleet, data):
    router = fleet[0]
    answer = raw_exchange(router, data)
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert 400 <= status < 500, answer[:300]
    assert_error_body(body, status)
    assert b"x-kv-cache-source-host-port" not in answer
    assert_healthy(*fleet)
    engine = raw_exchange(engine_url(fleet), data)  # the engine refuses them too
    assert engine == b"" or engine.split(b" ", 2)[1].startswith(b"4"), engine[:300]
    assert_healthy(*fleet)


def test_a_huge_prompt_does_not_stall_health(fleet):
    """Tokenizing a multi-megabyte prompt happens off the event loop: /health answers while it
    runs, and the prompt gets its 400 (longer than the model's context)."""
    body = json.dumps({"prompt": "lorem ipsum dolor sit amet " * 150_000, "max_tokens": 1})
    for url in fleet:
        with ThreadPoolExecutor(1) as pool:
            big = pool.submit(http, url + "/v1/completions", body.encode())
            health = [http(u + "/health")[0] for u in fleet for _ in range(3)]
            code, _, raw = big.result()
        assert health == [200] * len(health)
        assert code == 400, raw[:300]
        assert_error_body(raw, 400)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = (
    "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stream",
    "stream_options", "logprobs", "top_logprobs", "seed", "model", "min_tokens", "priority",
    "cache_salt", "response_format", "tools", "kv_transfer_params", "chat_template_kwargs",
)  # fmt: skip
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]), "content": JSON}
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(PATHS),
    body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6),
    messages=st.lists(MESSAGE, max_size=3),
)
def test_random_bodies_never_get_a_5xx(fleet, path, body, messages):
    if path.endswith("chat/completions"):
        body.setdefault("messages", messages)
    else:
        body.setdefault("prompt", "hello")
    if isinstance(body.get("max_tokens"), int):  # keep accepted requests short
        body["max_tokens"] = min(body["max_tokens"], 8)
    body.pop("n", None) if isinstance(body.get("n"), int) and body["n"] > 4 else None
    for url in fleet:
        code, _, raw = http(url + path, json.dumps(body).encode())
        assert code < 500, (url, code, raw[:300])
        if code >= 400:
            assert_error_body(raw, code)
