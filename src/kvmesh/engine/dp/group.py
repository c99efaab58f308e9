"""The ranks' process group: a TCPStore rendezvous (hosted by the front door, or by rank 0 when
each rank is its own server), the world group for expert parallelism (gloo on CPU, NCCL when
every rank has its own CUDA device) and a gloo control group for the lockstep agreement.

Invariants: every collective times out after COLLECTIVE_TIMEOUT_S (a dead peer fails it at once:
its sockets close), so a rank never waits forever; ranks join only once all N are present, so a
slow model load never trips a collective's timeout.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0  # longest step a peer may take before the others give up on it
RENDEZVOUS_TIMEOUT_S = 900.0  # ranks load their models before they join: large ones take minutes
JOINED_KEY = "kvmesh_dp_joined"


@dataclass(slots=True)
class DataParallelGroup:
    rank: int
    size: int
    backend: str
    world: dist.ProcessGroup  # expert dispatch / combine
    control: dist.ProcessGroup  # gloo, CPU tensors: the per-step agreement

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def host_store(address: str, port: int) -> dist.TCPStore:
    """The rendezvous store, listening on address:port (0: a free port, read back from .port)."""
    return dist.TCPStore(
        address,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
    )


def rank_device(device: str, rank: int) -> str:
    """A rank's torch device: plain "cuda" spreads ranks over the visible GPUs."""
    if device == "cuda" and torch.cuda.is_available():
        return f"cuda:{rank % torch.cuda.device_count()}"
    return device


def backend_for(device: str, size: int) -> str:
    """NCCL needs one device per rank; otherwise gloo (CPU, or ranks sharing a GPU)."""
    if device.startswith("cuda") and torch.cuda.device_count() >= size:
        return "nccl"
    return "gloo"


def join(
    rank: int,
    size: int,
    address: str,
    port: int,
    device: str,
    store: dist.Store | None = None,
) -> DataParallelGroup:
    """Join the group as `rank` of `size`: meet at the store on address:port (or the given
    store), wait until all ranks are there, then make the world and control groups."""
    if store is None:
        store = dist.TCPStore(
            address,
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
        )
    store.add(JOINED_KEY, 1)
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while (joined := store.add(JOINED_KEY, 0)) < size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {joined} of {size} data-parallel ranks joined {address}")
        time.sleep(0.05)
    backend = backend_for(device, size)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    prefixed = dist.PrefixStore("kvmesh_dp", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    world = dist.group.WORLD
    assert world is not None
    logger.info("data-parallel rank %d of %d joined the %s group", rank, size, backend)
    return DataParallelGroup(rank, size, backend, world, control or world)
