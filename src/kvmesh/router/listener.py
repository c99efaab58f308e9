"""The router's listening socket: each accepted connection becomes a FrontDoor (router.frontdoor)
whose requests go to router.handle; a sweeper closes connections left idle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from kvmesh.protocol.http_limits import IDLE_TIMEOUT_S, REQUEST_READ_TIMEOUT_S
from kvmesh.router.frontdoor import FrontDoor, Request


class Routes(Protocol):
    """What the listener serves (router.app.Router is the one). It may also offer the front
    door's Gate as ``continue_gate``. While ``draining`` it answers every request 503."""

    draining: bool

    def handle(self, door: FrontDoor, request: Request) -> Coroutine[Any, Any, None] | None:
        """The front door's Handler."""
        ...

    async def stop(self) -> None: ...


@dataclass(slots=True)
class RouterServer:
    router: Routes
    server: asyncio.AbstractServer
    doors: set[FrontDoor]
    sweeper: asyncio.Task | None = None

    async def drain(self, timeout: float, poll: float = 0.05) -> bool:
        """Stop taking requests: each new one is answered 503 and its connection closed (the
        router's ``draining``), idle keep-alive connections are closed now and busy ones once
        their answer is sent. Waits at most timeout seconds for those answers; whether they
        all finished."""
        self.router.draining = True
        for door in list(self.doors):
            if door.task is None and door.transport is not None:
                door.transport.close()
            else:
                door.must_close = True
        deadline = time.monotonic() + timeout
        while any(door.task is not None for door in self.doors):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll)
        return True

    async def cleanup(self) -> None:
        self.server.close()
        if self.sweeper is not None:
            self.sweeper.cancel()
        for door in list(self.doors):
            if door.transport is not None:
                door.transport.close()
        await self.router.stop()


async def _close_idle(doors: set[FrontDoor], every: float) -> None:
    """Close client connections idle for a whole sweep interval (so after every..2*every
    seconds): no request in progress, none finished and no byte received, a request head left
    unfinished included."""
    while True:
        await asyncio.sleep(every)
        for door in list(doors):
            if door.task is None and not door.seen and door.transport is not None:
                door.transport.close()
            door.seen = False


async def serve(
    router: Routes,
    host: str,
    port: int,
    max_body: int,
    idle_timeout: float = IDLE_TIMEOUT_S,
    request_timeout: float = REQUEST_READ_TIMEOUT_S,
) -> RouterServer:
    """Listen on host:port; each connection's requests go to router.handle. A request started
    but not read in full within request_timeout seconds is answered 408."""
    doors: set[FrontDoor] = set()
    gate = getattr(router, "continue_gate", None)  # before 100 Continue (a Router's: the key)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: FrontDoor(router.handle, max_body, doors, request_timeout, gate),
        host,
        port,
        backlog=1024,
    )
    return RouterServer(router, server, doors, loop.create_task(_close_idle(doors, idle_timeout)))
