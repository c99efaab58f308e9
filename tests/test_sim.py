"""The fleet simulator: real engine cores and the real router pipeline on a virtual clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench.workloads import hit_ceiling as workload_ceiling
from kvmesh.bench.workloads import mooncake
from kvmesh.cli import main
from kvmesh.engine.tokenizer import load_tokenizer
from kvmesh.router.pipeline import PRESETS
from kvmesh.sim import replay
from kvmesh.sim.fleet import FleetSim, SimRequest

# two conversations (each turn extends the last) that share only block 0, at light load; their
# turns interleave so that alternating engines breaks them up
ROWS = [
    {"timestamp": 0, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1, 2]},
    {"timestamp": 200, "input_length": 1200, "output_length": 4, "hash_ids": [0, 7, 8]},
    {"timestamp": 2000, "input_length": 2500, "output_length": 4, "hash_ids": [0, 1, 2, 3, 4]},
    {"timestamp": 4000, "input_length": 3000, "output_length": 4, "hash_ids": [0, 1, 2, 3, 4, 5]},
    {"timestamp": 4300, "input_length": 2000, "output_length": 4, "hash_ids": [0, 7, 8, 9]},
    {"timestamp": 6100, "input_length": 2600, "output_length": 4, "hash_ids": [0, 7, 8, 9, 10]},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)[0]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def _config(serve_args: str = "", engines: int = 2):
    return replay._configs(serve_args, engines, 0.1)


def test_one_request_takes_the_modelled_step_times(tokenizer):
    cfg = _config("--emulate-ttft-ms 50 --emulate-itl-ms 10", engines=1)
    sim = FleetSim(cfg, "round-robin", tokenizer)
    (rec,) = sim.run([SimRequest(0, 1.0, ((0, 100),), 3)])
    assert rec.ttft == pytest.approx(0.050)
    assert rec.finished == pytest.approx(1.0 + 0.050 + 2 * 0.010)
    assert rec.output_tokens == 3 and rec.cached_tokens == 0


POLICIES = Path(__file__).parents[1] / "docs" / "policies"


def test_prefix_aware_routing_follows_the_conversation(tokenizer, trace):
    requests = replay.trace_requests(trace)
    policies = {
        "rr": "round-robin",
        "kvmesh": "kvmesh",
        "half": (POLICIES / "kvmesh-half-prompt-threshold.yaml").read_text(),
        "first": (POLICIES / "kvmesh-prefix-first.yaml").read_text(),
    }
    runs = {}
    for name, policy in policies.items():
        runs[name] = FleetSim(_config(), policy, tokenizer).run(requests)
        assert all(r.finished is not None for r in runs[name])  # nothing lost
    for name in ("kvmesh", "half", "first"):  # later turns land where their context is
        for a, b in ((0, 2), (2, 3), (1, 4), (4, 5)):
            assert runs[name][a].engine == runs[name][b].engine
    # a request that shares only the system block with the idle holder: the preset follows it
    # (computing 688 tokens there costs less than 1200 on the other engine); a half-prompt
    # threshold places it as a new context, on the other engine
    assert runs["kvmesh"][1].engine == runs["kvmesh"][0].engine
    assert runs["half"][1].engine != runs["half"][0].engine
    lost = {n: [r.rid for r in rs if r.chosen_known_tokens < r.best_known_tokens]
            for n, rs in runs.items()}  # fmt: skip
    assert lost["half"] == [1] and lost["kvmesh"] == lost["first"] == []
    ceiling = replay.hit_ceiling(requests, 16)
    hit = {n: replay.summarize(rs, 2)["hit_rate"] for n, rs in runs.items()}
    assert hit["rr"] < hit["half"] < hit["kvmesh"] == hit["first"]
    assert hit["kvmesh"] == pytest.approx(ceiling, abs=0.002)
    assert hit["half"] == pytest.approx(ceiling - 512 / 12800, abs=0.005)
    assert replay.summarize(runs["rr"], 2)["lost_to_routing"] > 0.1


def test_a_shared_system_prompt_does_not_gather_sessions_on_its_first_holder(tokenizer):
    """Agent sessions that share only the system prompt and tools: following every match
    without pricing the batch puts them all on one engine; the preset spreads them and still
    reaches the ceiling."""
    from kvmesh.bench.workloads import agentic
    from kvmesh.sim.requests import workload_requests

    wl = agentic(sessions=16, turns=4, repos=16, repo_tokens=3000, session_rate=1.0, seed=3)
    requests = workload_requests(wl)
    ceiling = replay.hit_ceiling(requests, 16)
    first = (POLICIES / "kvmesh-prefix-first.yaml").read_text()
    got = {}
    for name, policy in (("kvmesh", "kvmesh"), ("first", first)):
        records = FleetSim(_config(engines=4), policy, tokenizer).run(requests)
        got[name] = replay.summarize(records, 4)
    assert sum(n > 0 for n in got["first"]["load"]) == 1
    assert sum(n > 0 for n in got["kvmesh"]["load"]) >= 2
    assert got["kvmesh"]["hit_rate"] >= 0.98 * ceiling
    assert got["kvmesh"]["ttft_ms_p90"] < got["first"]["ttft_ms_p90"]


def test_ceiling_agrees_with_the_benchmark_workload(trace):
    sim = replay.hit_ceiling(replay.trace_requests(trace), 16)
    bench = workload_ceiling(mooncake(trace).requests, 16)["hit_rate"]
    assert sim == pytest.approx(bench, abs=1e-9)


def test_cli_writes_a_table_and_json(trace, tmp_path, capsys):
    out = tmp_path / "sim.json"
    policies = f"round-robin,kvmesh,{POLICIES / 'kvmesh-prefix-first.yaml'}"
    argv = ["sim", "--trace", trace, "--engines", "2", "--policies", policies, "--jobs", "2"]
    rc = main([*argv, "--output", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"round-robin", "kvmesh", "kvmesh-prefix-first"}
    assert data["policies"]["kvmesh"]["requests"] == len(ROWS)
    assert "hit" in capsys.readouterr().out
    assert (tmp_path / "sim.png").stat().st_size > 10_000


def test_bad_serve_args_are_refused(trace, capsys):
    assert main(["sim", "--trace", trace, "--serve-args", "--no-such-flag 3"]) == 2
    assert "serve-args" in capsys.readouterr().err
    assert main(["sim", "--trace", trace, "--policies", "kvmesh,nowhere.yaml"]) == 2
    assert "no such policy file" in capsys.readouterr().err


def test_a_seed_repeats_a_run(tokenizer, trace):
    requests = replay.trace_requests(trace)

    def engines(seed: int) -> list[int]:
        cfg = replay._configs("", 4, 0.1, seed)
        return [r.engine for r in FleetSim(cfg, "random", tokenizer).run(requests)]

    runs = {seed: engines(seed) for seed in (1, 2, 3)}
    assert engines(1) == runs[1]
    assert len({tuple(v) for v in runs.values()}) > 1  # the seed is what decides


def test_agentic_turns_wait_for_the_turn_they_follow(tokenizer):
    from kvmesh.bench.workloads import agentic
    from kvmesh.sim.requests import workload_requests

    wl = agentic(sessions=3, turns=3, repos=1, repo_tokens=800, tool_tokens=200, seed=5)
    requests = workload_requests(wl)
    records = FleetSim(_config(), "kvmesh", tokenizer).run(requests)
    by_rid = {r.rid: r for r in records}
    assert all(r.finished is not None for r in records)
    for req in requests:  # closed loop: a turn arrives its think time after its deps end
        if req.deps:
            last = max(by_rid[d].finished for d in req.deps)
            assert by_rid[req.rid].arrival == pytest.approx(last + req.delay)
        else:
            assert by_rid[req.rid].arrival == pytest.approx(req.at)
    # the segments the benchmark's prompts share are shared token runs: the same ceiling
    bench = workload_ceiling(wl.requests, 16)["hit_rate"]
    assert replay.hit_ceiling(requests, 16) == pytest.approx(bench, abs=1e-9)


def test_cli_runs_the_agentic_workload(capsys):
    argv = ["sim", "--workload", "agentic", "--sessions", "4", "--turns", "2", "--engines", "2"]
    assert main([*argv, "--policies", "round-robin,kvmesh"]) == 0
    out = capsys.readouterr().out
    assert "of the agentic workload, 2 engines" in out and out.count("hit 0.") == 2


def test_a_full_batch_sheds_requests_that_share_its_prefix(tokenizer):
    """48 requests sharing a 360-token prefix, batches of 4: the holders' queues cost more than
    computing the prefix on the third engine, which a placement cost without the engines'
    waiting requests never sees."""
    requests = [SimRequest(i, 0.01 * i, ((0, 360), (10**6 + i * 100, 15)), 40) for i in range(48)]
    cfg = replay._configs("--max-num-seqs 4", 3, 0.05)
    preset = replay.summarize(FleetSim(cfg, "kvmesh", tokenizer).run(requests), 3)
    blind = PRESETS["kvmesh"].replace(
        "{type: placement-cost-scorer}",
        "{type: placement-cost-scorer, parameters: {waitingWeight: 0}}",
    )
    assert blind != PRESETS["kvmesh"]
    without = replay.summarize(FleetSim(cfg, blind, tokenizer).run(requests), 3)
    assert min(preset["load"]) > 0 and min(without["load"]) == 0
    assert preset["ttft_ms_p90"] < without["ttft_ms_p90"]


def test_prompts_sharing_a_run_share_its_int_objects() -> None:
    from kvmesh.protocol.hashing import BlockHasher
    from kvmesh.sim.digests import PromptDigests, RunInts
    from kvmesh.sim.records import run_tokens

    digests = PromptDigests(BlockHasher("sha256", 16))
    system, tools = (1_000_000, 300), (2_000_000, 200)
    first = digests.prepare((system, tools, (3_000_000, 50)))
    second = digests.prepare((system, (4_000_000, 40)))  # not an extension of the first
    assert first.token_ids == run_tokens((system, tools, (3_000_000, 50)))
    assert second.token_ids == run_tokens((system, (4_000_000, 40)))
    assert all(a is b for a, b in zip(first.token_ids[:300], second.token_ids[:300], strict=True))
    # the kept runs stay within their capacity, the newest kept
    ints = RunInts(capacity_tokens=100)
    assert ints.extend(((10_000, 60), (20_000, 60)), []) == run_tokens(((10_000, 60), (20_000, 60)))
    assert ints.tokens == 60 and ints.extend(((20_000, 60),), [])[0] == 20_000
