"""How a workload's requests are sent: each after the requests it depends on and its think
time; sessions at their arrival times (open loop) or a fixed number at a time (closed loop), as
the load of every bench that replays a workload (loadgen, chaos_load) schedules them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from kvmesh.bench.workloads import Request, Workload


async def play(
    wl: Workload,
    one: Callable[[Request], Awaitable[None]],
    t0: float,
    scale: float = 1.0,
    workers: int = 0,
    stop: asyncio.Event | None = None,
) -> int:
    """Run `one` on every request of `wl`, each once its deps have finished and its delay has
    passed (times stretched `scale` times). Open loop (workers 0): each session starts at its
    arrival time after `t0`. Closed loop: `workers` workers, each taking the next session in
    arrival order until none is left or `stop` is set (a request due after that is skipped).
    The number of workers that ran out of sessions before `stop`."""
    done = {r.rid: asyncio.Event() for r in wl.requests}

    async def request(r: Request) -> None:
        try:
            for d in r.deps:
                await done[d].wait()
            if r.delay > 0:
                await asyncio.sleep(r.delay * scale)
            if stop is None or not stop.is_set():
                await one(r)
        finally:
            done[r.rid].set()

    async def session(reqs: list[Request]) -> None:
        await asyncio.gather(*(request(r) for r in reqs))

    sessions = wl.sessions()
    if not workers:
        tasks = []
        for s in sessions:
            await asyncio.sleep(max(0.0, t0 + s[0].at * scale - time.perf_counter()))
            tasks.append(asyncio.create_task(session(s)))
        await asyncio.gather(*tasks)
        return 0
    it = iter(sessions)  # workers share one iterator: each takes the next session

    async def worker() -> bool:
        for s in it:
            if stop is not None and stop.is_set():
                return False
            await session(s)
        return stop is None or not stop.is_set()

    return sum(await asyncio.gather(*(worker() for _ in range(workers))))
