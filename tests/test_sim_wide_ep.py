"""Wide-EP and TP instances in the fleet simulator (kvmesh.sim.instances): a DPGroup per
instance stepped on the event heap, one router endpoint per DP rank."""

from __future__ import annotations

import json

import pytest

from kvmesh.bench.workloads import agentic
from kvmesh.cli import main
from kvmesh.engine.emulation.latency import ACCELERATORS, MODELS, SequenceWork
from kvmesh.engine.emulation.wide_ep import WideEPRoofline
from kvmesh.engine.sequence import Request, SamplingParams
from kvmesh.engine.tokenizer import load_tokenizer
from kvmesh.sim import replay
from kvmesh.sim.fleet import FleetSim, FleetSimConfig, SimRequest
from kvmesh.sim.instances import InstanceUnit, describe
from kvmesh.sim.requests import workload_requests

H200, GLM = ACCELERATORS["h200"], MODELS["glm-5.2-moe"]
RANK_ARGS = "--emulate-gpu h200 --block-size 64 --max-num-seqs 32 --max-num-batched-tokens 1024"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)[0]


def _config(instances: int = 2, layout: str = "dp8", extra: str = "") -> FleetSimConfig:
    return replay._configs(f"{RANK_ARGS} {extra}", instances, 0.1, 0, layout=layout)


def _placements(sim: FleetSim) -> dict[str, tuple[int, int]]:
    """Records (instance, rank) of every request a group is given."""
    placed: dict[str, tuple[int, int]] = {}
    for k, unit in enumerate(sim.units):
        group, add = unit.group, unit.group.add_request

        def spy(request, dp_rank=None, k=k, add=add):
            placed[request.request_id] = (k, add(request, dp_rank=dp_rank))
            return placed[request.request_id][1]

        group.add_request = spy
    return placed


def test_two_dp8_instances_run_every_request_on_the_rank_the_router_picked(tokenizer):
    sim = FleetSim(_config(), "kvmesh", tokenizer)
    assert [e.endpoint.name for e in sim.engines] == [
        f"instance-{k}#dp{r}" for k in range(2) for r in range(8)
    ]
    assert [e.endpoint.dp_rank for e in sim.engines] == list(range(8)) * 2
    placed = _placements(sim)
    wl = agentic(sessions=12, turns=3, repos=4, repo_tokens=1500, session_rate=3.0, seed=5)
    records = sim.run(workload_requests(wl))
    assert records and all(r.finished is not None and r.output_tokens for r in records)
    for r in records:
        e = sim.engines[r.engine]
        assert placed[str(r.rid)] == (e.unit, e.rank)
    summary = replay.summarize(records, len(sim.engines))
    assert summary["hit_rate"] > 0.5 and len(summary["load"]) == 16
    assert all(not unit.busy and not unit.has_work() for unit in sim.units)


def test_a_repeated_prefix_hits_on_the_rank_that_holds_it(tokenizer):
    sim = FleetSim(_config(), "kvmesh", tokenizer)
    prompt = ((1000, 2048),)
    first, second = sim.run([SimRequest(0, 0.0, prompt, 4), SimRequest(1, 5.0, prompt, 4)])
    assert second.engine == first.engine and second.cached_tokens >= 2048 - 64
    name = sim.engines[first.engine].endpoint.name
    keys = sim.digests.prepare(prompt).ints
    assert sim.state.precise_index.longest_match(keys) == {name: len(keys)}
    assert second.best_known_tokens == second.chosen_known_tokens == second.cached_tokens


def test_a_lockstep_step_lasts_the_rooflines_time_for_every_ranks_work(tokenizer):
    sim = FleetSim(_config(instances=1), "round-robin", tokenizer)
    roofline = sim.units[0].group.roofline
    costs: list[tuple[list, float]] = []
    price = roofline.step_cost

    def spy(works):
        cost = price(works)
        costs.append(([list(w) for w in works], cost.time))
        return cost

    roofline.step_cost = spy
    (rec,) = sim.run([SimRequest(0, 1.0, ((0, 100),), 3)])
    rank = sim.engines[rec.engine].rank

    def alone(work: SequenceWork) -> float:
        return price([[work] if r == rank else [] for r in range(8)]).time

    prefill = alone(SequenceWork(100, 0, True))
    decodes = alone(SequenceWork(1, 100)) + alone(SequenceWork(1, 101))
    assert rec.ttft == pytest.approx(prefill)
    assert rec.finished == pytest.approx(1.0 + prefill + decodes)
    for e in sim.engines:  # the step occupies every GPU of the instance
        assert e.busy_s == pytest.approx(prefill + decodes)
    # two ranks at once: one step over both batches, its time the roofline's for both
    costs.clear()
    sim.run([SimRequest(1, 10.0, ((5000, 300),), 2), SimRequest(2, 10.0, ((9000, 200),), 2)])
    assert any(sum(1 for w in works if w) == 2 for works, _ in costs)
    assert sim.engines[0].busy_s == pytest.approx(prefill + decodes + sum(c for _, c in costs))


def test_a_prompt_past_a_ranks_context_is_refused_as_the_engine_refuses_it(tokenizer):
    """The engine answers 400 to prompt + max_tokens past its context (at most its KV cache):
    the request ends at arrival, and the run does not wait for it forever."""
    for config in (_config(), replay._configs("--num-gpu-blocks 100", 2, 0.1)):
        sim = FleetSim(config, "kvmesh", tokenizer)
        room = sim.engines[0].core.runner.max_model_len
        requests = [SimRequest(0, 0.0, ((0, room),), 4), SimRequest(1, 0.5, ((0, 500),), 4)]
        big, small = sim.run(requests)
        assert big.refused and big.finished == 0.0 and big.output_tokens == 0
        assert not small.refused and small.output_tokens == 4
        assert replay.summarize([big, small], len(sim.engines))["refused"] == 1
        assert all(e.endpoint.in_flight == 0 for e in sim.engines)


def test_gpus_that_do_not_divide_into_instances_are_refused(capsys):
    assert FleetSimConfig(layout="dp16", gpus=544).engines == 34
    assert FleetSimConfig(layout="DP32", gpus=544).describe() == (
        "17 DP32/EP32 instances (544 GPUs)"
    )
    assert describe(1, "dp8", 8) == "1 DP8/EP8 instance (8 GPUs)"
    assert describe(1, "", 1) == "1 engine"
    with pytest.raises(ValueError, match="not a whole number of DP16/EP16 instances"):
        FleetSimConfig(layout="dp16", gpus=500)
    with pytest.raises(ValueError, match="a layout is tpN or dpN"):
        FleetSimConfig(layout="ep8", gpus=16)
    base = ["sim", "--workload", "agentic", "--agents", "2", "--duration", "2"]
    for flags, message in (
        (["--layout", "dp16", "--gpus", "500"], "--gpus 500 is not a whole number"),
        (["--layout", "dp16", "--emulate-gpu", "h100"], "does not fit DP16/EP16"),
        (["--layout", "tp8", "--emulate-model", "llama-3.1-8b"], "needs an MoE model"),
    ):
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err


def test_tp_instances_are_one_endpoint_each(tokenizer):
    sim = FleetSim(_config(layout="tp8"), "kvmesh", tokenizer)
    assert [e.endpoint.name for e in sim.engines] == ["instance-0", "instance-1"]
    assert sim.config.num_gpus == 16
    records = sim.run([SimRequest(i, 0.1 * i, ((1000 * i, 500),), 8) for i in range(6)])
    assert all(r.finished is not None and r.output_tokens == 8 for r in records)


def test_mtp_drafts_make_fewer_lockstep_steps(tokenizer):
    mtp = """--speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'"""
    steps, done = {}, {}
    for name, extra in (("off", ""), ("mtp", mtp)):
        sim = FleetSim(_config(instances=1, extra=extra), "kvmesh", tokenizer)
        (rec,) = sim.run([SimRequest(0, 0.0, ((0, 500),), 64)])
        assert rec.output_tokens == 64
        steps[name], done[name] = sim.units[0].group.num_steps, rec.finished
    assert steps["mtp"] < 0.6 * steps["off"] and done["mtp"] < done["off"]


def test_an_evicted_prefix_loads_back_from_the_ranks_host_tier(tokenizer):
    """A rank with room for ~100 blocks and a host-DRAM tier: a prompt pushed out by two others
    comes back from host memory, its asynchronous load landing as the group's time passes."""
    base = WideEPRoofline(H200, GLM, 8)
    weights = H200.memory_bytes * 0.9 - base.kv_capacity_bytes()
    room = 100 * 64 * GLM.kv_bytes_per_token
    util = (weights + room) / H200.memory_bytes
    extra = f"--gpu-memory-utilization {util:.6f} --kv-offloading-size 2"
    sim = FleetSim(_config(instances=1, extra=extra), "kvmesh", tokenizer)
    unit = sim.units[0]
    assert isinstance(unit, InstanceUnit) and 95 <= unit.group.num_blocks <= 100
    rank0 = unit.engines[0]
    now, outputs = 0.0, {}

    def serve(rid: str, first: int, n: int) -> None:
        nonlocal now
        tokens = list(range(first, first + n))
        unit.add_request(rank0, Request(rid, tokens, SamplingParams(max_tokens=2, ignore_eos=True)))
        for _ in range(1000):
            if not unit.has_work():
                return
            dt, outs = unit.step(now)
            now += dt
            outputs.update((o.request_id, o) for o in outs)
        raise AssertionError(f"{rid} never finished")

    serve("a", 0, 3000)
    serve("b", 100_000, 3000)
    serve("c", 200_000, 3000)
    serve("a2", 0, 3100)
    assert outputs["a2"].num_cached_tokens >= 2944
    assert rank0.core.runner.modelled_loads.get("CPU", 0.0) > 0
    assert all(r.clock == pytest.approx(now) for r in unit.runners)


def test_cli_runs_agents_on_wide_ep_instances(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["sim", "--workload", "agentic", "--agents", "3", "--duration", "4", "--layout"]
    argv += ["dp8", "--gpus", "16", "--emulate-gpu", "h200", "--serve-args", "--block-size 64"]
    assert main([*argv, "--policies", "kvmesh", "--output", str(out)]) == 0
    assert "3 agents for 4 simulated s, 2 DP8/EP8 instances (16 GPUs)" in capsys.readouterr().out
    summary = json.loads(out.read_text())["policies"]["kvmesh"]
    assert summary["gpus"] == 16 and summary["instances"] == 2 and summary["engines"] == 16
    assert summary["output_tok_per_min"] > 0 and 0 < summary["gpu_busy"] <= 1


def test_two_batch_overlap_exposes_only_the_pipelines_fill_and_drain() -> None:
    import numpy as np

    from kvmesh.engine.emulation.wide_ep import two_batch_overlap

    layers = 10
    compute, comm = np.full(layers, 3.0), np.full(layers, 2.0)
    # A's first kernels, 2 x 10 - 1 overlapped intervals of the longer, B's last all-to-all
    assert two_batch_overlap(compute, comm) == pytest.approx(3 + 19 * 3 + 2)
    per_layer = layers * (2 * 3.0 + 2.0)  # a pipeline drained at every layer
    assert two_batch_overlap(compute, comm) == pytest.approx(per_layer - (layers - 1) * 2.0)
    # nothing to hide: both micro-batches' kernels one after another
    assert two_batch_overlap(compute, np.zeros(layers)) == pytest.approx(2 * compute.sum())


def test_dbo_step_pipelines_its_micro_batches_across_the_forward() -> None:
    import numpy as np

    from kvmesh.engine.emulation.instance_roofline import rank_load
    from kvmesh.engine.emulation.wide_ep import two_batch_overlap

    dbo = WideEPRoofline(H200, GLM, 16, enable_dbo=True)
    works = [[SequenceWork(1, 4000, False, 0, 0)] * 128 for _ in range(16)]
    load = rank_load(works, dummy=True)
    half = load._replace(
        tokens=load.tokens / 2, attended=load.attended / 2, kv_tokens=load.kv_tokens / 2
    )
    h_dense, h_experts, h_comm, _ = dbo._layers(half)
    h_compute = h_dense + h_experts
    dense_layers = 2 * h_dense * GLM.num_dense_layers  # the dense layers before the MoE ones
    moe = dbo.step_cost(works).time - dbo.step_overhead - dense_layers
    assert moe == pytest.approx(two_batch_overlap(h_compute, h_comm))
    drained = float((2 * np.maximum(h_compute, h_comm) + np.minimum(h_compute, h_comm)).sum())
    assert moe < drained  # not one exposed kernel-or-collective per layer
