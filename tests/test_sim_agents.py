"""Closed-loop coding agents in the fleet simulator (kvmesh.sim.agents), and the sim's savings
that must not change a result (shared block digests, quiet engines)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from kvmesh.bench.workloads import agentic
from kvmesh.cli import main
from kvmesh.engine.tokenizer import load_tokenizer
from kvmesh.protocol.hashing import BlockHasher, block_hash_to_int
from kvmesh.sim import replay
from kvmesh.sim.agents import AgentConfig, ClosedLoop
from kvmesh.sim.agents_report import knee, loop_ceiling, summarize_loop
from kvmesh.sim.digests import PromptDigests
from kvmesh.sim.fleet import FleetSim, SimRequest
from kvmesh.sim.quiet import quieten

SHAPE = dict(  # a small session shape: short prompts, fan-outs likely
    turns=4,
    system_tokens=300,
    tool_def_tokens=200,
    repos=2,
    repo_tokens=600,
    task_tokens=50,
    tool_tokens=100,
    answer_tokens=24,
    think_s=0.5,
    fanout=3,
    fanout_rate=0.5,
    sub_turns=2,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)[0]


def _loop(
    tokenizer, agents=6, duration=12.0, seed=3, policy="kvmesh", engines=2, progress=None
) -> ClosedLoop:
    sim = FleetSim(replay._configs("", engines, 0.1, seed), policy, tokenizer)
    loop = ClosedLoop(sim, AgentConfig(agents, duration, 2.0, seed, dict(SHAPE)))
    loop.run(progress)
    return loop


@pytest.fixture(scope="module")
def loop(tokenizer) -> ClosedLoop:
    return _loop(tokenizer)


def test_each_agent_keeps_at_most_its_fanout_in_flight(loop):
    cfg, end = loop.config, loop.config.duration
    events = defaultdict(list)  # agent -> (time, +1 arrive / -1 finish)
    for rec in loop.sim.records.values():
        agent = loop.agent_of[rec.rid]
        events[agent].append((rec.arrival, 1))
        events[agent].append((rec.finished if rec.finished is not None else end, -1))
    peak_total = 0
    for agent_events in events.values():
        level = peak = 0
        for _, step in sorted(agent_events, key=lambda e: (e[0], e[1])):  # finishes first
            level += step
            peak = max(peak, level)
        assert 1 <= peak <= cfg.max_in_flight
        peak_total = max(peak_total, peak)
    assert peak_total == cfg.max_in_flight  # the fan-outs did overlap
    assert len(events) == cfg.agents


def test_turns_follow_the_answers_they_wait_for(loop):
    records = {r.rid: r for r in loop.sim.records.values()}
    by_agent = defaultdict(list)
    for rid, rec in sorted(records.items()):
        req = loop.requests[rid]
        by_agent[loop.agent_of[rid]].append(rec)
        if req.deps:  # turn k+1 arrives its think time after turn k (all its deps) finished
            last = max(records[d].finished for d in req.deps)
            assert rec.arrival == pytest.approx(last + req.delay)
    for recs in by_agent.values():  # a session starts after the previous one entirely ended
        starts = [r for r in recs if not loop.requests[r.rid].deps]
        for prev, nxt in zip(starts, starts[1:], strict=False):
            before = [r for r in recs if prev.rid <= r.rid < nxt.rid]
            assert all(r.finished is not None and r.finished <= nxt.arrival for r in before)
    assert loop.sessions_finished > loop.config.agents  # agents ran sessions back to back
    assert all(
        r.arrival < loop.config.duration for r in records.values() if not loop.requests[r.rid].deps
    )


def test_the_summary_is_the_records_totals(loop):
    s = summarize_loop(loop, loop_ceiling(loop, 16))
    records = list(loop.sim.records.values())
    minutes = loop.config.duration / 60
    prefilled = [r for r in records if r.first_token is not None]
    assert s["output_tok_per_min"] == round(sum(r.output_tokens for r in records) / minutes)
    assert s["input_tok_per_min"] == round(sum(r.prompt_tokens for r in prefilled) / minutes)
    hits = sum(r.cached_tokens for r in prefilled) / sum(r.prompt_tokens for r in prefilled)
    assert s["hit_rate"] == round(hits, 4)
    assert 0 < s["hit_rate"] <= s["ceiling"] + 1e-9 < 1
    assert s["requests"] == len(records) == len(loop.requests) - _not_arrived(loop)
    assert s["finished"] < s["requests"]  # the window closes on requests still running
    assert 0 < s["gpu_busy"] <= 1
    assert s["preemptions"] == 0 and s["user_tok_s_p50"] > 0 and s["ttft_ms_p90"] > 0


def _not_arrived(loop: ClosedLoop) -> int:
    return sum(str(rid) not in loop.sim.records for rid in loop.requests)


def test_a_seed_repeats_a_run(tokenizer, loop):
    def trail(lp: ClosedLoop) -> list[tuple]:
        return [
            (r.rid, r.engine, r.arrival, r.first_token, r.finished, r.cached_tokens)
            for r in sorted(lp.sim.records.values(), key=lambda r: r.rid)
        ]

    seen: list[float] = []  # a progress report changes nothing
    again = _loop(tokenizer, progress=seen.append)
    assert trail(again) == trail(loop)
    assert seen == sorted(seen) and seen[0] > 0 and seen[-1] <= 12.0
    assert [int(t) for t in seen] == list(range(1, len(seen) + 1)) and len(seen) >= 10
    assert summarize_loop(again) == summarize_loop(loop)
    assert trail(_loop(tokenizer, seed=4)) != trail(loop)


def test_shared_digests_equal_hashing_each_prompt():
    hasher = BlockHasher("xxhash", 16)
    cache = PromptDigests(hasher, capacity_blocks=40)
    base = ((1000, 40), (5000, 23))
    prompts = [
        base,
        (*base, (9000, 30)),  # extends base: reuses its two whole blocks
        (*base, (9000, 30), (12000, 7)),
        ((1000, 40), (7000, 50)),  # shares a run prefix with base but not a whole prompt
        base,
    ]
    for runs in prompts:
        ids = SimRequest(0, 0.0, runs, 1).token_ids()
        prompt = cache.prepare(runs)
        assert prompt.token_ids == ids
        assert prompt.digests == hasher.hash_blocks(ids, 0, None)
        assert prompt.ints == [block_hash_to_int(d) for d in prompt.digests]
        prompt.token_ids.append(-1)  # the caller's own list: the cache keeps its copy
        assert cache.prepare(runs).token_ids == ids
    assert cache.blocks_reused > 0 and cache.blocks <= 40 + 6  # evicts down to its budget


def test_quiet_engines_take_every_metric_call(loop):
    core = loop.sim.engines[0].core
    quieten(core)
    m = core.metrics
    m.ttft.observe(1.0)
    m.preemptions.inc(2)
    m.running.set(3)
    m.offload_usage.labels(medium="CPU").set(0.5)
    m.request_finished("stop")
    m.record_tier("CPU", 0.5, None)
    assert core.step_observer is None and m.ttft is m.running  # one null metric, cached


def test_cli_runs_agents_and_refuses_them_without_the_agentic_workload(capsys, tmp_path):
    out = tmp_path / "agents.json"
    argv = ["sim", "--workload", "agentic", "--agents", "3", "--duration", "4", "--engines", "2"]
    argv += ["--turns", "2", "--repo-tokens", "500", "--policies", "round-robin,kvmesh"]
    assert main([*argv, "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "3 agents for 4 simulated s, 2 engines" in text and text.count("tok/min") == 4
    assert out.exists()
    assert main(["sim", "--agents", "3"]) == 2
    assert "--agents needs --workload agentic" in capsys.readouterr().err
    assert main(["sim", "--workload", "agentic", "--agents", "2", "--duration", "0"]) == 2


def test_the_session_shape_is_the_workloads(loop):
    """An agent's session is the agentic generator's session: same request count and sizes."""
    first = sorted(r for r, a in loop.agent_of.items() if a == 0)
    req0 = loop.requests[first[0]]
    wl = agentic(sessions=1, **SHAPE, seed=0)
    assert wl.requests[0].prompt_tokens == sum(n for _, n in wl.requests[0].prompt)
    head = sum(SHAPE[k] for k in ("system_tokens", "tool_def_tokens", "repo_tokens"))
    assert req0.num_tokens == head + SHAPE["task_tokens"] and not req0.deps


def test_cli_sweeps_agent_counts_into_points_a_knee_and_a_plot(capsys, tmp_path):
    import json

    out = tmp_path / "sweep.json"
    argv = ["sim", "--workload", "agentic", "--agents", "3,2", "--duration", "4", "--engines"]
    argv += ["2", "--turns", "2", "--repo-tokens", "500", "--policies", "round-robin,kvmesh"]
    assert main([*argv, "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "3,2 agents for 4 simulated s, 2 engines" in text and text.count("tok/min") == 8
    assert text.count("no knee") == 2  # tiny runs do not preempt
    data = json.loads(out.read_text())
    assert data["agents"] == [3, 2] and set(data["policies"]) == {"round-robin", "kvmesh"}
    for run in data["policies"].values():
        assert [p["agents"] for p in run["points"]] == [3, 2] and run["knee"] is None
    png = tmp_path / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_knee_is_the_fewest_agents_that_preempted():
    def pts(*pairs):
        return [{"agents": n, "preemptions": k} for n, k in pairs]

    assert knee(pts((20, 0), (40, 0), (80, 3), (160, 50))) == 80
    assert knee(pts((160, 50), (80, 3), (40, 0), (20, 0))) == 80  # in any order
    assert knee(pts((20, 0), (40, 2), (80, 0))) == 40
    assert knee(pts((20, 0), (40, 0))) is None
    assert knee([]) is None


@pytest.mark.parametrize(
    "agents, message",
    [
        ("0,10", "at least 1"),
        ("-3", "at least 1"),
        ("a,b", "not a count"),
        ("10,,20", "not a count"),
        ("10,20,10", "appears twice"),
    ],
)
def test_cli_refuses_bad_agent_lists(capsys, agents, message):
    with pytest.raises(SystemExit) as exc:
        main(["sim", "--workload", "agentic", "--agents", agents, "--duration", "1"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_agent_counts_parse_one_count_a_list_and_zero_as_the_open_workload():
    from kvmesh.sim.agents_cli import agent_counts

    assert agent_counts("40") == [40]
    assert agent_counts("160,80, 40") == [160, 80, 40]  # decreasing is fine
    assert agent_counts("0") == []  # the default: the open workload of --sessions
