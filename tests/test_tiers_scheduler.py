"""The real scheduler over a tiny device cache with host and disk tiers, under random concurrent
workloads (chunked prefill, decode, preemption, finishes): after every step each cached block,
on the device or in a tier, holds exactly the tokens its hash names, and nothing leaks. Loads run
inline, or asynchronously on a test worker whose copies land a chosen number of steps later (a
block registered before its copy has landed would hold other tokens, and fail the check)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.kv_loads import AsyncKVLoads
from kvmesh.engine.scheduler import Scheduler, SchedulerConfig
from kvmesh.engine.sequence import Request, RequestStatus, SamplingParams
from tests.test_tiers import FakeCopier, SteppedWorker

BS = 4
PREFIXES = [[100 * k + i for i in range(10)] for k in range(1, 4)]


def run(
    requests: list[tuple[int, int, int]],
    device: int,
    cpu: int,
    disk: int,
    budget: int,
    delay: int | None = None,
):
    kv = KVCacheManager(device, BS, enable_events=True)
    copier = FakeCopier()
    tiers = [("CPU", cpu)] + ([("DISK", disk)] if disk else [])
    offloader = kv.enable_offloading(tiers, copier, bytes_per_block=1)
    worker = None
    if delay is not None:  # async loads, landing `delay` steps after they start
        worker = SteppedWorker(offloader.run_loads, delay)
        kv.loads = AsyncKVLoads(kv, worker)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget), kv)
    truth: dict[bytes, tuple[int, ...]] = {}  # block hash -> the token prefix it stands for
    for n, (prefix, tail, out) in enumerate(requests):
        tokens = PREFIXES[prefix] + [7] * tail + [1000 + n]
        sched.add_request(Request(f"r{n}", tokens, SamplingParams(max_tokens=out)))
    for _ in range(400):
        if not sched.has_work:
            break
        step = sched.schedule()
        if worker is not None:
            worker.tick()
            if step.empty and sched.num_loading:
                kv.loads.wait()
        for item in step.scheduled:  # "compute": a block filled this step takes its tokens
            req, start = item.request, item.request.num_computed_tokens
            end = start + item.num_tokens
            table = kv.req_to_blocks[req.request_id]
            for i in range(start // BS, end // BS):
                copier.device[table[i].block_id] = tuple(req.all_token_ids[: (i + 1) * BS])
        sampled = {s.request.request_id: ([5], None) for s in step.scheduled if s.samples}
        progressed = sched.update_from_output(step, sampled)
        for item in step.scheduled:
            req = item.request
            for i, h in enumerate(req.block_hashes):
                truth[h] = tuple(req.all_token_ids[: (i + 1) * BS])
        for req, _ in progressed:
            if req.num_output_tokens >= req.sampling.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
        kv.flush_offload()
        check(kv, copier, truth)
    assert not sched.has_work, "the workload did not finish"
    assert kv.pool.num_free_blocks == kv.pool.num_blocks, "device blocks leaked"
    return kv


def check(kv: KVCacheManager, copier: FakeCopier, truth: dict) -> None:
    kv.pool.check_invariants()
    if kv.loads is not None:
        kv.loads.check_invariants()
    if kv.loads is None or not kv.loads.jobs:
        kv.offloader.check_invariants()
    for h, block in kv.pool.cached.items():
        assert copier.device[block.block_id] == truth[h], "device block holds other tokens"
    for tier in kv.offloader.tiers:
        for h, entry in tier.entries.items():
            assert copier.tiers[tier.medium][entry.slot] == truth[h], f"{tier.medium} corrupt"
            assert list(truth[h][-BS:]) == list(entry.token_ids)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 9), st.integers(1, 6)),
        min_size=1,
        max_size=12,
    ),
    st.integers(8, 16),
    st.integers(1, 10),
    st.integers(0, 16),
    st.sampled_from([4, 8, 32]),
    st.sampled_from([None, 0, 1, 3]),
)
def test_scheduler_with_tiers_keeps_every_block_true(requests, device, cpu, disk, budget, delay):
    run(requests, device, cpu, disk, budget, delay)


def test_a_repeated_prefix_is_loaded_after_eviction():
    for delay in (None, 0, 2):
        workload = [(0, 9, 2), (1, 9, 2), (2, 9, 2), (0, 9, 2)]
        kv = run(workload, device=8, cpu=16, disk=0, budget=32, delay=delay)
        assert kv.offloader.tiers[0].hit_blocks > 0
        assert delay is None or kv.loads.num_loaded_blocks > 0
