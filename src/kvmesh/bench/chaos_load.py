"""The load of `kvmesh bench chaos`: closed-loop agentic sessions through the router, each
request streamed by the load client (`loadgen.send`) and retried only as the OpenAI SDK retries
a connection error, while the router process was down or was killed under it."""

from __future__ import annotations

import argparse
import asyncio

from kvmesh.bench import loadgen
from kvmesh.bench.chaos_procs import State
from kvmesh.bench.chaos_report import Result
from kvmesh.bench.session_loop import play

RETRYABLE = ("ClientConnectorError", "ServerDisconnectedError", "ClientOSError")


async def request(http, url: str, model, text: str, r, st: State, k: float, limit: float):
    """One streaming request through the router. A transport failure before any token while
    the router process was down, or was killed during the attempt, is retried (the request
    never reached a live router); every other failure stands."""
    start, retries = st.now(), 0
    while True:
        gen = st.router_gen
        rec = await loadgen.send(http, url, model, text, r, st.t0, k)
        gone = st.router_down or st.router_gen != gen
        transport = rec.error.split(":", 1)[0] in RETRYABLE
        if rec.error and not rec.ttft and gone and transport and st.now() - start < limit:
            retries += 1
            await asyncio.sleep(0.05)
            continue
        # as the user sees it: from the first attempt (rec.start and rec.ttft are divided by k)
        ttft = (rec.start + rec.ttft - start / k) * 1000 if rec.ttft else None
        return Result(
            round(start, 3), round(st.now(), 3), ttft, rec.prompt_tokens, rec.cached_tokens,
            rec.error, rec.endpoint, retries, round(rec.start * k, 3) if retries else None,
        )  # fmt: skip


async def drive(http, url: str, model, wl, args: argparse.Namespace, st: State) -> None:
    """Closed loop: --concurrency workers, each running whole sessions (a request after its
    deps and think time) until the timeline ends; requests in flight then run to their end."""
    k, limit = args.emulate_time_scale, args.request_timeout * args.emulate_time_scale

    async def one(r) -> None:
        st.results.append(await request(http, url, model, wl.text(r), r, st, k, limit))

    ran_out = await play(wl, one, st.t0, k, args.concurrency, st.stop)
    st.notes += ["a worker ran out of sessions before the timeline ended"] * ran_out
