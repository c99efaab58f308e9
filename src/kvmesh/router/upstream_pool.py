"""How the router reaches each endpoint: a pool of idle keep-alive connections (router.proxy's
Upstream), the header lines every request to it carries, and the watchdog of the requests in
flight to it (router.forward's forwards, which it knows as Watched)."""

from __future__ import annotations

import asyncio
import ssl as _ssl
from dataclasses import dataclass, field
from time import monotonic
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlparse

from kvmesh.router.proxy import Upstream

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint

# sweeps come every eighth of the shortest limit a forward runs under (so a limit is enforced
# at most that much late), within these bounds in seconds
MIN_SWEEP, MAX_SWEEP = 0.005, 1.0


class UpstreamPool:
    """Idle keep-alive connections to one endpoint, most recently used first."""

    def __init__(self, host: str, port: int, max_idle: int = 256, ssl: bool = False) -> None:
        self.host, self.port, self.max_idle = host, port, max_idle
        self.ssl = _ssl.create_default_context() if ssl else None
        self.idle: list[Upstream] = []

    def take(self) -> Upstream | None:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        return None

    async def connect(self, timeout: float) -> Upstream:
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: Upstream(self), self.host, self.port, ssl=self.ssl),
            timeout,
        )
        return conn

    def give_back(self, conn: Upstream) -> None:
        if len(self.idle) < self.max_idle:
            self.idle.append(conn)
        else:
            conn.transport.close()

    def forget(self, conn: Upstream) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def close(self) -> None:
        for conn in self.idle:
            conn.transport.close()
        self.idle.clear()


class Watched(Protocol):
    """A request in flight, as its endpoint's watchdog sees it."""

    def check(self, now: float) -> None:
        """Enforce its limits at ``now`` (monotonic): a late first byte, a stalled stream."""
        ...


class Watchdog:
    """The unsettled forwards to one endpoint (router.forward.Forward), each checked once per
    sweep; sweeps run only while there are some, at the pace the shortest limit any of them
    runs under asks for."""

    __slots__ = ("forwards", "every", "limit", "timer")

    def __init__(self) -> None:
        self.forwards: set[Watched] = set()
        self.every, self.limit = MAX_SWEEP, float("inf")
        self.timer: asyncio.TimerHandle | None = None

    def add(self, fw: Watched, limit: float) -> None:
        """Watch fw, whose shortest limit (first byte or stream idle) is ``limit`` seconds."""
        self.forwards.add(fw)
        if limit < self.limit:
            self.limit, self.every = limit, max(MIN_SWEEP, min(MAX_SWEEP, limit / 8))
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.every, self.sweep)

    def sweep(self) -> None:
        self.timer = None
        now = monotonic()
        for fw in list(self.forwards):
            fw.check(now)
        if self.forwards:
            self.timer = asyncio.get_running_loop().call_later(self.every, self.sweep)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


@dataclass(slots=True)
class Link:
    """How the router talks to one endpoint: its keep-alive pool, the header lines it adds and
    the watchdog of the forwards in flight."""

    url: str
    pool: UpstreamPool
    tag: bytes  # response header naming the endpoint
    headers: str  # request header lines for this endpoint (Host, data-parallel rank)
    watchdog: Watchdog = field(default_factory=Watchdog)

    @classmethod
    def of(cls, e: Endpoint) -> Link:
        u = urlparse(e.url)
        port = u.port or (443 if u.scheme == "https" else 80)
        pool = UpstreamPool(u.hostname or "127.0.0.1", port, ssl=u.scheme == "https")
        headers = f"Host: {u.netloc}\r\n"
        if e.dp_rank is not None:
            headers += f"X-data-parallel-rank: {e.dp_rank}\r\n"
        return cls(e.url, pool, f"x-kvmesh-endpoint: {e.name}".encode("latin-1"), headers)
