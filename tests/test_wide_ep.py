"""Wide expert parallelism in the emulator: the DP/EP and TP instance rooflines, the lockstep DP
group of real engine schedulers, and `kvmesh bench ep`."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.bench.ep_bench import decode_only
from kvmesh.bench.ep_load import ClosedLoop, Traffic
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.emulation.dp_group import DPGroup, pick_dp_rank
from kvmesh.engine.emulation.expert_load import ExpertRouting, expert_placement
from kvmesh.engine.emulation.instance_roofline import draft_loads, rank_load
from kvmesh.engine.emulation.latency import ACCELERATORS, LINKS, MODELS, SequenceWork
from kvmesh.engine.emulation.wide_ep import TensorParallelRoofline, WideEPRoofline
from kvmesh.engine.emulation.work import draft_passes
from kvmesh.engine.sequence import Request, SamplingParams

H200, GLM = ACCELERATORS["h200"], MODELS["glm-5.2-moe"]


def decode(batch: int, context: int = 3072) -> list[SequenceWork]:
    return [SequenceWork(1, context)] * batch


def test_more_skew_makes_a_slower_step():
    works = [decode(64)] * 16
    costs = [
        WideEPRoofline(H200, GLM, 16, ExpertRouting("zipf", s)).step_cost(works)
        for s in (0.0, 0.5, 1.0)
    ]
    assert costs[0].time < costs[1].time < costs[2].time
    assert costs[0].imbalance < costs[1].imbalance < costs[2].imbalance
    uniform = WideEPRoofline(H200, GLM, 16).step_cost(works)
    assert uniform.time == costs[0].time  # Zipf with s = 0 is uniform
    assert 1.0 < uniform.imbalance < 1.1  # only the binomial spread of 8,192 tokens' picks


def test_small_batches_are_less_balanced_than_large_ones():
    ep = WideEPRoofline(H200, GLM, 32)
    imbalance = [ep.step_cost([decode(b)] * 32).imbalance for b in (1, 8, 64)]
    assert imbalance[0] > imbalance[1] > imbalance[2] > 1.0


def test_an_idle_rank_still_pays_the_collectives_and_its_weights():
    ep = WideEPRoofline(H200, GLM, 16, step_overhead=0.0)
    cost = ep.step_cost([decode(1)] + [[]] * 15)
    assert cost.idle_ranks == 15
    collectives = 2 * GLM.num_moe_layers * LINKS["ib-400g"].latency
    assert cost.comm >= collectives
    dense = GLM.dense_active_params * GLM.bytes_per_param / (H200.mem_bandwidth * H200.mbu)
    assert cost.time >= collectives + dense
    # a step of one rank costs as much as the same work with every rank busy at one token
    assert cost.time == pytest.approx(ep.step_cost([decode(1)] * 16).time, rel=0.05)
    assert ep.step_cost([[]] * 16).time == 0.0  # no rank has work: no step at all


def test_inter_node_links_are_slower_than_nvlink():
    assert LINKS["ib-400g"].bandwidth < LINKS["nvlink4"].bandwidth
    assert LINKS["ib-400g"].latency > LINKS["nvlink4"].latency
    works = [decode(128)] * 16
    two_nodes = WideEPRoofline(H200, GLM, 16).step_cost(works)
    one_domain = WideEPRoofline(H200, GLM, 16, gpus_per_node=16).step_cost(works)
    assert one_domain.comm < two_nodes.comm / 4
    assert one_domain.time < two_nodes.time
    assert one_domain.compute == pytest.approx(two_nodes.compute)


def test_step_time_grows_with_the_batch_and_its_context():
    ep = WideEPRoofline(H200, GLM, 16)
    times = [ep.step_time([decode(b)] * 16) for b in (1, 16, 64, 256)]
    assert times == sorted(times) and times[0] < times[-1]
    assert ep.step_time([decode(64, 1000)] * 16) < ep.step_time([decode(64, 8000)] * 16)


def test_dp_ep_beats_tp_per_gpu_at_high_concurrency_not_at_one():
    args = argparse.Namespace(max_num_seqs=256)
    tp, ep = TensorParallelRoofline(H200, GLM, 8), WideEPRoofline(H200, GLM, 16)
    one_tp, one_ep = decode_only(tp, 1, 3072, args), decode_only(ep, 1, 3072, args)
    # one stream: a single EP rank reads all the dense weights that TP splits 8 ways
    assert one_ep["step_ms"] > one_tp["step_ms"]
    assert one_ep["tok_s_per_gpu"] < one_tp["tok_s_per_gpu"]
    many_tp, many_ep = decode_only(tp, 2048, 3072, args), decode_only(ep, 2048, 3072, args)
    # MLA's latent KV is whole on every TP GPU: TP8 holds a fraction of the 2,048 users
    assert many_tp["running"] < 2048 // 8 < many_ep["running"] == 2048
    assert many_ep["tok_s_per_gpu"] > many_tp["tok_s_per_gpu"]


def test_capacity_follows_memory_minus_the_weights_each_gpu_holds():
    usable = H200.memory_bytes * 0.9
    tp = TensorParallelRoofline(H200, GLM, 8)
    assert tp.kv_capacity_bytes() == pytest.approx(usable - GLM.weight_bytes / 8)  # not x 8
    ep = WideEPRoofline(H200, GLM, 16)
    dense = (GLM.total_params - GLM.expert_params) * GLM.bytes_per_param
    assert ep.kv_capacity_bytes() == pytest.approx(usable - dense - GLM.expert_params / 16)
    with pytest.raises(ValueError, match="does not fit"):
        WideEPRoofline(ACCELERATORS["h100"], GLM, 8)
    with pytest.raises(ValueError, match="does not fit"):
        TensorParallelRoofline(ACCELERATORS["h100"], GLM, 8)
    with pytest.raises(ValueError, match="no routed experts"):
        WideEPRoofline(H200, MODELS["llama-3.1-8b"], 8)


def test_placement_and_routing():
    assert list(expert_placement(8, 4, "linear")) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list(expert_placement(8, 4, "round_robin")) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert Counter(expert_placement(10, 4)) == {0: 3, 1: 3, 2: 2, 3: 2}
    with pytest.raises(ValueError, match="placement"):
        expert_placement(8, 4, "random")
    with pytest.raises(ValueError, match="EP size"):
        expert_placement(8, 9)
    p = ExpertRouting("zipf", 1.2, seed=3).probabilities(5, 64)
    assert np.allclose(p.sum(axis=1), 1.0) and p.max() > 10 / 64
    assert not np.array_equal(p[0], p[1])  # each layer has its own hot experts
    with pytest.raises(ValueError):
        ExpertRouting("pareto")


def test_balancer_is_vllms_internal_lb():
    assert pick_dp_rank([(0, 3), (1, 0), (0, 2)]) == 2  # scores 3, 4, 2
    assert pick_dp_rank([(0, 1), (0, 1), (0, 0)]) == 2
    assert pick_dp_rank([(0, 0), (0, 0)]) == 0  # a tie goes to the first
    assert pick_dp_rank([(0, 0), (0, 0)], start=1) == 1


def _group(tokenizer, dp: int = 8) -> DPGroup:
    config = EngineConfig(block_size=64, max_num_seqs=32, max_num_batched_tokens=1024)
    return DPGroup(WideEPRoofline(H200, GLM, dp), config, tokenizer)


def _request(rid: str, n: int, max_tokens: int) -> Request:
    prompt = [20000 + int(rid[1:])] + list(range(300, 300 + n - 1))  # no two share a block
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_group_honours_the_balancer_and_the_named_rank(tokenizer):
    group = _group(tokenizer)
    ranks = [group.add_request(_request(f"r{i}", 100, 4)) for i in range(16)]
    assert ranks == list(range(8)) * 2  # each waits on its rank: 4 x waiting spreads them
    assert group.add_request(_request("r99", 100, 4), dp_rank=5) == 5
    assert [w for w, _ in group.counts()] == [2, 2, 2, 2, 2, 3, 2, 2]
    with pytest.raises(ValueError, match="out of range"):
        group.add_request(_request("r98", 100, 4), dp_rank=8)


def test_lockstep_group_finishes_every_request_exactly_once(tokenizer):
    group = _group(tokenizer)
    lengths = {f"r{i}": (50 + 37 * i, 1 + i % 5) for i in range(11)}  # ranks 3..7 run twice
    for rid, (n, out) in lengths.items():
        group.add_request(_request(rid, n, out))
    finished, tokens, elapsed, idle_steps = Counter(), Counter(), 0.0, 0
    while group.has_work():
        step = group.step()
        assert step.time > 0
        elapsed += step.time
        idle_steps += step.cost.idle_ranks > 0
        for _, out in step.outputs:
            tokens[out.request_id] += len(out.token_ids)
            finished[out.request_id] += out.finished
    assert finished == dict.fromkeys(lengths, 1)
    assert tokens == {rid: out for rid, (_, out) in lengths.items()}
    assert group.now == pytest.approx(elapsed) and idle_steps > 0 and not group.rank_of


def test_closed_loop_keeps_every_user_in_flight(tokenizer):
    group = _group(tokenizer, dp=8)
    loop = ClosedLoop(group, Traffic(200, 8), users=12, seed=1)
    loop.start()
    window = loop.run(warmup_steps=3, steps=40)
    assert loop.submitted - loop.completed == 12 and loop.completed > 12
    assert window.tokens >= len(window.itl) > 0 and window.steps == 40
    summary = window.summary(group.roofline.num_gpus, group.dp_size)
    assert summary["output_tok_s_per_gpu"] > 0 and summary["itl_ms_p50"] > 0


def test_agentic_sessions_hit_their_prefix_on_a_pinned_rank(tokenizer):
    hits = {}
    for affinity in (False, True):
        group = _group(tokenizer, dp=8)
        traffic = Traffic(256, 16, "agentic", 512, 4, 64, 4096, affinity)
        loop = ClosedLoop(group, traffic, users=12, seed=2)
        loop.start()  # users finish at different steps, so the balancer moves sessions
        hits[affinity] = loop.run(warmup_steps=0, steps=150).summary(8, 8)["hit_rate"]
    assert hits[True] > 0.5 and hits[True] > hits[False]


def test_bench_ep_quick_through_the_cli(tmp_path, capsys):
    from kvmesh.cli import build_parser, main

    help_text = build_parser().parse_args(["bench", "ep", "--quick"]).func.__module__
    assert help_text == "kvmesh.bench.ep_bench"
    assert main(["bench", "ep", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "ep.json").read_text())
    layouts = {r["layout"] for r in data["results"]}
    assert layouts == {"TP8", "DP8/EP8", "DP16/EP16", "DP32/EP32"}
    assert all("error" not in r and r["output_tok_s_per_gpu"] > 0 for r in data["results"])
    assert data["guide_setting"]["decode_only"]["running"] == 2048
    assert (tmp_path / "ep.png").stat().st_size > 0
    assert "llm-d wide-EP guide" in capsys.readouterr().out


def test_high_throughput_all_to_all_sends_a_token_once_per_remote_node():
    prefill = [[SequenceWork(2048, 0)]] + [decode(128)] * 15
    low = WideEPRoofline(H200, GLM, 16).step_cost(prefill)
    high = WideEPRoofline(H200, GLM, 16, all2all_backend="deepep_high_throughput")
    assert high.step_cost(prefill).comm < low.comm / 2  # ~4 of 8 picks cross, now one copy
    with pytest.raises(ValueError, match="all2all-backend"):
        WideEPRoofline(H200, GLM, 16, all2all_backend="nccl")


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(
            st.tuples(
                st.integers(1, 4), st.integers(0, 9000), st.integers(0, 3), st.integers(0, 3)
            ),
            max_size=5,
        ),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),
)
def test_draft_loads_are_the_sums_of_the_drafter_rows(ranks, dummy):
    """The drafter's per-rank sums, taken in one pass, equal those of its rows as
    work.draft_passes lists them (one row per drafting request and draft position)."""
    works = [
        [SequenceWork(new, ctx, False, min(spec, new - 1), passes) for new, ctx, spec, passes in ws]
        for ws in ranks
    ]
    got = draft_loads(works, dummy)
    want = [rank_load(rows, dummy) for rows in draft_passes(works)]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g[:3], w[:3], strict=True):
            assert a.tolist() == b.tolist()
        assert g.idle == w.idle
