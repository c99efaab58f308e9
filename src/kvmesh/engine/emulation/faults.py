"""Faults on demand for emulated engines: set by flags at start, changed at run time over HTTP.

`POST /admin/faults` with a JSON object of FaultConfig fields replaces those fields;
`GET /admin/faults` returns the current settings and counters.
"""

from __future__ import annotations

import asyncio
import random

import msgspec
from aiohttp import web


class FaultConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    error_rate: float = 0.0  # fraction of API requests answered 500 at once
    hang_rate: float = 0.0  # fraction of API requests that never answer (until the client quits)
    crash_after: int = 0  # the engine stops serving after this many API requests (0: never)
    slowdown: float = 1.0  # every step lasts this many times the predicted time
    stall_rate: float = 0.0  # fraction of streams that stall once mid-stream ...
    stall_seconds: float = 5.0  # ... for this long
    stall_after_tokens: int = 4  # ... after this many chunks
    drop_events_rate: float = 0.0  # fraction of numbered KV event batches never sent (replayable)
    seed: int | None = None

    def validate(self) -> None:
        for name in ("error_rate", "hang_rate", "stall_rate", "drop_events_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.slowdown <= 0:
            raise ValueError("slowdown must be positive")
        if self.crash_after < 0 or self.stall_seconds < 0 or self.stall_after_tokens < 0:
            raise ValueError("crash_after, stall_seconds and stall_after_tokens must be >= 0")


API_PATHS = ("/v1/completions", "/v1/chat/completions")


class FaultInjector:
    def __init__(self, config: FaultConfig | None = None) -> None:
        self.config = config or FaultConfig()
        self.config.validate()
        self.rng = random.Random(self.config.seed)
        self.num_requests = 0
        self.counts = {"errors": 0, "hangs": 0, "stalls": 0, "dropped_event_batches": 0}
        self.crashed = asyncio.Event()  # set when crash_after is reached; the host stops it
        self.timing = None  # PredictedTiming of the engine, for /admin/timing

    def update(self, changes: dict) -> None:
        merged = msgspec.structs.asdict(self.config) | changes
        config = msgspec.convert(merged, FaultConfig)
        config.validate()
        self.config = config
        if "seed" in changes:
            self.rng.seed(config.seed)

    def _hit(self, rate: float) -> bool:
        return rate > 0 and self.rng.random() < rate

    def stall_for(self) -> tuple[int, float] | None:
        """(after_chunks, seconds) when this stream should stall, else None."""
        if self._hit(self.config.stall_rate):
            self.counts["stalls"] += 1
            return self.config.stall_after_tokens, self.config.stall_seconds
        return None

    def drop_events(self) -> bool:
        if self._hit(self.config.drop_events_rate):
            self.counts["dropped_event_batches"] += 1
            return True
        return False

    def middleware(self):
        @web.middleware
        async def faults(request: web.Request, handler):
            if request.path not in API_PATHS:
                return await handler(request)
            self.num_requests += 1
            c = self.config
            if c.crash_after and self.num_requests > c.crash_after:
                self.crashed.set()
                raise web.HTTPServiceUnavailable(reason="engine crashed (fault injection)")
            if self._hit(c.error_rate):
                self.counts["errors"] += 1
                return web.json_response(
                    {
                        "error": {
                            "message": "Injected fault: internal error.",
                            "type": "InternalServerError",
                            "param": None,
                            "code": 500,
                        }
                    },
                    status=500,
                )
            if self._hit(c.hang_rate):
                self.counts["hangs"] += 1
                await asyncio.Event().wait()  # until the client disconnects (handler cancelled)
            return await handler(request)

        return faults

    def routes(self) -> list[web.RouteDef]:
        async def get(request: web.Request) -> web.Response:
            return web.json_response(
                {
                    "config": msgspec.structs.asdict(self.config),
                    "num_requests": self.num_requests,
                    **self.counts,
                }
            )

        async def post(request: web.Request) -> web.Response:
            try:
                changes = msgspec.json.decode(await request.read())
                if not isinstance(changes, dict):
                    raise ValueError("expected a JSON object of fault settings")
                self.update(changes)
            except (ValueError, msgspec.ValidationError, msgspec.DecodeError) as exc:
                return web.json_response(
                    {
                        "error": {
                            "message": f"Invalid fault settings: {exc}",
                            "type": "BadRequestError",
                            "param": None,
                            "code": 400,
                        }
                    },
                    status=400,
                )
            return await get(request)

        async def timing(request: web.Request) -> web.Response:
            t = self.timing
            return web.json_response(t.summary() if t is not None else {})

        return [
            web.get("/admin/faults", get),
            web.post("/admin/faults", post),
            web.get("/admin/timing", timing),
        ]
