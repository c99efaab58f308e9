"""`kvmesh serve --emulate-model M --data-parallel-size N [--enable-expert-parallel]`: one process
serving an emulated DP (or DP/EP) instance in real time.

Each of the N ranks is a whole emulated engine (scheduler, block pool, prefix cache, KV events
on port + rank, engine="<rank>" metrics) serving HTTP on a private loopback port, and the
front door of `kvmesh serve --data-parallel-size N` (dp.frontdoor: X-data-parallel-rank,
vLLM's internal load balancer, merged /metrics and /kv_event_sources, /health) serves --port
over them, all on one event loop. With --enable-expert-parallel the ranks step in lockstep on a
GroupClock priced by WideEPRoofline (KV capacity per rank from it as well); without it each
rank steps alone on the model's TP roofline (each rank a replica of --tensor-parallel-size GPUs).
A rank that crashes (--fault-crash-after) leaves the network and the front door's rotation at
once; in lockstep, or when no rank is left, the server then stops with exit code 1, as
`kvmesh serve --data-parallel-size N` does when a rank process dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from dataclasses import replace

from aiohttp import web
from prometheus_client import Counter, Gauge

from kvmesh.engine.auth import EngineKeys, expect_gate
from kvmesh.engine.builder import EngineBundle
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.dp.frontdoor import FrontDoor
from kvmesh.engine.emulation.builder import EmulationConfig, build_emulated_engine
from kvmesh.engine.emulation.dp_clock import GroupClock, GroupCost, SlowestRank, StepRecord
from kvmesh.engine.emulation.latency import ACCELERATORS, MODELS
from kvmesh.engine.http_guard import GuardedRunner

logger = logging.getLogger(__name__)
RANK_HOST = "127.0.0.1"  # ranks serve on private loopback ports, reached through the front door
FAIL_GRACE_S = 1.0  # after a lockstep rank is lost, time for error responses to reach clients


def group_cost(config: EngineConfig, emu: EmulationConfig) -> GroupCost:
    """What prices a lockstep step of the whole group: the wide-EP roofline, or in constant
    mode the slowest rank's constant time. Raises ValueError for a layout it cannot emulate."""
    from kvmesh.engine.emulation.wide_ep import WideEPRoofline

    model, size = MODELS[emu.emulate_model], config.data_parallel_size
    if not model.num_experts:
        raise ValueError(f"--enable-expert-parallel needs an MoE model; {model.name} is dense")
    if emu.tensor_parallel_size != 1:
        raise ValueError("--enable-expert-parallel is emulated with --tensor-parallel-size 1")
    if emu.emulate_ttft_ms is not None:
        return SlowestRank(emu.latency_model(), model, size)
    return WideEPRoofline(
        ACCELERATORS[emu.emulate_gpu],
        model,
        size,
        placement=config.expert_placement_strategy,
        step_overhead=emu.step_overhead_ms / 1e3,
        gpu_memory_utilization=emu.gpu_memory_utilization,
    )


class EmulatedDataParallel:
    """N emulated rank engines behind one front door, in this process."""

    def __init__(self, config: EngineConfig, emu: EmulationConfig, tokenizer) -> None:
        self.config, self.emu = config, emu
        self.size = config.data_parallel_size
        self.clock: GroupClock | None = None
        if config.enable_expert_parallel:
            self.clock = GroupClock(group_cost(config, emu), self.size, emu.emulate_time_scale)
        self.bundles: list[EngineBundle] = []
        for rank in range(self.size):
            cfg = replace(config, data_parallel_rank=rank)
            latency = self.clock.rank(rank) if self.clock is not None else None
            bundle = build_emulated_engine(cfg, emu, tokenizer, latency=latency)
            self.bundles.append(bundle)
        if self.clock is not None:
            for rank, bundle in enumerate(self.bundles):
                runner = bundle.engine.core.runner
                runner.lockstep_clock = runner.latency
                self.clock.runners.append(runner)
                self.clock.has_work.append(bundle.engine.core.has_work)
                self.clock.on_step.append(_lockstep_metrics(bundle, rank))
        self.door = FrontDoor(self.size)
        self._rank_servers: list[web.AppRunner] = []
        self._door: web.AppRunner | None = None
        self._watchers: list[asyncio.Task] = []
        self.url = ""
        self.done: asyncio.Future[int] | None = None  # set to the exit code when it must stop

    @property
    def num_blocks(self) -> int:
        return self.bundles[0].engine.core.kv.pool.num_blocks

    def describe(self) -> str:
        emu, layout = self.emu, f"DP{self.size}"
        if self.clock is not None:
            layout += f"/EP{self.size} in lockstep"
        elif emu.tensor_parallel_size > 1:
            layout += f" x TP{emu.tensor_parallel_size}"
        return (
            f"{emu.emulate_model} {layout} on {emu.emulate_gpu}, {self.num_blocks} KV blocks/rank"
        )

    async def start(self, host: str, port: int) -> str:
        """Serve every rank on a private port, then the front door on host:port; its URL."""
        from kvmesh.engine.server import start_server

        self.done = asyncio.get_running_loop().create_future()
        for rank, bundle in enumerate(self.bundles):
            runner = await start_server(bundle, RANK_HOST, 0)
            self._rank_servers.append(runner)
            self.door.mark_ready(rank, f"http://{RANK_HOST}:{runner.addresses[0][1]}")
            if bundle.faults is not None and bundle.faults.config.crash_after:
                self._watchers.append(asyncio.create_task(self._crash_on_fault(rank)))
        gate = expect_gate(EngineKeys.of(self.bundles[0].config))  # the ranks check the key again
        door = GuardedRunner(self.door.build_app(), gate=gate)
        await door.setup()
        self._door = door
        await web.TCPSite(door, host, port).start()
        self.url = f"http://{host}:{door.addresses[0][1]}"
        return self.url

    async def _crash_on_fault(self, rank: int) -> None:
        faults = self.bundles[rank].faults
        assert faults is not None and self.done is not None
        await faults.crashed.wait()
        self.door.mark_down(rank, "crashed (fault injection)")
        await self._rank_servers[rank].cleanup()  # its port closes, its streams break
        if self.clock is not None or not any(r.alive for r in self.door.ranks):
            why = "a rank in lockstep is gone" if self.clock is not None else "no rank is left"
            logger.error("emulated data-parallel server stopping: %s", why)
            await asyncio.sleep(FAIL_GRACE_S)
            if not self.done.done():
                self.done.set_result(1)

    async def stop(self) -> None:
        for task in self._watchers:
            task.cancel()
        if self._door is not None:
            await self._door.cleanup()
        if self.clock is not None:
            self.clock.close()
        for runner in self._rank_servers:
            with contextlib.suppress(Exception):
                await runner.cleanup()


def _lockstep_metrics(bundle: EngineBundle, rank: int):
    """The rank's lockstep series, as a real expert-parallel rank exports them: steps, idle
    (dummy) steps, and the group's expert imbalance."""
    metrics = bundle.metrics
    names, labels = list(metrics.labels), metrics.labels
    steps = Counter(
        "kvmesh:dp_lockstep_steps",
        "Engine steps this data-parallel rank took in lockstep with its peers.",
        names,
        registry=metrics.registry,
    ).labels(**labels)
    idle = Counter(
        "kvmesh:dp_idle_steps",
        "Lockstep steps in which this rank had no work and ran an idle (dummy) step.",
        names,
        registry=metrics.registry,
    ).labels(**labels)
    imbalance = Gauge(
        "kvmesh:moe_imbalance",
        "Max / mean over ranks of the routed tokens each rank's experts took (1.0 = balanced), "
        "as the roofline expects it for the last step.",
        names,
        registry=metrics.registry,
    ).labels(**labels)
    imbalance.set(1.0)

    def on_step(record: StepRecord) -> None:
        steps.inc()
        if rank not in record.ranks:
            idle.inc()
        imbalance.set(record.cost.imbalance)

    return on_step


def serve_emulated_data_parallel(
    config: EngineConfig, emu: EmulationConfig, tokenizer, host: str, port: int
) -> int:
    """Serve until SIGINT / SIGTERM (0) or a lost rank stops it (1); 2 for a layout that
    cannot be emulated."""
    from kvmesh.engine.server import run, wait_for_shutdown

    started = time.monotonic()
    print(
        f"kvmesh serve: emulating {config.data_parallel_size} data-parallel ranks of "
        f"{emu.emulate_model} on {emu.emulate_gpu} in this process...",
        flush=True,
    )
    try:
        server = EmulatedDataParallel(config, emu, tokenizer)
    except ValueError as exc:  # a model that does not fit, a dense model with EP
        print(f"kvmesh serve: {exc}", file=sys.stderr, flush=True)
        return 2
    result: list[int] = []

    async def main() -> None:
        try:
            url = await server.start(host, port)
        except OSError as exc:  # the port is taken
            print(f"kvmesh serve: {exc}", file=sys.stderr, flush=True)
            await server.stop()
            result.append(1)
            return
        print(f"kvmesh: {server.describe()}", flush=True)
        for rank, rank_server in enumerate(server.door.ranks):
            print(f"  rank {rank}: {rank_server.url} (private)", flush=True)
        print(
            f"kvmesh engine ready: {url}/v1  (model {server.bundles[0].model_name}, "
            f"data-parallel size {server.size}, {time.monotonic() - started:.1f}s)",
            flush=True,
        )
        assert server.done is not None
        stop = asyncio.ensure_future(wait_for_shutdown())
        stop.add_done_callback(lambda _: server.done.done() or server.done.set_result(0))
        try:
            result.append(await server.done)
        finally:
            stop.cancel()
            await server.stop()

    run(main())
    return result[0] if result else 0
