"""Emulated engines as processes: the `kvmesh serve --emulate` command line (N engines in one
process, on ports from a base or free ones, each with its KV events and replay ports), and its
start: the process, and the engines' URLs once it has printed them."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvmesh.bench.fleet_procs.ports import free_run
from kvmesh.bench.fleet_procs.procs import ADMIN_KEY, Proc, stop_all

URL_RE = re.compile(r"engine (http://[\w.\-]+:\d+)/v1")
# what the engines of a bench read from their environment: the admin key of /admin/* routes
ENGINE_ENV = {"KVMESH_ADMIN_API_KEY": ADMIN_KEY}
# engines that answer at once, for what a router adds to a request
ZERO_LATENCY = ("--emulate-ttft-ms", "0", "--emulate-itl-ms", "0", "--max-num-seqs", "256")


def events_config(port: int) -> dict:
    """An engine's KV events: published on `port`, replayed on `port + 1`."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{port + 1}",
    }


def serve_command(
    n: int, port: int = 0, flags: Sequence[str] = (), events_port: int | None = None
) -> list[str]:
    """`kvmesh serve --emulate n` on 127.0.0.1 from `port` (0: free ports), KV events from
    `events_port` when given (engine i on events_port + 2i), then `flags` (which win)."""
    cmd = [sys.executable, "-m", "kvmesh.cli", "--log-level", "WARNING", "serve"]
    cmd += ["--emulate", str(n), "--host", "127.0.0.1", "--port", str(port)]
    if events_port is not None:
        cmd += ["--kv-events-config", json.dumps(events_config(events_port))]
    return cmd + list(flags)


def wait_for_urls(procs: Sequence[Proc], counts: Sequence[int], timeout: float) -> list[str]:
    """The engines' URLs, in order, once each process has printed its `counts[i]` of them;
    every process stopped and RuntimeError when one exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        found = [URL_RE.findall(p.tail(100_000)) for p in procs]
        if all(len(urls) >= n for urls, n in zip(found, counts, strict=True)):
            return [u for urls, n in zip(found, counts, strict=True) for u in urls[:n]]
        dead = [p for p in procs if p.popen.poll() is not None]
        if dead or time.monotonic() > deadline:
            stop_all(procs)
            raise RuntimeError(f"emulated engines did not start:\n{(dead or procs)[0].tail()}")
        time.sleep(0.2)


def start_emulated(
    cmd: list[str], n: int, log: Path, timeout: float = 300, env: dict | None = None
) -> tuple[Proc, list[str]]:
    """`cmd` (a serve_command of n engines) started: the process and the engines' URLs."""
    proc = Proc(cmd, log, {**ENGINE_ENV, **(env or {})})
    return proc, wait_for_urls([proc], [n], timeout)


def zero_latency_engines(n: int, prefix: list[str], out: Path) -> tuple[Proc, list[str]]:
    """n engines that answer at once, in one process (after `prefix`, e.g. a taskset)."""
    cmd = [*prefix, *serve_command(n, flags=ZERO_LATENCY)]
    return start_emulated(cmd, n, out / f"engines-{n}.log", timeout=180)


def start_fleet_engines(
    args: argparse.Namespace, n: int, out: Path, extra: str = "", log: str = "engines.log"
) -> tuple[Proc, list[str]]:
    """n engines of the bench's --emulate-gpu, --emulate-model and --emulate-time-scale with
    its --serve-args and then `extra` (an engine variant's flags, which win where both set
    one), publishing KV events; `{engines}` in those flags is the engines' own host:port list
    (their ports are then fixed)."""
    serve_args = f"{args.serve_args} {extra}".strip()
    fixed = "{engines}" in serve_args  # the engines name each other: fix their ports
    base = free_run((3 if fixed else 2) * n)
    http_base = base + 2 * n if fixed else 0
    engines = ",".join(f"127.0.0.1:{http_base + i}" for i in range(n))
    flags = ["--emulate-gpu", args.emulate_gpu, "--emulate-model", args.emulate_model]
    flags += ["--emulate-time-scale", str(args.emulate_time_scale)]
    flags += serve_args.replace("{engines}", engines).split()
    cmd = serve_command(n, http_base, flags, events_port=base)
    return start_emulated(cmd, n, out / log, env={"KVMESH_DEV_MODE": "1"})
