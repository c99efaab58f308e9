"""The front door of a data-parallel server: one HTTP port over N rank servers (vLLM's internal
load balancer). Each request goes to the rank named by X-data-parallel-rank, else to the live
rank with the fewest requests in flight (running + waiting: every request reaches the private
ranks through here, so this count is theirs, never stale); ties rotate. Bodies stream through
unchanged; /metrics and /kv_event_sources merge every rank's; /health is 200 only while every
rank is up. A rank that goes down is skipped at once; its streams end with an OpenAI error
event, its other requests get 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from kvmesh.engine.dp.surfaces import merge_event_sources, merge_metrics
from kvmesh.engine.server import MAX_BODY_BYTES, error_middleware
from kvmesh.protocol.openai import SSE_DONE, APIError, encode_json, error_body, sse_event

logger = logging.getLogger(__name__)
DP_RANK_HEADER = "X-data-parallel-rank"
HOP_HEADERS = {
    "host",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "te",
    "upgrade",
    "proxy-connection",
}
PROBE_INTERVAL_S = 1.0  # each rank's /health is read this often
PROBE_FAILURES = 3  # consecutive failed probes that take a rank out of rotation
UPSTREAM_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


@dataclass(slots=True)
class Rank:
    rank: int
    url: str = ""  # known once the rank serves
    alive: bool = True  # its process runs (the launcher says when it exits)
    ready: bool = False  # it serves
    healthy: bool = True  # its /health answers 200
    probe_failures: int = 0
    in_flight: int = 0
    down_reason: str | None = None

    @property
    def up(self) -> bool:
        return self.ready and self.alive and self.healthy


class FrontDoor:
    def __init__(self, size: int) -> None:
        self.ranks = [Rank(i) for i in range(size)]
        self._turn = 0
        self._session: aiohttp.ClientSession | None = None
        self._probe: asyncio.Task | None = None

    # ---- choosing a rank ------------------------------------------------------------------
    def pick(self, header: str | None) -> Rank:
        n = len(self.ranks)
        if header is not None:
            try:
                index = int(header.strip())
            except ValueError:
                raise APIError(f"{DP_RANK_HEADER} must be an integer, got {header!r}.") from None
            if not 0 <= index < n:
                raise APIError(f"{DP_RANK_HEADER} {index} is outside [0, {n}).")
            if not self.ranks[index].up:
                raise APIError(f"Data-parallel rank {index} is down.", 503)
            return self.ranks[index]
        live = [r for r in self.ranks if r.up]
        if not live:
            raise APIError("No data-parallel rank is up.", 503)
        turn, self._turn = self._turn, (self._turn + 1) % n
        return min(live, key=lambda r: (r.in_flight, (r.rank - turn) % n))

    def mark_ready(self, index: int, url: str) -> None:
        self.ranks[index].url, self.ranks[index].ready = url, True

    def mark_down(self, index: int, reason: str) -> None:
        rank = self.ranks[index]
        if rank.alive:
            logger.error("data-parallel rank %d is down: %s", index, reason)
        rank.alive, rank.down_reason = False, reason

    # ---- proxying -------------------------------------------------------------------------
    async def proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        rank = self.pick(request.headers.get(DP_RANK_HEADER))
        rank.in_flight += 1
        try:
            return await self._forward(request, rank, body)
        finally:
            rank.in_flight -= 1

    async def _forward(self, request: web.Request, rank: Rank, body: bytes) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        lost = f"Data-parallel rank {rank.rank} was lost while serving this request."
        try:
            upstream = await self._session.request(
                request.method, rank.url + request.path_qs, data=body, headers=headers
            )
        except UPSTREAM_ERRORS:
            raise APIError(lost, 503) from None
        async with upstream:
            out_headers = {
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS
            }
            out_headers[DP_RANK_HEADER] = str(rank.rank)
            if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                try:
                    data = await upstream.read()
                except UPSTREAM_ERRORS:
                    raise APIError(lost, 503) from None
                return web.Response(body=data, status=upstream.status, headers=out_headers)
            resp = web.StreamResponse(status=upstream.status, headers=out_headers)
            await resp.prepare(request)
            tail = b"\n\n"
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                    tail = (tail + chunk)[-2:]
            except UPSTREAM_ERRORS:  # the rank went away mid-stream: end it with an error
                error = error_body(lost, 503)
                end = b"" if tail == b"\n\n" else b"\n\n"  # never glue onto a cut event
                await resp.write(end + sse_event(error) + SSE_DONE)
            await resp.write_eof()
            return resp

    async def _get_all(self, path: str) -> list[tuple[Rank, int, bytes]]:
        """(rank, status, body) of GET path on every live rank, in rank order."""
        assert self._session is not None

        async def one(rank: Rank) -> tuple[Rank, int, bytes] | None:
            try:
                timeout = aiohttp.ClientTimeout(total=5)
                async with self._session.get(rank.url + path, timeout=timeout) as resp:
                    return rank, resp.status, await resp.read()
            except UPSTREAM_ERRORS:
                return None

        answers = await asyncio.gather(*(one(r) for r in self.ranks if r.alive and r.ready))
        return [a for a in answers if a is not None]

    # ---- merged surfaces ------------------------------------------------------------------
    async def metrics(self, request: web.Request) -> web.Response:
        answers = await self._get_all("/metrics")
        pages = [body.decode() for _, status, body in answers if status == 200]
        return web.Response(
            body=merge_metrics(pages).encode(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        answers = [
            json.loads(body)
            for _, status, body in await self._get_all("/kv_event_sources")
            if status == 200
        ]
        return _json(merge_event_sources(answers))

    async def health(self, request: web.Request) -> web.Response:
        down = [r for r in self.ranks if not r.up]
        if not down:
            return web.Response(status=200)
        detail = "; ".join(f"rank {r.rank}: {_state(r)}" for r in down)
        return _json(error_body(f"Data-parallel ranks down: {detail}", 503), 503)

    async def load(self, request: web.Request) -> web.Response:
        return _json({"server_load": sum(r.in_flight for r in self.ranks)})

    async def reset_prefix_cache(self, request: web.Request) -> web.StreamResponse:
        """Every rank's cache, or the first refusal."""
        for rank in self.ranks:
            if rank.alive and rank.ready:
                resp = await self._forward(request, rank, await request.read())
                if resp.status != 200:
                    return resp
        return web.Response(status=200)

    async def _probe_loop(self) -> None:
        assert self._session is not None
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            for rank in self.ranks:
                if not (rank.alive and rank.ready):
                    continue
                try:
                    timeout = aiohttp.ClientTimeout(total=2 * PROBE_INTERVAL_S)
                    async with self._session.get(rank.url + "/health", timeout=timeout) as r:
                        ok = r.status == 200
                        reason = (await r.text())[:200]
                except UPSTREAM_ERRORS as exc:
                    ok, reason = False, f"/health unreachable ({type(exc).__name__})"
                if ok:
                    if not rank.healthy:
                        logger.info("data-parallel rank %d is healthy again", rank.rank)
                    rank.healthy, rank.probe_failures = True, 0
                    continue
                rank.probe_failures += 1
                if rank.probe_failures >= PROBE_FAILURES or "Engine stopped" in reason:
                    if rank.healthy:
                        logger.error("data-parallel rank %d is unhealthy: %s", rank.rank, reason)
                    rank.healthy = False

    # ---- the app --------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_route("*", "/ping", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/kv_event_sources", self.kv_event_sources)
        app.router.add_get("/load", self.load)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_route("*", "/{tail:.*}", self.proxy)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        connector = aiohttp.TCPConnector(limit=0)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=connector, auto_decompress=False
        )
        self._probe = asyncio.create_task(self._probe_loop())

    async def _stop(self, app: web.Application) -> None:
        if self._probe is not None:
            self._probe.cancel()
        if self._session is not None:
            await self._session.close()


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(body=encode_json(obj), status=status, content_type="application/json")


def _state(rank: Rank) -> str:
    if not rank.alive:
        return rank.down_reason or "exited"
    return "starting" if not rank.ready else "not healthy"
