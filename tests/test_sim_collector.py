"""kvmesh sim runs with the cyclic collector off (sim.quiet.collector_off): that is only safe while
running a fleet makes no garbage in reference cycles, which reference counting cannot free.
These runs cover every part a full-scale run uses: DP instances, host tiers, MTP, P/D and peer
pulls, the closed loop of agents and the trace replay."""

from __future__ import annotations

import gc

import pytest

from kvmesh.bench.workloads import agentic
from kvmesh.engine.tokenizer import load_tokenizer
from kvmesh.sim import replay
from kvmesh.sim.agents import AgentConfig, ClosedLoop
from kvmesh.sim.fleet import FleetSim
from kvmesh.sim.quiet import collector_off
from kvmesh.sim.requests import workload_requests

ARGS = (
    "--emulate-gpu h200 --block-size 64 --max-num-seqs 16 --max-num-batched-tokens 1024 "
    "--kv-offloading-size 1 --num-gpu-blocks 96 "
    """--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'"""
)
SHAPE = dict(turns=3, system_tokens=300, repos=2, repo_tokens=800, answer_tokens=40, fanout=2)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)[0]


@pytest.mark.parametrize(
    "policy,engines,prefill_gpus,peer_delta",
    [("kvmesh", 3, 0, 64), ("pd", 3, 8, 0)],
    ids=["aggregated-peer-pulls", "pd"],
)
def test_a_fleet_builds_and_runs_without_reference_cycles(
    tokenizer, policy, engines, prefill_gpus, peer_delta
):
    config = replay._configs(
        ARGS,
        engines,
        0.1,
        0,
        layout="dp8",
        prefill_gpus=prefill_gpus,
        kv_peer_min_cached_token_delta=peer_delta,
    )
    gc.collect()
    with collector_off():
        assert not gc.isenabled()
        sim = FleetSim(config, policy, tokenizer)
        loop = ClosedLoop(sim, AgentConfig(24, 20.0, 2.0, 5, dict(SHAPE)))
        assert gc.collect() < 10  # a type's first introspection makes a few, once
        loop.run()
        assert gc.collect() == 0  # the run: nothing the collector would have had to free
    assert gc.isenabled()
    records = list(sim.records.values())
    assert len(records) > 50 and sum(r.output_tokens for r in records) > 0
    host = [t for e in sim.engines for t in e.core.kv.offloader.tiers]
    assert sum(t.stored_blocks for t in host) > 0  # the tiers took part
    assert all(e.core.speculator is not None for e in sim.engines)
    assert {t.kind for t in sim.transfers.values()} == {"pd" if prefill_gpus else "peer"}


def test_the_replay_runs_without_reference_cycles(tokenizer):
    config = replay._configs("--emulate-gpu h100 --kv-offloading-size 1", 2, 0.1, 0)
    requests = workload_requests(agentic(sessions=6, turns=3, repos=2, repo_tokens=800, seed=2))
    with collector_off():
        sim = FleetSim(config, "kvmesh", tokenizer)
        gc.collect()
        records = sim.run(requests)
        assert gc.collect() == 0
    assert len(records) == len(requests) and all(r.finished is not None for r in records)
    _, summary, _ = replay.run_policy(config, "kvmesh", requests)  # off while it runs, then on
    assert gc.isenabled() and summary["requests"] == len(requests)


def test_the_collector_comes_back_as_it_was_even_after_an_error():
    with pytest.raises(RuntimeError), collector_off():
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_off():
            pass
        assert not gc.isenabled()  # it was off before: left off
    finally:
        gc.enable()
