"""Asynchronous tier loads, device-free: while a request's prefix loads (a test worker holds the
copy until released), the request waits in WAITING_FOR_REMOTE_KVS and the others keep decoding;
its blocks are neither free nor cached until the copy lands; an abort mid-load leaks nothing."""

from __future__ import annotations

from kvmesh.engine.emulation.runner import ModelledCopyWorker
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.kv_loads import AsyncKVLoads
from kvmesh.engine.offload import TierLoad
from kvmesh.engine.scheduler import Scheduler, SchedulerConfig
from kvmesh.engine.sequence import Request, RequestStatus, SamplingParams
from tests.test_tiers import FakeCopier, SteppedWorker

BS = 4
PROMPT = list(range(100, 121))  # 5 full blocks + 1 token


def setup(num_blocks: int = 16):
    kv = KVCacheManager(num_blocks, BS, enable_events=True)
    copier = FakeCopier()
    offloader = kv.enable_offloading([("CPU", 8), ("DISK", 32)], copier, bytes_per_block=1)
    worker = SteppedWorker(offloader.run_loads, delay=10**9)  # lands only on release()
    kv.loads = AsyncKVLoads(kv, worker)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)
    return kv, copier, worker, sched


def step(sched: Scheduler, kv: KVCacheManager, copier: FakeCopier) -> list[str]:
    """One engine step with 'compute' (each block filled takes its hash); who got a token."""
    out = sched.schedule()
    for item in out.scheduled:
        req, start = item.request, item.request.num_computed_tokens
        kv.update_block_hashes(req)
        table = kv.req_to_blocks[req.request_id]
        for i in range(start // BS, min((start + item.num_tokens) // BS, len(req.block_hashes))):
            copier.device[table[i].block_id] = req.block_hashes[i]
    sampled = {s.request.request_id: ([5], None) for s in out.scheduled if s.samples}
    progressed = sched.update_from_output(out, sampled)
    for req, _ in progressed:
        if req.num_output_tokens >= req.sampling.max_tokens:
            sched.finish(req, RequestStatus.FINISHED_LENGTH)
    kv.flush_offload()
    return [r.request_id for r, _ in progressed]


def drain(sched, kv, copier, worker) -> None:
    for _ in range(100):
        if not sched.has_work:
            return
        worker.release()
        step(sched, kv, copier)
    raise AssertionError("the workload did not finish")


def push_prompt_to_tiers(sched, kv, copier, worker) -> None:
    """PROMPT computed, then evicted by a prompt as long as the cache: only tiers hold it."""
    sched.add_request(Request("first", PROMPT, SamplingParams(max_tokens=1)))
    drain(sched, kv, copier, worker)
    sched.add_request(Request("filler", list(range(500, 564)), SamplingParams(max_tokens=1)))
    drain(sched, kv, copier, worker)
    probe = Request("probe", PROMPT, SamplingParams())
    kv.update_block_hashes(probe)
    assert kv.find_cached(probe.block_hashes) == [], "the prompt is still on the device"
    assert kv.offloader.lookup(probe.block_hashes) == 5


def check_clean(kv: KVCacheManager) -> None:
    kv.pool.check_invariants()
    kv.offloader.check_invariants()  # no tier entry is referenced any more
    kv.loads.check_invariants()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks, "device blocks leaked"
    assert not kv.loads.jobs and not kv.loads.held and not kv.loads.inflight


def test_others_decode_while_a_prefix_loads():
    kv, copier, worker, sched = setup()
    push_prompt_to_tiers(sched, kv, copier, worker)
    sched.add_request(Request("decoder", [7, 8, 9], SamplingParams(max_tokens=12)))
    assert step(sched, kv, copier) == ["decoder"]
    loader = Request("loader", PROMPT, SamplingParams(max_tokens=2))
    sched.add_request(loader)
    tokens = []
    for _ in range(5):  # the copy is held: the decoder keeps going, the loader waits
        tokens += step(sched, kv, copier)
        assert loader.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert sched.num_waiting == 1 and sched.has_work
    assert tokens == ["decoder"] * 5
    job = kv.loads.jobs[0]
    loading = job.blocks[job.start :]
    assert len(loading) == 5 and all(b.ref_cnt == 1 for b in loading)  # not free, not evictable
    assert all(b.block_hash is None for b in loading)  # not visible as cached yet
    kv.loads.check_invariants()
    worker.release()
    assert "decoder" in step(sched, kv, copier)  # the load lands; the loader is admitted
    assert loader.status == RequestStatus.RUNNING
    assert loader.num_cached_tokens == 20
    assert all(kv.pool.cached.get(b.block_hash) is b for b in loading)
    assert copier.loads and copier.loads[-1][1] == 5
    drain(sched, kv, copier, worker)
    check_clean(kv)


def test_a_second_request_waits_for_the_load_in_flight():
    kv, copier, worker, sched = setup()
    push_prompt_to_tiers(sched, kv, copier, worker)
    loads_before = len(copier.loads)
    a = Request("a", PROMPT, SamplingParams(max_tokens=1))
    b = Request("b", [*PROMPT[:-1], 999], SamplingParams(max_tokens=1))
    sched.add_request(a)
    sched.add_request(b)
    step(sched, kv, copier)
    assert a.status == b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(kv.loads.jobs) == 1, "the same blocks are loaded twice"
    drain(sched, kv, copier, worker)
    assert len(copier.loads) - loads_before == 1
    assert a.num_cached_tokens == b.num_cached_tokens == 20
    check_clean(kv)


def test_abort_while_loading_frees_everything_once_the_copy_ends():
    kv, copier, worker, sched = setup()
    push_prompt_to_tiers(sched, kv, copier, worker)
    sched.add_request(Request("decoder", [7, 8, 9], SamplingParams(max_tokens=6)))
    loader = Request("loader", PROMPT, SamplingParams(max_tokens=2))
    sched.add_request(loader)
    step(sched, kv, copier)
    assert loader.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    job = kv.loads.jobs[0]
    sched.finish(loader, RequestStatus.FINISHED_ABORTED)
    assert not sched.num_loading and loader.request_id not in sched.requests
    assert all(b.ref_cnt == 1 for b in job.blocks)  # the worker may still write them
    step(sched, kv, copier)
    assert kv.loads.jobs == [job]
    worker.release()
    drain(sched, kv, copier, worker)
    check_clean(kv)
    probe = Request("probe", PROMPT, SamplingParams())
    kv.update_block_hashes(probe)
    assert len(kv.find_cached(probe.block_hashes)) == 5  # the landed copy is still useful


def test_a_failed_copy_is_recomputed():
    kv, copier, worker, sched = setup()
    push_prompt_to_tiers(sched, kv, copier, worker)

    def broken(loads) -> None:
        raise OSError("disk gone")

    worker.run = broken
    loader = Request("loader", PROMPT, SamplingParams(max_tokens=1))
    sched.add_request(loader)
    drain(sched, kv, copier, worker)
    assert loader.status == RequestStatus.FINISHED_LENGTH and loader.num_cached_tokens == 0
    check_clean(kv)


class ClockRunner:
    def __init__(self) -> None:
        self.clock = 0.0
        self.last_step_time = 0.0

    def load_time(self, medium: str, num_blocks: int) -> float:
        return num_blocks * (0.5 if medium == "DISK" else 0.1)

    def idle(self, seconds: float) -> None:
        self.last_step_time = seconds
        self.clock += seconds


def test_emulated_loads_take_their_modelled_time_on_the_engine_clock():
    runner = ClockRunner()
    worker = ModelledCopyWorker(runner)
    first = worker.submit([TierLoad("DISK", [b"a"], [0], [3])])
    second = worker.submit([TierLoad("CPU", [b"b", b"c"], [1, 2], [4, 5])])  # queued behind
    assert not first.done() and (first.ready_at, second.ready_at) == (0.5, 0.7)
    runner.clock += 0.3  # a step runs meanwhile, overlapping the copy
    assert not first.done()
    worker.wait([first, second], timeout=0.01)  # nothing else to run: idle until it lands
    assert first.done() and not second.done() and runner.last_step_time == 0.2
