"""One data-parallel rank: its own engine (scheduler, block pool, prefix cache, KV cache) and
HTTP server, in the ranks' process group. A child of the front door (internal LB, on a private
loopback port) or a server of its own (external LB: `--data-parallel-rank R`, on --port).

Invariant: a rank whose engine can no longer step (a lockstep peer is gone) fails its requests,
answers /health with 503 and exits 1 within FAIL_GRACE_S; it never waits on a dead peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import sys
from typing import NamedTuple

from kvmesh.engine.config import EngineConfig

logger = logging.getLogger(__name__)
FAIL_GRACE_S = 0.5  # after a failure, time for the error responses to reach clients
PR_SET_PDEATHSIG = 1


class RankSpec(NamedTuple):
    """Where one rank serves and meets its peers."""

    host: str  # HTTP bind address
    port: int  # HTTP port (0: any free one, reported through `ready`)
    store_address: str  # the rendezvous store
    store_port: int
    host_store: bool  # this rank hosts the store (rank 0 of an external-LB group)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The rank's own config: its rank, its device, its share of the CPU cores."""
    from kvmesh.engine.dp.group import rank_device

    threads = config.num_threads
    if threads is None and config.device == "cpu":
        cores = len(os.sched_getaffinity(0))
        threads = max(1, cores // config.data_parallel_size)
    return dataclasses.replace(
        config,
        data_parallel_rank=rank,
        device=rank_device(config.device, rank),
        num_threads=threads,
    )


def expert_parallel_config(config: EngineConfig, group):
    """The model's ExpertParallelConfig of this rank (None without --enable-expert-parallel)."""
    if not config.enable_expert_parallel:
        return None
    from kvmesh.engine.models.expert_parallel import ExpertParallelConfig

    redundant = config.eplb().num_redundant_experts if config.enable_eplb else 0
    return ExpertParallelConfig(
        rank=group.rank,
        world_size=group.size,
        group=group.world if group.size > 1 else None,
        placement=config.expert_placement_strategy,
        num_redundant_experts=redundant,
    )


def build_rank(config: EngineConfig, spec: RankSpec):
    """Join the group, then build the engine on it: (bundle, group, the store if hosted here,
    which must live as long as the rank serves)."""
    from kvmesh.engine.builder import build_engine
    from kvmesh.engine.dp import group as dp_group
    from kvmesh.engine.dp.experts import ExpertLoadReporter
    from kvmesh.engine.dp.lockstep import Lockstep

    store = None
    if spec.host_store:
        store = dp_group.host_store(spec.store_address, spec.store_port)
    group = dp_group.join(
        config.data_parallel_rank,
        config.data_parallel_size,
        spec.store_address,
        spec.store_port,
        config.device,
        store,
    )
    bundle = build_engine(config, expert_parallel_config(config, group))
    if config.enable_expert_parallel and group.size > 1:
        lockstep = Lockstep(group, bundle.metrics)
        bundle.engine.lockstep, bundle.engine.core.lockstep = lockstep, True
        model = bundle.engine.core.runner.model
        if hasattr(model, "moe_layers"):
            eplb = config.eplb() if config.enable_eplb else None
            lockstep.hooks.append(ExpertLoadReporter(model, bundle.metrics, eplb).after_step)
        else:
            logger.warning("no MoE layers to shard; the ranks step in lockstep all the same")
    return bundle, group, store


async def serve_rank(config: EngineConfig, spec: RankSpec, ready=None) -> int:
    """Build the rank, serve until SIGTERM / SIGINT (0) or until its engine fails (1)."""
    from kvmesh.engine.server import start_server, wait_for_shutdown

    loop = asyncio.get_running_loop()
    bundle, group, _store = await asyncio.to_thread(build_rank, config, spec)
    failed = asyncio.Event()
    bundle.engine.on_failure = lambda message: loop.call_soon_threadsafe(failed.set)
    runner = await start_server(bundle, spec.host, spec.port)
    port = runner.addresses[0][1]
    rank = config.data_parallel_rank
    if ready is not None:  # a child of the front door, which prints the one ready line
        ready.send(("ready", port, bundle.model_name))
    else:
        print(f"kvmesh data-parallel rank {rank} ready: http://{spec.host}:{port}/v1", flush=True)
    stop = asyncio.ensure_future(wait_for_shutdown())
    fail = asyncio.ensure_future(failed.wait())
    try:
        await asyncio.wait((stop, fail), return_when=asyncio.FIRST_COMPLETED)
        if fail.done():
            logger.error("data-parallel rank %d failed: %s", rank, bundle.engine.failed)
            await asyncio.sleep(FAIL_GRACE_S)
            return 1
        return 0
    finally:
        stop.cancel()
        fail.cancel()
        await runner.cleanup()
        if bundle.engine.failed is None:
            group.leave()  # after a peer died its sockets are gone: nothing to tear down


def run_rank(config: EngineConfig, spec: RankSpec, ready=None) -> int:
    """Serve one rank in this process (an external-LB server): its exit code."""
    from kvmesh.engine.server import run

    result: list[int] = []

    async def main() -> None:
        result.append(await serve_rank(config, spec, ready))

    run(main())
    return result[0] if result else 0


def rank_main(config: EngineConfig, spec: RankSpec, ready, log_level: int) -> None:
    """Entry of a rank child process (spawned): it dies with its parent, never outlives it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = run_rank(config, spec, ready)
    except Exception as exc:  # reported to the parent, which exits with a message
        logger.exception("data-parallel rank %d failed to start", config.data_parallel_rank)
        with contextlib.suppress(OSError):
            ready.send(("error", f"{type(exc).__name__}: {exc}"))
        code = 1
    sys.exit(code)
