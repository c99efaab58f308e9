"""Where an endpoint's KV events come from, as the router reaches them: the publisher's address
as configured or as the engine's /kv_event_sources lists it (per data-parallel rank), and where
the router's SUB socket goes for it."""

from __future__ import annotations

import asyncio

import aiohttp

from kvmesh.protocol.zmq_events import offset_endpoint, publisher_binds
from kvmesh.router.endpoints import Endpoint


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


async def discover(session: aiohttp.ClientSession, e: Endpoint) -> tuple[str, str | None, str]:
    """Where the router subscribes to e's KV events: (sub endpoint, replay endpoint, topic), as
    configured, or from the engine's /kv_event_sources, asked until it answers."""
    if e.kv_events != "auto":  # given as the publisher says it: tcp://*:5557 is reached
        ep = e.kv_events  # at the endpoint's host; a named address is bound by the router
        replay = e.kv_events_replay.replace("*", e.host) if e.kv_events_replay else None
        return ep if ep.startswith("bind:") else subscribe_address(ep, e.host), replay, ""
    while True:
        try:
            async with session.get(
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
