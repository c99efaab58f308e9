"""Small test utilities: free loopback ports, a plain HTTP client and a background event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports, below Linux's ephemeral range (32768 up), where
    no client connection of another test takes one between this pick and the bind."""
    while True:
        base = random.randrange(20000, 32000 - n)
        with contextlib.ExitStack() as stack:
            try:
                for p in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            except OSError:
                continue
        return base


def bound_port(server) -> int:
    """The port a router server (started on port 0) listens on: no pick-then-bind race."""
    return server.server.sockets[0].getsockname()[1]


def http(url: str, body: bytes | dict | None = None, headers: dict | None = None):
    """(status, headers, body bytes); POST when a body is given. Errors are answers too."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


@contextlib.contextmanager
def loop_thread(start: Callable[[], Awaitable[T]], stop: Callable[[T], Awaitable[None]]):
    """Runs `await start()` on a fresh event loop in a daemon thread and yields (its result,
    the loop); on exit runs `await stop(result)` on that loop, then stops the thread."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            state["value"] = loop.run_until_complete(start())
        finally:
            ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(60) and "value" in state, "the background loop did not start"
    try:
        yield state["value"], loop
    finally:
        asyncio.run_coroutine_threadsafe(stop(state["value"]), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def run_quick_bench(command: str, out, result_file: str, *flags: str) -> dict:
    """`kvmesh bench COMMAND --quick --out OUT [FLAGS]` in a subprocess; its JSON result."""
    cmd = [sys.executable, "-m", "kvmesh.cli", "bench", command, "--quick", "--out", str(out)]
    proc = subprocess.run(
        [*cmd, *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads((out / result_file).read_text())


def counter(metric, *labels) -> float:
    """A labelled counter's value: the router's lock-free LoopLabelledCounter, or a
    prometheus_client one."""
    if hasattr(metric, "counts"):  # router.metrics.LoopLabelledCounter
        return metric.counts.get(labels, 0.0)
    return metric.labels(*labels)._value.get()
