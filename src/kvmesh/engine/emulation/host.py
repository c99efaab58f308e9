"""Hosts one or many emulated engines in one process, each on its own HTTP port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import replace

from aiohttp import web

from kvmesh.engine.builder import EngineBundle
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.emulation.builder import EmulationConfig, build_emulated_engine
from kvmesh.engine.server import start_server
from kvmesh.protocol.zmq_events import offset_endpoint

logger = logging.getLogger(__name__)


def engine_config_for(config: EngineConfig, index: int) -> EngineConfig:
    """The i-th engine's config: KV event endpoints offset by i, as DP ranks are."""
    if not config.kv_events_config or index == 0:
        return config
    events = json.loads(config.kv_events_config)
    for key in ("endpoint", "replay_endpoint"):
        if events.get(key):
            # event and replay ports of engine i: base + 2i keeps the two series apart
            events[key] = offset_endpoint(events[key], 2 * index)
    return replace(config, kv_events_config=json.dumps(events))


class EmulatedFleet:
    """N emulated engines served from one event loop."""

    def __init__(self, config: EngineConfig, emu: EmulationConfig, tokenizer, count: int) -> None:
        self.bundles: list[EngineBundle] = [
            build_emulated_engine(engine_config_for(config, i), emu, tokenizer, engine_index=i)
            for i in range(count)
        ]
        self.runners: list[web.AppRunner | None] = []
        self.urls: list[str] = []
        self._watchers: list[asyncio.Task] = []

    async def start(self, host: str, base_port: int) -> list[str]:
        for i, bundle in enumerate(self.bundles):
            port = base_port + i if base_port else 0
            runner = await start_server(bundle, host, port)
            actual = runner.addresses[0][1]
            self.runners.append(runner)
            self.urls.append(f"http://{host}:{actual}")
            if bundle.faults is not None:
                self._watchers.append(asyncio.create_task(self._crash_on_fault(i)))
        return self.urls

    async def _crash_on_fault(self, index: int) -> None:
        """A crash fault takes the engine off the network: its port closes, streams break."""
        await self.bundles[index].faults.crashed.wait()
        await self.stop_engine(index)
        logger.warning("engine %s crashed (fault injection)", self.urls[index])

    async def stop_engine(self, index: int) -> None:
        runner = self.runners[index]
        if runner is not None:
            self.runners[index] = None
            await runner.cleanup()

    async def stop(self) -> None:
        for task in self._watchers:
            task.cancel()
        for i in range(len(self.runners)):
            with contextlib.suppress(Exception):
                await self.stop_engine(i)
