"""The processes and probes of the `kvmesh up` benchmark: a stack's commands started each in its
own session (so that every process it starts, children included, shares its process group and
can be found and killed), health waits, a /health latency probe, the router's view of its
engines, and the stack's stop by SIGTERM while requests are in flight."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from kvmesh.bench.fleet_procs.procs import (
    ADMIN_KEY,
    Proc,
    admin_headers,
    await_healthy,
    group_members,
)
from kvmesh.bench.kv_regime import cache_tokens
from kvmesh.protocol.prom import parse_samples
from kvmesh.protocol.stats import percentile

PROBE_S = 0.1  # between two GET /health of one server
VIEW_S = 0.5  # between two reads of the router's /metrics


class Group:
    """The commands of one stack, each the leader of its own process group, logging to files."""

    def __init__(self, logs: Path, pythonpath: str | None) -> None:
        self.env = {"KVMESH_ADMIN_API_KEY": ADMIN_KEY}  # for /admin/timing
        if pythonpath:
            self.env["PYTHONPATH"] = pythonpath
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = logs
        self.procs: list[Proc] = []

    def start(self, cmd: list[str]) -> None:
        name = next((a for a in cmd if a in ("up", "serve", "router")), "cmd")
        self.procs.append(Proc(cmd, self.logs / f"{len(self.procs)}-{name}.log", self.env))

    def cpu(self) -> dict[int, float]:
        """CPU seconds so far of every live process of the stack."""
        return group_members({p.popen.pid for p in self.procs})

    def exited(self) -> list[int | None]:
        return [p.popen.poll() for p in self.procs]

    async def stop_under_load(self, router: str, in_flight: int) -> tuple[float, int]:
        """SIGTERM to every command while `in_flight` long streams run through the router:
        (seconds until all have exited, or -1 past 30 s; processes of their groups left)."""
        load = [asyncio.create_task(long_stream(router)) for _ in range(in_flight)]
        await asyncio.sleep(1.5)
        t0 = time.monotonic()
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(signal.SIGTERM)
        took = -1.0
        while time.monotonic() - t0 < 30:
            if all(code is not None for code in self.exited()):
                took = round(time.monotonic() - t0, 2)
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # a child that outlives its parent by more is left behind
        left = len(group_members({p.popen.pid for p in self.procs}))
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
        return took, left

    def kill(self) -> None:
        for p in self.procs:
            p.kill()

    def tail(self) -> str:
        return "\n".join(f.read_text(errors="replace")[-2000:] for f in self.logs.glob("*.log"))


@contextlib.contextmanager
def busy_processes(n: int):
    """``n`` processes that spin on a core each until the block ends: a loaded host."""
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin, start_new_session=True) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


async def long_stream(url: str) -> None:
    body = {"prompt": "tell me a long story " * 40, "max_tokens": 4000, "stream": True}
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
            http.post(url + "/v1/completions", json=body) as resp,
        ):
            async for _ in resp.content.iter_any():
                pass


async def wait_healthy(urls: list[str], group: Group, timeout: float = 180.0) -> None:
    """Until every URL answers GET /health 200; RuntimeError when a command exits first."""
    deadline = time.monotonic() + timeout

    def alive() -> bool:
        return all(code is None for code in group.exited())

    async with aiohttp.ClientSession() as http:
        for url in urls:
            if not await await_healthy(http, url, alive, deadline - time.monotonic(), 0.2):
                if not alive():
                    raise RuntimeError(f"a command exited before {url} was up:\n{group.tail()}")
                raise RuntimeError(f"{url} not healthy in {timeout} s:\n{group.tail()}")


async def health_probe(url: str, stop: asyncio.Event) -> list[float]:
    """GET /health latencies in ms every PROBE_S until `stop`: how long that server's event
    loop keeps any other work (a scrape, a KV event batch) waiting. A failure counts 10 s."""
    lat: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                async with http.get(url + "/health") as resp:
                    await resp.read()
                lat.append((time.perf_counter() - t0) * 1000)
            except (aiohttp.ClientError, TimeoutError):
                lat.append(10_000.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PROBE_S)
    return lat


async def router_view(url: str, stop: asyncio.Event) -> dict:
    """The router's /metrics every VIEW_S until `stop`: samples with an engine unhealthy or
    ejected, with all of them so, and the ejections and retries counted at the end."""
    samples = some = every = 0
    totals: dict[str, float] = {}
    lags: list[float] = []
    wanted = ("kvmesh_router_endpoint_healthy", "kvmesh_router_endpoint_ejected")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url + "/metrics") as resp:
                    text = await resp.text()
                out: dict[str, bool] = {}
                totals = dict.fromkeys(("ejections", "retries", "predicted", "prompt"), 0.0)
                for s in parse_samples(text):
                    if s.name in wanted:
                        endpoint = s.labels.get("endpoint", "")
                        down = (s.value == 0) == (s.name == wanted[0])
                        out[endpoint] = out.get(endpoint, False) or down
                    elif s.name == "kvmesh_router_endpoint_ejections_total":
                        totals["ejections"] += s.value
                    elif s.name == "kvmesh_router_retries_total":
                        totals["retries"] += s.value
                    elif s.name == "kvmesh_router_predicted_cached_tokens_total":
                        totals["predicted"] += s.value
                    elif s.name == "kvmesh_router_prompt_tokens_total":
                        totals["prompt"] += s.value
                    elif s.name == "kvmesh_router_kv_event_lag_seconds":
                        lags.append(s.value * 1000)
                samples += 1
                some += any(out.values())
                every += bool(out) and all(out.values())
            if stop.is_set():
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), VIEW_S)
    prompt = totals.pop("prompt", 0.0)
    predicted = totals.pop("predicted", 0.0)
    return {
        "view_samples": samples,
        "unhealthy_samples": some,
        "all_unhealthy_samples": every,
        **{k: int(v) for k, v in totals.items()},
        "event_lag_ms_p50": round(percentile(lags, 50), 1),
        "event_lag_ms_max": round(max(lags, default=0.0), 1),
        # the share of prompt tokens the router expected its choices to find cached
        "predicted_hit_rate": round(predicted / prompt, 4) if prompt else None,
    }


async def timeline_restarts(engines: list[str]) -> tuple[int, int]:
    """(steps, steps that began so late that the engine left its step timeline) summed over
    the emulated engines' /admin/timing: how often something else held their event loop."""
    steps = late = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for url in engines:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with http.get(url + "/admin/timing", headers=admin_headers()) as resp:
                    doc = await resp.json()
                steps += int(doc.get("steps", 0))
                late += int(doc.get("timeline_restarts", 0))
    return steps, late


async def kv_cache_tokens(engines: list[str]) -> list[int | None]:
    """Each engine's KV cache in tokens, as its /metrics declares it (None where it does not)."""
    out: list[int | None] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for url in engines:
            text = ""
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url + "/metrics") as resp:
                    text = await resp.text()
            out.append(cache_tokens(text))
    return out
