"""One `kvmesh serve` per process with any flags (a real model, or an emulated one) on a given
port, waited for until GET /health answers: the engines of the engine, spec and tiers benches."""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from kvmesh.bench.fleet_procs.procs import Proc, stop_all, wait_healthy


class EngineProcess:
    """`kvmesh serve` as a subprocess (its output in log_path); the context yields its base URL
    once GET /health answers 200, and stops the process (SIGTERM, then SIGKILL) on exit."""

    def __init__(
        self, port: int, serve_args: list[str], log_path: Path, timeout_s: float = 600
    ) -> None:
        self.port, self.serve_args, self.log_path = port, serve_args, log_path
        self.timeout_s = timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.server: Proc | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.server.popen if self.server else None

    def start(self) -> EngineProcess:
        """Launch the process without waiting for it (`wait_healthy` waits)."""
        cmd = [sys.executable, "-m", "kvmesh.cli", "serve", "--host", "127.0.0.1"]
        self.server = Proc([*cmd, "--port", str(self.port), *self.serve_args], self.log_path)
        return self

    def wait_healthy(self) -> str:
        """The base URL, once GET /health answers 200; stops the process and raises if it
        exits or is not healthy within timeout_s."""
        assert self.server is not None, "start() first"
        popen = self.server.popen
        if wait_healthy(self.server, self.url, self.timeout_s, 0.25):
            return self.url
        if popen.poll() is not None:
            raise RuntimeError(
                f"`{shlex.join(self.server.cmd)}` exited with {popen.returncode}:\n"
                f"{self.log_tail()}"
            )
        self.__exit__()
        raise RuntimeError(f"engine not healthy after {self.timeout_s:.0f} s:\n{self.log_tail()}")

    def __enter__(self) -> str:
        return self.start().wait_healthy()

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.server.tail(100_000).splitlines()[-lines:]) if self.server else ""


@contextlib.contextmanager
def engine_processes(*engines: EngineProcess) -> Iterator[list[str]]:
    """Several `kvmesh serve` subprocesses: all started at once, so their start-ups (imports,
    model loading) overlap, then each waited for; yields their URLs in order and stops them
    all on exit (signalled at once), also when one fails to come up."""
    started: list[Proc] = []
    try:
        for e in engines:
            e.start()
            started.append(e.server)
        yield [e.wait_healthy() for e in engines]
    finally:
        stop_all(started)
