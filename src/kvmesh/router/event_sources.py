"""Where an endpoint's KV events come from, as the router reaches them: the publisher's address
as configured or as the engine's /kv_event_sources lists it (per data-parallel rank), and where
the router's SUB socket goes for it: connected to a publisher that binds, bound where one that
connects sends (SubscriptionBinds), which only one socket on a host, and so one router, can."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import zmq

from kvmesh.protocol.zmq_events import offset_endpoint, publisher_binds
from kvmesh.router.endpoints import Endpoint

logger = logging.getLogger(__name__)


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


class SubscriptionRefused(Exception):
    """The router cannot take an endpoint's KV events: the address its publisher connects to
    cannot be bound here. Its subscription is retried; the router is not ready meanwhile."""


class SubscriptionBinds:
    """The addresses this router's SUB sockets bind, each for one endpoint. A publisher that
    connects reaches one bound socket: a second endpoint on the same address would mix two
    publishers' sequences in one feed, and a second router (a replica on the same host) cannot
    bind it at all. Both are refused with the reason, never left to serve an empty index."""

    def __init__(self) -> None:
        self.owners: dict[str, str] = {}  # bound address -> the endpoint whose events it takes
        self.refused: dict[str, str] = {}  # endpoint -> why its events cannot be taken now

    def attach(self, sock: zmq.Socket, name: str, sub_ep: str) -> None:
        """Connect sock to a binding publisher, or bind it where a connecting one sends;
        raises SubscriptionRefused when the address is taken or not this host's."""
        if not sub_ep.startswith("bind:"):
            sock.connect(sub_ep)
            return
        address = sub_ep.removeprefix("bind:")
        owner = self.owners.get(address)
        if owner is not None and owner != name:
            raise SubscriptionRefused(
                f"{address} is bound already for the KV events of {owner}; publishers that "
                "connect must each name their own address (or bind, as tcp://*:PORT)"
            )
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            raise SubscriptionRefused(bind_failure(address, exc)) from None
        self.owners[address] = name

    def release(self, name: str, forget: bool = False) -> None:
        """The endpoint's socket is closed: its address is free (and, forgotten, its refusal)."""
        for address in [a for a, owner in self.owners.items() if owner == name]:
            del self.owners[address]
        if forget:
            self.refused.pop(name, None)

    def note(self, name: str, why: str | None) -> bool:
        """Record whether the endpoint's subscription is refused (why) or taken (None); logs
        and says True when that changed, so that a refusal retried is reported once."""
        if self.refused.get(name) == why:
            return False
        if why is not None:
            logger.error("KV events of %s: %s; the router is not ready until it binds", name, why)
            self.refused[name] = why
        else:
            del self.refused[name]
            logger.warning("KV events of %s: subscribed; the router is ready again", name)
        return True


def bind_failure(address: str, exc: zmq.ZMQError) -> str:
    """Why the router cannot bind a connecting publisher's address, and what to do about it."""
    if exc.errno == zmq.EADDRINUSE:
        return (
            f"cannot bind {address}: address already in use (another router replica?); a "
            "publisher that connects reaches one router only: for several router replicas, "
            "let the engines bind (--kv-events-config endpoint tcp://*:PORT)"
        )
    return (
        f"cannot bind {address} ({exc.strerror}): not an address of this host; give the "
        "router the address to bind, as bind:tcp://*:PORT"
    )
