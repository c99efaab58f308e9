"""`kvmesh serve --data-parallel-size N` (internal LB): N rank processes behind one front door.

The parent hosts the ranks' rendezvous store, binds the front door first (so /health answers
503 "starting" until every rank serves), spawns the ranks (each dies with the parent), and
watches each rank's process sentinel on its event loop. Invariants: a rank that exits is out
of rotation at once; with expert parallelism (ranks in lockstep), or when no rank is left, the
server stops and exits 1 after FAIL_GRACE_S; SIGINT / SIGTERM stops every rank (SIGTERM, then
SIGKILL after STOP_GRACE_S) and exits 0. No rank outlives the parent.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import secrets
import sys
from multiprocessing.connection import wait as wait_any

from aiohttp import web

from kvmesh.engine.auth import EngineKeys, expect_gate
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.dp.frontdoor import FrontDoor
from kvmesh.engine.dp.rank import RankSpec, rank_config, rank_main
from kvmesh.engine.http_guard import GuardedRunner

logger = logging.getLogger(__name__)
FAIL_GRACE_S = 1.0  # error responses reach clients before the server goes
STOP_GRACE_S = 5.0
RANK_HOST = "127.0.0.1"  # ranks serve on private loopback ports


class Launcher:
    def __init__(self, config: EngineConfig, host: str, port: int) -> None:
        self.config, self.host, self.port = config, host, port
        self.size = config.data_parallel_size
        self.lockstep = config.enable_expert_parallel and self.size > 1
        self.door = FrontDoor(self.size)
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list = []
        self.done: asyncio.Future[int] | None = None

    def spawn(self, store_port: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(self.size):
            recv, send = ctx.Pipe(duplex=False)
            spec = RankSpec(RANK_HOST, 0, self.config.data_parallel_address, store_port, False)
            args = (rank_config(self.config, rank), spec, send, level)
            proc = ctx.Process(target=rank_main, args=args, name=f"kvmesh-dp{rank}", daemon=True)
            proc.start()
            send.close()
            self.procs.append(proc)
            self.conns.append(recv)

    def wait_ready(self, stopping) -> tuple[str | None, str]:
        """Block until every rank serves: (error or None, model name)."""
        pending = dict(enumerate(self.conns))
        model = ""
        while pending:
            if stopping():
                return "stopped", model
            sentinels = {self.procs[r].sentinel: r for r in pending}
            for ready in wait_any([*pending.values(), *sentinels], timeout=0.2):
                rank = sentinels.get(ready)  # type: ignore[call-overload]
                if rank is None:
                    rank = next(r for r, c in pending.items() if c is ready)
                    try:
                        message = ready.recv()
                    except EOFError:
                        message = ("error", "exited")
                    if message[0] != "ready":
                        return f"data-parallel rank {rank} failed to start: {message[1]}", model
                    self.door.mark_ready(rank, f"http://{RANK_HOST}:{message[1]}")
                    model = message[2]
                    del pending[rank]
                elif rank in pending:
                    code = self.procs[rank].exitcode
                    return f"data-parallel rank {rank} exited with code {code}", model
        return None, model

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        for rank, proc in enumerate(self.procs):
            loop.add_reader(proc.sentinel, self._exited, loop, rank)

    def _exited(self, loop: asyncio.AbstractEventLoop, rank: int) -> None:
        proc = self.procs[rank]
        loop.remove_reader(proc.sentinel)
        if self.done is None or self.done.done():
            return  # stopping: the ranks are being stopped
        proc.join(timeout=1.0)  # its sentinel is ready: it is exiting, if not yet reaped
        code = proc.exitcode
        self.door.mark_down(
            rank, f"killed by signal {-code}" if code and code < 0 else f"exited with code {code}"
        )
        if self.lockstep or not any(r.alive for r in self.door.ranks):
            why = "a rank in lockstep is gone" if self.lockstep else "no rank is left"
            logger.error("data-parallel server stopping: %s", why)
            loop.call_later(FAIL_GRACE_S, self._finish, 1)

    def _finish(self, code: int) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(code)

    def stop_ranks(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(timeout=STOP_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=STOP_GRACE_S)

    async def run(self) -> int:
        from kvmesh.engine.dp.group import host_store
        from kvmesh.engine.server import wait_for_shutdown

        loop = asyncio.get_running_loop()
        self.done = loop.create_future()
        stop = asyncio.ensure_future(wait_for_shutdown())
        stop.add_done_callback(lambda _: self._finish(0))
        gate = expect_gate(EngineKeys.of(self.config))  # the ranks check the key again
        runner = GuardedRunner(self.door.build_app(), gate=gate)
        await runner.setup()
        try:
            try:
                await web.TCPSite(runner, self.host, self.port).start()
                port = runner.addresses[0][1]
                address = self.config.data_parallel_address
                store = host_store(address, self.config.data_parallel_rpc_port or 0)
            except (OSError, RuntimeError) as exc:  # a port taken (HTTP or rendezvous)
                print(f"kvmesh serve: {exc}", file=sys.stderr, flush=True)
                return 1
            self.spawn(store.port)
            error, model = await asyncio.to_thread(self.wait_ready, self.done.done)
            if error is not None:
                if error != "stopped":
                    print(f"kvmesh serve: {error}", file=sys.stderr, flush=True)
                    return 1
                return self.done.result()
            self.watch(loop)
            print(
                f"kvmesh engine ready: http://{self.host}:{port}/v1  (model {model}, "
                f"data-parallel size {self.size})",
                flush=True,
            )
            return await self.done
        finally:
            stop.cancel()
            await runner.cleanup()
            await asyncio.to_thread(self.stop_ranks)


def serve_data_parallel(config: EngineConfig, host: str, port: int) -> int:
    """Serve N ranks behind one front door on host:port until stopped; the exit code."""
    from kvmesh.engine.server import run

    if not config.prefix_caching_hash_algo.startswith("sha256"):
        # xxhash roots its chain in a per-process seed unless PYTHONHASHSEED is set: the ranks
        # must share one (protocol.hashing.none_hash), and they inherit this environment
        os.environ.setdefault("PYTHONHASHSEED", str(secrets.randbelow(2**32)))
    result: list[int] = []

    async def main() -> None:
        result.append(await Launcher(config, host, port).run())

    run(main())
    return result[0] if result else 0
