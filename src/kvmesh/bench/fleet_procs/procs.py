"""Server processes of a benchmark: each started in its own session (so that it and every
process it starts share one process group, found, measured and stopped together), logging to a
file; their CPU time read from /proc; a start that waits for GET /health."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import aiohttp

from kvmesh.bench.fleet_procs.ports import free_port


def server_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A server's environment: the bench's as it is now, unbuffered output, no model downloads,
    then `extra`."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(extra or {})}


# the admin key (/admin/*, /reset_prefix_cache) of the engines this bench process starts:
# the caller's KVMESH_ADMIN_API_KEY, else a fresh one; it goes to the engines in their
# environment, never on a command line or in a log
ADMIN_KEY = os.environ.get("KVMESH_ADMIN_API_KEY") or secrets.token_urlsafe(16)


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


def group_members(pgids: set[int]) -> dict[int, float]:
    """Live (not zombie) processes whose process group is one of `pgids`, and their descendants
    (a child in a session of its own included): their CPU seconds (user + system, threads)."""
    tick, stats = os.sysconf("SC_CLK_TCK"), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z":  # state, ppid, pgid, ..., utime, stime
            stats[int(entry)] = (int(fields[1]), int(fields[2]), int(fields[11]) + int(fields[12]))
    found = {pid for pid, (_, pgid, _) in stats.items() if pgid in pgids}
    grown = True
    while grown:
        more = {pid for pid, (ppid, _, _) in stats.items() if ppid in found} - found
        found |= more
        grown = bool(more)
    return {pid: stats[pid][2] / tick for pid in found}


class Proc:
    """A server started in its own session (process group), logging to a file; `env` is added
    to the bench's environment."""

    def __init__(self, cmd: list[str], log: Path, env: Mapping[str, str] | None = None) -> None:
        self.cmd, self.log = cmd, log
        with open(log, "wb") as f:
            self.popen = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=server_env(env),
                start_new_session=True,
            )

    def tail(self, n: int = 2500) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def cpu_seconds(self) -> float:
        """utime + stime of every live process of this group and its descendants (threads
        included)."""
        return sum(group_members({self.popen.pid}).values())

    def kill(self) -> None:
        """SIGKILL to the process group, as a crash: no cleanup, no goodbye on any socket (and
        no process of the group left, the leader gone or not)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # leftovers of the group, if any


def stop_all(procs: Iterable[Proc]) -> None:
    """Stop every one of ``procs``: all are signalled first, so they shut down at once."""
    procs = list(procs)
    for p in procs:
        if p.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, signal.SIGTERM)
    for p in procs:
        p.stop()


def healthy(url: str, timeout: float = 2.0) -> bool:
    """Whether GET url/health answers 200 now."""
    with (
        contextlib.suppress(OSError),
        urllib.request.urlopen(url + "/health", timeout=timeout) as resp,
    ):
        return resp.status == 200
    return False


def wait_healthy(proc: Proc, url: str, timeout: float, poll: float = 0.2) -> bool:
    """Poll GET url/health until 200 (True); False once `proc` has exited or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.popen.poll() is None:
        if healthy(url):
            return True
        time.sleep(poll)
    return False


async def await_healthy(
    http: aiohttp.ClientSession, url: str, alive: Callable[[], bool], limit: float, poll: float
) -> bool:
    """Poll GET url/health until 200 (True); False once `alive()` is not or time runs out."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and alive():
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                if r.status == 200:
                    return True
        await asyncio.sleep(poll)
    return False


def start_healthy(
    command: Callable[[int], list[str]], log: Path, label: str, attempts: int = 3, port: int = 0
) -> tuple[Proc, str]:
    """Start `command(port)` until GET /health answers 200: (process, URL). On `port` when
    given (one attempt); else on a free port, and a process that exits before it is healthy is
    started again on another, as the port may have been taken between the pick and the bind."""
    proc: Proc | None = None
    chosen = port
    for _ in range(1 if chosen else attempts):
        port = chosen or free_port()
        proc = Proc(command(port), log)
        url = f"http://127.0.0.1:{port}"
        if wait_healthy(proc, url, 120):
            return proc, url
        if proc.popen.poll() is None:
            break  # alive but never healthy: not a port race
    assert proc is not None
    proc.stop()
    raise RuntimeError(f"{label} did not become healthy:\n{proc.tail()}")
