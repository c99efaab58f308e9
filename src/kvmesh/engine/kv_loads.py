"""Asynchronous tier loads: a prefix found in a lower tier is copied to the device on a copy
worker while the request waits (vLLM's WAITING_FOR_REMOTE_KVS) and the others keep decoding.

A load job owns, from start to end, references on
- the request's device hits before the loaded blocks (they must survive to be its prefix),
- the fresh device blocks being written (never free, so never evicted or reused meanwhile),
- the tier entries being read (`prepare_load`, so never evicted: their slots stay intact).
The fresh blocks are registered in the prefix cache only once the copy has ended, so no other
request can see them half-written. A finished job's device references pass to the request
(`held`) until its next admission attempt, which takes its own references; an aborted request's
job is freed when its copy ends (not before: the worker may still be writing the blocks).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.engine.block_pool import KVCacheBlock
from kvmesh.engine.kv_cache_manager import ComputedBlocks
from kvmesh.engine.offload import TierLoad
from kvmesh.engine.sequence import Request
from kvmesh.protocol.hashing import event_extra_keys

if TYPE_CHECKING:
    from kvmesh.engine.kv_cache_manager import KVCacheManager

logger = logging.getLogger(__name__)

WAIT_S = 0.01  # longest idle wait for a copy, so new arrivals are not kept waiting


class ThreadCopyWorker:
    """One background thread that runs loads in submission order (torch copies and file reads
    release the GIL, so the engine thread keeps stepping meanwhile)."""

    def __init__(
        self, run: Callable[[Sequence[TierLoad]], None], init: Callable[[], None] | None = None
    ) -> None:
        self.run = run
        self.init = init  # called first on the worker thread (e.g. its torch thread count)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def submit(self, loads: Sequence[TierLoad]) -> cf.Future:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="kvmesh-kv-load", daemon=True)
            self.thread.start()
        fut: cf.Future = cf.Future()
        self.jobs.put((fut, loads))
        return fut

    def _loop(self) -> None:
        if self.init is not None:
            self.init()
        while True:
            fut, loads = self.jobs.get()
            try:
                self.run(loads)
            except BaseException as exc:  # reported to the scheduler, which recomputes instead
                fut.set_exception(exc)
            else:
                fut.set_result(None)

    def wait(self, handles: list, timeout: float) -> None:
        cf.wait(handles, timeout=timeout, return_when=cf.FIRST_COMPLETED)


@dataclass(slots=True, eq=False)
class LoadJob:
    request: Request  # whose hashes and tokens the blocks are registered with
    blocks: list[KVCacheBlock]  # device hits, then the blocks being loaded; all referenced
    start: int  # index of the first loaded block in the request's block hashes
    block_hashes: list[bytes]  # the loaded blocks' hashes
    loads: list[TierLoad]
    handle: cf.Future
    owner: Request | None  # None once its request is aborted: freed when the copy ends
    waiters: list[Request] = field(default_factory=list)  # requests resumed when it ends


class AsyncKVLoads:
    def __init__(self, kv: KVCacheManager, worker) -> None:
        assert kv.offloader is not None, "async loads need offload tiers"
        self.kv = kv
        self.worker = worker  # submit(loads) -> future-like (done(), exception()); wait()
        self.jobs: list[LoadJob] = []  # in flight, in submission order
        self.inflight: dict[bytes, LoadJob] = {}  # hash being loaded -> its job
        self.waiting_on: dict[str, LoadJob] = {}  # WAITING_FOR_REMOTE_KVS request -> job
        self.held: dict[str, list[KVCacheBlock]] = {}  # finished loads' refs, per request
        self.failed: set[str] = set()  # requests whose load failed: they recompute
        self.num_loaded_blocks = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting_on)

    @property
    def busy(self) -> bool:
        """Requests wait for loads, or copies are still running (an aborted request's too)."""
        return bool(self.waiting_on or self.jobs)

    def computed_or_park(self, request: Request) -> ComputedBlocks | None:
        """The device prefix to admit the request with, or None when it must first wait for a
        load: started now for its blocks in lower tiers, or already in flight for another."""
        kv = self.kv
        if not kv.enable_caching:
            return ComputedBlocks([], 0)
        kv.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // kv.block_size
        hashes = request.block_hashes[:max_blocks]
        hits = kv.find_cached(hashes)
        if len(hits) < max_blocks and request.request_id not in self.failed:
            job = self.inflight.get(hashes[len(hits)]) or self._start(request, hits, hashes)
            if job is not None:
                self.release(request)  # a new job holds what it needs
                self.waiting_on[request.request_id] = job
                job.waiters.append(request)
                return None
        return ComputedBlocks(hits, len(hits) * kv.block_size)

    def _start(self, request: Request, hits: list[KVCacheBlock], hashes: list[bytes]):
        kv, offloader = self.kv, self.kv.offloader
        assert offloader is not None
        kv.flush_offload()  # before the lookup: queued stores may evict tier entries
        start = len(hits)
        n = 0
        for h in hashes[start:]:  # stop at blocks another job is loading
            if h in self.inflight or not any(h in t for t in offloader.tiers):
                break
            n += 1
        n = min(n, kv.pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0))
        if n <= 0:
            return None
        kv.pool.touch(hits)  # the hits must survive the allocation and the copy
        new = kv.pool.get_new_blocks(n)
        wanted = hashes[start : start + n]
        loads = offloader.prepare_load(wanted, [b.block_id for b in new])
        job = LoadJob(request, hits + new, start, wanted, loads, self.worker.submit(loads), request)
        self.jobs.append(job)
        for h in wanted:
            self.inflight[h] = job
        return job

    def poll(self) -> list[Request]:
        """End the jobs whose copy is done; the requests that waited for them, to resume."""
        resumed: list[Request] = []
        for job in [j for j in self.jobs if j.handle.done()]:
            self.jobs.remove(job)
            for h in job.block_hashes:
                del self.inflight[h]
            error = job.handle.exception()
            self.kv.offloader.complete_load(job.loads, ok=error is None)
            if error is None:
                self._register(job)
                self.num_loaded_blocks += len(job.block_hashes)
            else:
                logger.warning(
                    "KV load for %s failed (%s); recomputing", job.request.request_id, error
                )
                self.failed.update(r.request_id for r in job.waiters)
            if job.owner is not None and error is None:
                self.held[job.owner.request_id] = job.blocks  # until its admission attempt
            else:
                self.kv.pool.free_blocks(reversed(job.blocks))
            for request in job.waiters:
                del self.waiting_on[request.request_id]
                resumed.append(request)
        return resumed

    def _register(self, job: LoadJob) -> None:
        req, end = job.request, job.start + len(job.block_hashes)
        extra = None
        if req.cache_salt is not None:
            extra = [event_extra_keys(i, cache_salt=req.cache_salt) for i in range(end)]
        self.kv.pool.cache_full_blocks(
            job.blocks, req.block_hashes, job.start, end, req.all_token_ids, extra, req.lora_name
        )

    def wait(self, timeout: float = WAIT_S) -> None:
        """Nothing else to schedule: wait (a while at most) for the first copy to end."""
        if self.jobs:
            self.worker.wait([j.handle for j in self.jobs], timeout)

    def release(self, request: Request) -> None:
        """Drop the references a finished load holds for the request (idempotent)."""
        blocks = self.held.pop(request.request_id, None)
        if blocks:
            self.kv.pool.free_blocks(reversed(blocks))

    def release_all(self) -> None:
        """Admission stopped on a full cache: waiting requests keep no blocks from anyone."""
        for rid in list(self.held):
            blocks = self.held.pop(rid)
            self.kv.pool.free_blocks(reversed(blocks))

    def forget(self, request: Request) -> None:
        """The request ends (idempotent): it stops waiting, and its own job's blocks are freed
        when the copy ends, not before (the worker may still be writing them)."""
        job = self.waiting_on.pop(request.request_id, None)
        if job is not None:
            job.waiters.remove(request)
            if job.owner is request:
                job.owner = None
        self.release(request)
        self.failed.discard(request.request_id)

    def check_invariants(self) -> None:
        assert all(b.ref_cnt > 0 for j in self.jobs for b in j.blocks), "a loading block is free"
        assert all(b.block_hash is None for j in self.jobs for b in j.blocks[j.start :])
        assert all(b.ref_cnt > 0 for blocks in self.held.values() for b in blocks)
        assert set(self.inflight.values()) <= set(self.jobs)
