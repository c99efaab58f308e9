"""KV moves in the fleet simulator (kvmesh.sim.pd): P/D pools behind the router's disagg profile
handler, the engine's own KV hand-over and its transfer time, and peer sharing."""

from __future__ import annotations

import json

import pytest

from kvmesh.bench.workloads import agentic
from kvmesh.cli import main
from kvmesh.engine.tokenizer import load_tokenizer
from kvmesh.router.pipeline import PRESETS
from kvmesh.router.plugins.base import ROLE_LABEL
from kvmesh.sim import replay
from kvmesh.sim.fleet import FleetSim, SimRequest
from kvmesh.sim.pd import PREFILL_SUFFIX
from kvmesh.sim.requests import workload_requests

ARGS = "--emulate-gpu h200 --block-size 64 --max-num-seqs 32 --max-num-batched-tokens 1024"
ALWAYS_PD = PRESETS["pd"].replace("nonCachedTokens: 256", "nonCachedTokens: 0")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)[0]


def _config(engines: int = 4, prefill_gpus: int = 1, layout: str = "", **kw):
    return replay._configs(ARGS, engines, 0.1, 0, layout=layout, prefill_gpus=prefill_gpus, **kw)


def _workload():
    wl = agentic(sessions=10, turns=3, repos=3, repo_tokens=1500, session_rate=3.0, seed=7)
    return workload_requests(wl)


def _spy(sim: FleetSim) -> dict[str, list[tuple[str, int]]]:
    """Engine request id -> (endpoint name, scheduled tokens) of every step that ran it."""
    seen: dict[str, list[tuple[str, int]]] = {}
    for e in sim.engines:
        schedule = e.core.scheduler.schedule

        def spy(schedule=schedule, name=e.endpoint.name):
            out = schedule()
            for s in out.scheduled:
                seen.setdefault(s.request.request_id, []).append((name, s.num_tokens))
            return out

        e.core.scheduler.schedule = spy
    return seen


def _role(sim: FleetSim, name: str) -> str:
    return next(e.endpoint.labels[ROLE_LABEL] for e in sim.engines if e.endpoint.name == name)


@pytest.mark.parametrize("layout,engines,prefill_gpus", [("", 4, 1), ("dp8", 3, 8)])
def test_prefill_runs_on_prefill_endpoints_and_decode_on_decode_ones(
    tokenizer, layout, engines, prefill_gpus
):
    sim = FleetSim(_config(engines, prefill_gpus, layout), ALWAYS_PD, tokenizer)
    roles = [e.endpoint.labels[ROLE_LABEL] for e in sim.engines]
    per = 8 if layout else 1
    assert roles == ["decode"] * (len(roles) - per) + ["prefill"] * per
    seen = _spy(sim)
    records = sim.run(_workload())
    assert records and all(r.finished is not None and r.output_tokens for r in records)
    pd = [r for r in records if sim.transfers.get(str(r.rid))]
    assert len(pd) > len(records) // 2  # a cold or grown prompt goes through the prefill pool
    for r in records:
        rid = str(r.rid)
        assert {_role(sim, name) for name, _ in seen[rid]} == {"decode"}
        assert sim.engines[r.engine].endpoint.labels[ROLE_LABEL] == "decode"
        if rid in sim.transfers:
            t = sim.transfers[rid]
            assert {_role(sim, n) for n, _ in seen[rid + PREFILL_SUFFIX]} == {"prefill"}
            assert sim.engines[t.source].endpoint.name == seen[rid + PREFILL_SUFFIX][0][0]
            # the decode engine found the prompt's full blocks cached: it computed the tail only
            assert t.decode_cached >= r.prompt_tokens - sim.block_size
            assert r.cached_tokens == t.prefill_cached  # the hit is the prefill engine's
        # decode-pool steps carry no prefill chunk: at most the prompt's last partial block
        assert max(n for _, n in seen[rid]) <= sim.block_size
    # every forward's bookkeeping was released, on both pools
    assert all(
        (e.endpoint.in_flight, e.endpoint.in_flight_tokens, e.endpoint.pending_prefill_tokens)
        == (0, 0, 0)
        for e in sim.engines
    )


def test_ttft_includes_the_engine_computed_transfer_time(tokenizer):
    sim = FleetSim(_config(3, 1), "pd", tokenizer)
    (r,) = sim.run([SimRequest(0, 0.0, ((1000, 8000),), 4)])
    t = sim.transfers["0"]
    assert t.kind == "pd" and t.saved_tokens == (8000 - 1) // 64 * 64  # all but the last token
    decode = sim.engines[t.sink].core
    expected = decode.runner.transfer_time({}, t.saved_tokens // sim.block_size)
    assert t.seconds == pytest.approx(expected) and expected > 0
    # first token: after the prefill leg, the transfer, then the decode engine's first step
    assert r.first_token > t.started + t.seconds >= r.arrival + t.seconds
    # the same request with a free link: TTFT shorter by the transfer time
    free = FleetSim(_config(3, 1), "pd", tokenizer)
    for e in free.engines:
        e.core.runner.transfer_bandwidth = float("inf")
    (q,) = free.run([SimRequest(0, 0.0, ((1000, 8000),), 4)])
    assert free.transfers["0"].seconds == 0
    assert r.ttft - q.ttft == pytest.approx(t.seconds, rel=1e-6)


def test_selective_pd_skips_the_prefill_leg_for_a_mostly_cached_prompt(tokenizer):
    sim = FleetSim(_config(3, 1), "pd", tokenizer)  # nonCachedTokens: 256
    first = SimRequest(0, 0.0, ((1000, 3000),), 4)
    grown = SimRequest(1, 5.0, ((1000, 3000), (90_000, 100)), 4)
    a, b = sim.run([first, grown])
    assert sim.transfers["0"].kind == "pd" and "1" not in sim.transfers
    assert a.engine == b.engine  # the decode engine that holds the prefix computes the rest
    assert sim.engines[b.engine].endpoint.labels[ROLE_LABEL] == "decode"
    assert b.cached_tokens >= 3000 - 64


def test_a_bad_split_or_a_policy_without_roles_is_refused(tokenizer, capsys):
    with pytest.raises(ValueError, match="leaves no GPUs for decode"):
        _config(4, 4)
    with pytest.raises(ValueError, match="not a whole number of DP8/EP8 instances"):
        _config(3, 12, "dp8")
    with pytest.raises(ValueError, match="needs a P/D policy"):
        FleetSim(_config(4, 1), "kvmesh", tokenizer)
    argv = ["sim", "--workload", "agentic", "--agents", "2", "--layout", "dp8", "--gpus", "16"]
    assert main([*argv, "--prefill-gpus", "20", "--policies", "pd"]) == 2
    assert "--prefill-gpus 20 is not a whole number" in capsys.readouterr().err


def test_aggregated_runs_are_unchanged_by_the_pools(tokenizer):
    """No prefill pool: no role labels, no transfers, the records of before."""
    sim = FleetSim(_config(2, 0), "kvmesh", tokenizer)
    assert all(not e.endpoint.labels for e in sim.engines)
    records = sim.run(_workload())
    assert records and not sim.transfers


def test_peer_sharing_pulls_a_prefix_instead_of_recomputing_it(tokenizer):
    cfg = _config(2, 0, kv_peer_min_cached_token_delta=1024)
    sim = FleetSim(cfg, "round-robin", tokenizer)
    first = SimRequest(0, 0.0, ((1000, 4000),), 4)
    again = SimRequest(1, 5.0, ((1000, 4000), (90_000, 200)), 4)  # round-robin: the other one
    a, b = sim.run([first, again])
    assert a.engine != b.engine
    t = sim.transfers["1"]
    assert t.kind == "peer" and t.source == a.engine and t.sink == b.engine
    assert t.saved_tokens == 4000 // 64 * 64
    assert b.cached_tokens == t.decode_cached >= t.saved_tokens
    expected = sim.engines[b.engine].core.runner.transfer_time({}, t.saved_tokens // 64)
    assert t.seconds == pytest.approx(expected) and b.first_token > t.started + t.seconds
    # off: the second engine recomputes
    off = FleetSim(_config(2, 0), "round-robin", tokenizer)
    _, c = off.run([first, again])
    assert not off.transfers and c.cached_tokens == 0


def test_cli_pd_run_writes_json(tmp_path, capsys):
    out = tmp_path / "pd.json"
    argv = ["sim", "--workload", "agentic", "--agents", "6", "--duration", "6", "--layout"]
    argv += ["dp8", "--gpus", "24", "--prefill-gpus", "8", "--emulate-gpu", "h200"]
    argv += ["--serve-args", "--block-size 64", "--no-ceiling", "--policies", "pd"]
    assert main([*argv, "--output", str(out)]) == 0
    assert "3 DP8/EP8 instances (24 GPUs): 1 prefill, 2 decode" in capsys.readouterr().out
    summary = json.loads(out.read_text())["policies"]["pd"]
    assert summary["output_tok_per_min"] > 0 and summary["gpus"] == 24


def test_cli_ablation_runs_the_pd_and_peer_rows(tmp_path, capsys):
    out = tmp_path / "abl.json"
    argv = ["sim", "--workload", "agentic", "--agents", "4", "--duration", "4", "--layout"]
    argv += ["dp8", "--gpus", "24", "--prefill-gpus", "8", "--emulate-gpu", "h200"]
    argv += ["--serve-args", "--block-size 64", "--no-ceiling", "--policies", "pd"]
    argv += ["--kv-peer-min-cached-token-delta", "1024", "--ablation", "--gpu-hour-price", "3"]
    assert main([*argv, "--output", str(out)]) == 0
    rows = {r["off"]: r for r in json.loads(out.read_text())["rows"]}
    ran = {off for off, r in rows.items() if not r["skipped"]}
    assert {"", "precise routing", "peer sharing", "P/D"} <= ran
    assert rows["P/D"]["policy"] == "kvmesh" and rows[""]["policy"] == "pd"
    for off in ran:
        assert rows[off]["summary"]["output_tok_per_min"] > 0
        assert rows[off]["summary"]["gpus"] == 24
