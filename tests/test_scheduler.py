"""Scheduler behaviour on the device-free core: budgets, chunking, prefix hits, preemption."""

from __future__ import annotations

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.scheduler import Scheduler, SchedulerConfig
from kvmesh.engine.sequence import Request, RequestStatus, SamplingParams


def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_events=True)
    return Scheduler(SchedulerConfig(**cfg), kv)


def req(rid: str, n: int, start: int = 0, **kw) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=100), **kw)


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {x.request.request_id: ([token], None) for x in out.scheduled if x.samples}
    s.update_from_output(out, sampled)
    return out


def test_token_budget_and_chunked_prefill():
    s = make(max_num_batched_tokens=10)
    s.add_request(req("a", 25))
    sizes = [step(s).num_tokens for _ in range(3)]
    assert sizes == [10, 10, 5]
    r = s.requests["a"]
    assert r.num_output_tokens == 1 and r.num_computed_tokens == 25
    assert step(s).scheduled[0].num_tokens == 1  # decode


def test_prefix_hit_skips_full_blocks_but_computes_last_token():
    s = make()
    s.add_request(req("a", 12))
    step(s)
    s.finish(s.requests["a"], RequestStatus.FINISHED_STOPPED)
    s.add_request(req("b", 12))  # identical prompt: 3 full blocks cached, last token recomputed
    out = step(s)
    assert out.scheduled[0].num_tokens == 4
    assert s.requests["b"].num_cached_tokens == 8
    s.add_request(req("c", 14))  # longer prompt sharing 12 tokens: all 3 blocks hit
    out = step(s)
    item = [x for x in out.scheduled if x.request.request_id == "c"][0]
    assert item.num_tokens == 2 and s.requests["c"].num_cached_tokens == 12


def test_max_num_seqs_limits_running():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 4, start=100 * i))
    out = step(s)
    assert len(out.scheduled) == 2 and s.num_waiting == 1


def test_preemption_when_blocks_run_out_then_recovery():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add_request(req("a", 8, start=0))
    s.add_request(req("b", 8, start=50))
    step(s)  # each holds 2 blocks for its 8 prompt tokens, and samples a 9th token
    out = step(s)  # both decode position 8: a third block each, only one fits
    assert [r.request_id for r in out.preempted] == ["b"]
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert s.requests["b"].num_computed_tokens == 0 and s.num_preemptions == 1
    s.finish(s.requests["a"], RequestStatus.FINISHED_STOPPED)
    out = step(s)
    assert out.scheduled[0].request.request_id == "b"  # recomputed, its output kept
    assert s.requests["b"].output_token_ids[0] == 7
    s.kv.pool.check_invariants()


def test_priority_policy_admits_lowest_value_first_and_preempts_highest():
    s = make(max_num_seqs=1, policy="priority")
    s.add_request(req("low", 4, start=0, priority=5))
    s.add_request(req("high", 4, start=10, priority=0))
    out = step(s)
    assert out.scheduled[0].request.request_id == "high"


def test_finish_frees_blocks_and_emits_stored_events():
    s = make(block_size=4)
    s.add_request(req("a", 9))
    step(s)
    events = s.kv.take_events()
    assert len(events) == 1 and events[0].token_ids == list(range(8))
    assert len(events[0].block_hashes) == 2
    s.finish(s.requests["a"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks
    assert not s.has_work
