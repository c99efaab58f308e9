"""Graceful drain: on SIGTERM `kvmesh router` refuses new requests (an OpenAI-shaped 503) while a
stream already running finishes, on its own port and behind Envoy as the endpoint picker, then
exits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.client import HTTPConnection

import pytest

from tests.conftest import emulated_fleet
from tests.helpers import http

STREAM = {"prompt": "Tell me a story", "max_tokens": 60, "stream": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tokenizer) -> Iterator[str]:
    """One emulated engine answering a token every 50 ms: a 60-token stream lasts 3 s."""
    with emulated_fleet(tokenizer, 1, emulate_ttft_ms=5.0, emulate_itl_ms=50.0) as (urls, _):
        yield urls[0]


@contextlib.contextmanager
def router(engine: str, *flags: str) -> Iterator[tuple[subprocess.Popen, str, int | None]]:
    """`kvmesh router` on free ports: yields the process, its URL and its ext_proc port."""
    cmd = [sys.executable, "-m", "kvmesh.cli", "--log-level", "WARNING", "router", "--port", "0"]
    cmd += ["--endpoint", engine, "--preset", "round-robin", "--kv-events-config", "none"]
    cmd += ["--no-engine-model-check", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        while "ready" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "router exited before it was ready"
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)[1]
        ext = re.search(r"ext_proc grpc://127\.0\.0\.1:(\d+)", line)
        yield proc, url, int(ext[1]) if ext else None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=15)


class Stream:
    """A streaming completion read on a thread: ``started`` once its first event came,
    ``chunks`` the data events, ``done`` once it ended."""

    def __init__(self, url: str) -> None:
        self.chunks: list[bytes] = []
        self.status = 0
        self.started, self.done = threading.Event(), threading.Event()
        host, port = url.removeprefix("http://").split(":")
        self.connection = HTTPConnection(host, int(port), timeout=30)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            body = json.dumps(STREAM)
            self.connection.request(
                "POST", "/v1/completions", body, {"content-type": "application/json"}
            )
            answer = self.connection.getresponse()
            self.status = answer.status
            for line in answer:
                if line.startswith(b"data: "):
                    self.chunks.append(line.strip())
                    self.started.set()
        except OSError:
            pass
        finally:
            self.started.set()
            self.done.set()


def refused_with_503(url: str) -> bool:
    """A new request after SIGTERM: an OpenAI-shaped 503, or no connection at all."""
    try:
        code, _, raw = http(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    except OSError:
        return True
    error = json.loads(raw)["error"]
    return code == 503 and error["code"] == 503 and error["type"] == "ServiceUnavailableError"


def drains(proc: subprocess.Popen, stream: Stream, url: str, during=None) -> None:
    """SIGTERM once the stream runs: new requests are refused (``during()`` checks more then),
    the stream ends whole, the router exits 0."""
    assert stream.started.wait(30) and stream.status == 200
    proc.send_signal(signal.SIGTERM)
    line = "-"
    while "draining" not in line:  # said once new requests are refused
        line = proc.stdout.readline()
        assert line, "the router exited without draining"
    assert refused_with_503(url)
    if during is not None:
        during()
    assert not stream.done.is_set()  # the stream outlived the signal...
    assert stream.done.wait(30)
    assert stream.chunks[-1] == b"data: [DONE]"  # ...and ended whole
    assert len(stream.chunks) == STREAM["max_tokens"] + 1
    assert proc.wait(timeout=15) == 0


def test_a_stream_through_the_router_finishes_after_sigterm(engine: str) -> None:
    with router(engine, "--shutdown-timeout", "30") as (proc, url, _):
        drains(proc, Stream(url), url)


def test_a_stream_through_envoy_finishes_when_the_picker_drains(engine: str) -> None:
    """Envoy streaming the answer's body through the picker (FULL_DUPLEX_STREAMED both ways,
    as the Inference Extension's gateways do) holds the ext_proc stream for the whole answer:
    the picker keeps serving it until the answer ends, and answers new streams 503."""
    from tests.test_ext_proc import envoy

    flags = ("--shutdown-timeout", "30", "--ext-proc-port", "0")
    with (
        router(engine, *flags) as (proc, _, ext_port),
        envoy(ext_port, "full-duplex-streamed", stream_responses=True) as url,
    ):
        drains(proc, Stream(url), url, during=lambda: not_ready(ext_port))


def not_ready(ext_port: int) -> None:
    """While draining, gRPC health says the picker is alive but not ready."""
    from kvmesh.router.ext_proc_health import NOT_SERVING, SERVING
    from tests.test_ext_proc_gateway import health

    assert asyncio.run(health(ext_port, "readiness")) == NOT_SERVING
    assert asyncio.run(health(ext_port, "liveness")) == SERVING


def test_shutdown_timeout_zero_stops_at_once(engine: str) -> None:
    with router(engine, "--shutdown-timeout", "0") as (proc, url, _):
        stream = Stream(url)
        assert stream.started.wait(30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert stream.done.wait(30)
        assert b"data: [DONE]" not in stream.chunks  # cut
