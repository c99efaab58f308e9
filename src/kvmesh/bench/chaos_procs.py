"""The processes of `kvmesh bench chaos` and what watches them: the emulated engines (one
process each, on fixed ports, so that a killed one starts again where the router looks for it)
and the router, killed as a crash and started again with the same commands; the run's shared
state; health waits, the engines' fault switches, and the poller of the router's /metrics."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvmesh.bench.chaos_metrics import Sample, parse_router_metrics
from kvmesh.bench.chaos_report import Result
from kvmesh.bench.fleet_procs.engines import ENGINE_ENV, serve_command
from kvmesh.bench.fleet_procs.ports import port_block
from kvmesh.bench.fleet_procs.procs import Proc, admin_headers, await_healthy, stop_all
from kvmesh.bench.fleet_procs.routers import Target, router_command

POLL_S = 0.05  # the router's /metrics, and /health while waiting for a start


@contextlib.asynccontextmanager
async def client_sessions(args: argparse.Namespace):
    """(load, control): the load's HTTP session, its request timeout stretched by the engines'
    time scale, and a short-timeout one for health, faults and metrics."""
    k = args.emulate_time_scale
    async with (
        aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=args.request_timeout * k),
            connector=aiohttp.TCPConnector(limit=0),
        ) as http,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as ctl,
    ):
        yield http, ctl


def ports_needed(engines: int) -> int:
    """Ports from the base: engine i's KV events base+2i, its replay base+2i+1, its HTTP
    base+2n+i; the router's HTTP base+3n."""
    return 3 * engines + 1


class Fleet:
    """The engines (one process each, fixed ports) and the router, killed and started again
    with the same commands; every start logs to its own file."""

    def __init__(self, args: argparse.Namespace, out: Path, rflags: list[str]) -> None:
        n, self.out = args.engines, out
        base = args.base_port or port_block(ports_needed(n))
        self.urls = [f"http://127.0.0.1:{base + 2 * n + i}" for i in range(n)]
        flags = ["--emulate-gpu", args.emulate_gpu, "--emulate-model", args.emulate_model]
        flags += ["--emulate-time-scale", f"{args.emulate_time_scale:g}", *args.serve_args.split()]
        self.cmds = [serve_command(1, base + 2 * n + i, flags, base + 2 * i) for i in range(n)]
        port = base + 3 * n
        self.router_url = f"http://127.0.0.1:{port}"
        self.router_cmd = router_command(
            Target("kvmesh", args.preset, tuple(rflags)), self.urls, port, {}
        )
        self.engines: list[Proc | None] = [None] * n
        self.router: Proc | None = None
        self.starts: dict[str, int] = {}

    def _start(self, cmd: list[str], name: str) -> Proc:
        k = self.starts[name] = self.starts.get(name, -1) + 1
        return Proc(cmd, self.out / f"{name}{f'.{k}' if k else ''}.log", ENGINE_ENV)

    def start_engine(self, i: int) -> Proc:
        self.engines[i] = self._start(self.cmds[i], f"engine-{i}")
        return self.engines[i]

    def start_router(self) -> Proc:
        self.router = self._start(self.router_cmd, "router")
        return self.router

    @staticmethod
    def kill(proc: Proc | None) -> None:
        """SIGKILL to the process group, as a crash: no cleanup, no goodbye on any socket."""
        if proc is not None:
            proc.kill()

    def stop(self) -> None:
        stop_all(p for p in [self.router, *self.engines] if p is not None)


@dataclass
class State:
    """What the load, the poller and the timeline share during a run."""

    t0: float = field(default_factory=time.perf_counter)
    router_gen: int = 0  # bumped at each router kill
    router_down: bool = False
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # the timeline has ended
    results: list[Result] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fault_counts: dict[str, dict] = field(default_factory=dict)  # GET /admin/faults at the end

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def event(self, kind: str, target: str) -> None:
        self.events.append({"t": round(self.now(), 3), "kind": kind, "target": target})


async def wait_ready(http: aiohttp.ClientSession, url: str, proc: Proc, limit: float = 180) -> bool:
    """Poll GET /health every 50 ms until 200; False when the process exits or time runs out."""
    return await await_healthy(http, url, lambda: proc.popen.poll() is None, limit, POLL_S)


async def start_fleet(http: aiohttp.ClientSession, fleet: Fleet) -> None:
    """Every engine, then the router, each answering /health; RuntimeError with the log's
    tail of the first that did not start."""
    procs = [fleet.start_engine(i) for i in range(len(fleet.urls))]
    ready = await asyncio.gather(
        *(wait_ready(http, u, p) for u, p in zip(fleet.urls, procs, strict=True))
    )
    if not all(ready) or not await wait_ready(http, fleet.router_url, fleet.start_router()):
        bad = next((p for p, ok in zip(procs, ready, strict=True) if not ok), fleet.router)
        raise RuntimeError(f"the fleet did not start:\n{bad.tail()}")


async def in_rotation(st: State, endpoint: str, since: float, limit: float) -> None:
    """Until a /metrics sample after `since` shows the endpoint in rotation (or `limit` s)."""
    deadline = st.now() + limit
    while st.now() < deadline:
        s = st.samples[-1] if st.samples else None
        if s is not None and s.t > since and s.healthy and s.healthy.get(endpoint) == 1.0:
            return
        await asyncio.sleep(POLL_S)


async def monitor(http: aiohttp.ClientSession, url: str, st: State, stop: asyncio.Event) -> None:
    """The router's /metrics every 50 ms; a sample without health while it does not answer."""
    while not stop.is_set():
        t, gen = st.now(), st.router_gen  # a poll sent after a kill reaches the new router
        try:
            async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=1)) as r:
                st.samples.append(parse_router_metrics(await r.text(), t))
                st.samples[-1].gen = gen
        except (aiohttp.ClientError, TimeoutError):
            st.samples.append(Sample(t))
        await asyncio.sleep(max(0.0, POLL_S - (st.now() - t)))


async def set_faults(http: aiohttp.ClientSession, url: str, body: dict, st: State) -> None:
    """POST /admin/faults to one engine; a failure is a note, never an exception."""
    try:
        async with http.post(url + "/admin/faults", json=body, headers=admin_headers()) as r:
            if r.status != 200:
                st.notes.append(f"POST {url}/admin/faults {body}: HTTP {r.status}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        st.notes.append(f"POST {url}/admin/faults {body}: {exc}")


async def read_fault_counts(http: aiohttp.ClientSession, urls: list[str], st: State) -> None:
    """Each engine's fault counters (GET /admin/faults, its config left out) into the state."""
    for u in urls:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with http.get(u + "/admin/faults", headers=admin_headers()) as r:
                got = await r.json() if r.status == 200 else {}
                st.fault_counts[u] = {k: v for k, v in got.items() if k != "config"}
