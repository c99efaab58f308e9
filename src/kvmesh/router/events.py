"""KV event ingestion: one ZMQ SUB per endpoint on the router's event loop, feeding the precise
index; sequence gaps are repaired through the publisher's replay socket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time

import aiohttp
import zmq
import zmq.asyncio

from kvmesh.protocol.kv_events import decode_batch
from kvmesh.protocol.zmq_events import offset_endpoint, publisher_binds
from kvmesh.router.endpoints import Endpoint

logger = logging.getLogger(__name__)
END_SEQ = 2**64 - 1


def _rank_source(sources: dict, rank: int | None) -> dict | None:
    """The KV-event source of one data-parallel rank: its own entry when the server lists it,
    else the first listed one with its endpoints offset by the rank difference (as vLLM's
    publishers are)."""
    if rank is not None and str(rank) in sources:
        return sources[str(rank)]
    key, cfg = next(iter(sources.items()))
    if rank is None or not cfg:
        return cfg
    delta = rank - (int(key) if str(key).isdigit() else 0)
    if delta <= 0:
        return cfg
    cfg = dict(cfg)
    for name in ("endpoint", "replay_endpoint"):
        if cfg.get(name):
            cfg[name] = offset_endpoint(cfg[name], delta)
    return cfg


def subscribe_address(publisher_endpoint: str, host: str) -> str:
    """Where the router's SUB socket goes for an engine's publisher endpoint: a publisher that
    binds (wildcard, ipc, inproc) is connected to at the engine's host; one that connects to a
    named address needs the router to bind it ("bind:" prefix)."""
    if publisher_binds(publisher_endpoint):
        return publisher_endpoint.replace("*", host)
    return "bind:" + publisher_endpoint


class EventIngest:
    def __init__(self, index, session: aiohttp.ClientSession, stats=None) -> None:
        self.index = index
        self.session = session
        self.ctx = zmq.asyncio.Context.instance()
        self.tasks: dict[str, asyncio.Task] = {}
        self.last_seq: dict[str, int] = {}
        self.lag_seconds = 0.0  # receive time minus the batch's timestamp, last seen
        self.batches = 0
        self.gaps_repaired = 0

    def watch(self, endpoint: Endpoint) -> None:
        if endpoint.kv_events and endpoint.name not in self.tasks:
            self.tasks[endpoint.name] = asyncio.create_task(self._run(endpoint))

    def forget(self, name: str) -> None:
        task = self.tasks.pop(name, None)
        if task is not None:
            task.cancel()
        self.last_seq.pop(name, None)
        self.index.remove_endpoint(name)

    async def stop(self) -> None:
        for name in list(self.tasks):
            task = self.tasks.pop(name)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _discover(self, e: Endpoint) -> tuple[str, str | None, str]:
        """(sub endpoint, replay endpoint, topic) from the engine's /kv_event_sources."""
        if e.kv_events != "auto":  # given as the publisher says it: tcp://*:5557 is reached
            ep = e.kv_events  # at the endpoint's host; a named address is bound by the router
            return ep if ep.startswith("bind:") else subscribe_address(ep, e.host), None, ""
        while True:
            try:
                async with self.session.get(
                    e.url + "/kv_event_sources", timeout=aiohttp.ClientTimeout(total=2)
                ) as resp:
                    sources = await resp.json()
                cfg = _rank_source(sources, e.dp_rank)
                if cfg and cfg.get("endpoint"):
                    break
            except (TimeoutError, aiohttp.ClientError, ValueError, StopIteration, AttributeError):
                pass
            await asyncio.sleep(1.0)
        replay = cfg.get("replay_endpoint")
        replay = replay.replace("*", e.host) if replay else None
        return subscribe_address(cfg["endpoint"], e.host), replay, cfg.get("topic", "")

    async def _run(self, e: Endpoint) -> None:
        """Follow one endpoint's events; a failure is logged and the subscription retried."""
        while True:
            try:
                await self._follow(e)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bad address, a socket error: never silently gone
                logger.warning("KV events of %s: %s; retrying in 5 s", e.name, exc)
                await asyncio.sleep(5.0)

    async def _follow(self, e: Endpoint) -> None:
        sub_ep, replay_ep, topic = await self._discover(e)
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        # a publisher that binds is connected to; one that connects needs us to bind
        if sub_ep.startswith("bind:"):
            sock.bind(sub_ep.removeprefix("bind:"))
        else:
            sock.connect(sub_ep)
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) < 3:
                    continue
                seq = struct.unpack(">Q", frames[-2])[0]
                last = self.last_seq.get(e.name)
                if last is not None and seq > last + 1 and replay_ep:
                    await self._replay(e, replay_ep, last + 1, seq)
                self._apply(e, seq, frames[-1])
        finally:
            sock.close()

    def _apply(self, e: Endpoint, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except ValueError:
            logger.warning("undecodable KV event batch from %s", e.name)
            return
        self.index.apply(e.name, batch)
        self.last_seq[e.name] = seq
        self.batches += 1
        self.lag_seconds = max(0.0, time.time() - batch.ts)

    async def _replay(self, e: Endpoint, replay_ep: str, start: int, stop: int) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(replay_ep)
        try:
            await sock.send_multipart([b"", struct.pack(">Q", start)])
            while True:
                if not await sock.poll(2000):
                    break
                frames = await sock.recv_multipart()
                seq_raw, payload = frames[-2], frames[-1]
                if not payload or seq_raw == b"\xff" * 8:
                    break
                seq = struct.unpack(">Q", seq_raw)[0]
                if start <= seq < stop:
                    self._apply(e, seq, payload)
            self.gaps_repaired += 1
        finally:
            sock.close()
