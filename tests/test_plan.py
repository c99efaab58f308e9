"""`kvmesh plan` on small fleets of emulated Llama-3.1-8B engines on H100s.

By construction: on an H100 the roofline decodes one Llama-3.1-8B sequence at the agentic
workload's mean context at ~118 tok/s on one GPU and ~174 on two (TP2), so at 130 tok/s per
user no 1-GPU engine can meet the target, whatever the load, and the cheapest plan is the one
TP2 engine on 2 GPUs, which the simulator confirms with 4 agents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.cli import main
from kvmesh.plan.candidates import Candidate, enumerate_candidates
from kvmesh.plan.capacity import capacity, prune
from kvmesh.plan.targets import Targets, Workload

SMALL = ["--agents", "4", "--duration", "15", "--ramp-s", "3", "--host-tier-gib", "0"]


def plan(*flags: str) -> list[str]:
    return ["plan", *SMALL, *flags]


def test_the_cheapest_plan_is_the_one_known_by_construction(tmp_path, capsys) -> None:
    rc = main(plan("--ttft-p90", "2", "--user-tok-s", "130", "--max-gpus", "4",
                   "--jobs", "2", "--output", str(tmp_path)))  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads((tmp_path / "plan.json").read_text())
    best = data["plans"][0]
    assert (best["gpus"], best["shape"], best["policy"]) == (2, "1 x TP2", "kvmesh")
    assert best["meets"] and best["user_tok_s_p50"] >= 130 and best["ttft_p90_s"] <= 2
    assert best["usd_per_m_output"] > 0 and best["ttft_margin_s"] > 0
    # the 1-GPU fleets were pruned by the cost model, never simulated
    one_gpu = [p for p in data["pruned"] if p["gpus"] == 1]
    assert one_gpu and {p["rule"] for p in one_gpu} == {"user speed"}
    assert all(r["gpus"] >= 2 for r in data["simulated"])
    # a family that met at 2 GPUs is not simulated again at 4
    assert not [r for r in data["simulated"] if r["shape"] == "2 x TP2"]
    assert "1 x TP2" in out and "margin" in out and "pruned" in out
    assert (tmp_path / "plan.png").stat().st_size > 0
    assert "tensorParallelSize: 2" in (tmp_path / "values.yaml").read_text()


def test_a_target_no_fleet_meets_names_the_binding_constraint(capsys) -> None:
    rc = main(plan("--ttft-p90", "0.001", "--user-tok-s", "130", "--max-gpus", "2",
                   "--jobs", "1"))  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1
    line = next(x for x in out.splitlines() if x.startswith("no plan meets the targets"))
    assert "TTFT p90" in line and "(target 0.001 s)" in line and "--max-gpus 2" in line
    assert "1 x TP2" in line


def test_a_speed_no_layout_reaches_is_pruned_without_simulating(capsys) -> None:
    rc = main(plan("--ttft-p90", "2", "--user-tok-s", "5000", "--max-gpus", "8", "--no-pd"))
    out = capsys.readouterr().out
    assert rc == 1
    assert "simulated 0 of the 0" in out
    line = next(x for x in out.splitlines() if x.startswith("no plan meets the targets"))
    assert "user speed" in line and "TP8" in line and "target 5000" in line


def test_pruning_drops_a_fleet_whose_decode_capacity_cannot_serve_the_agents() -> None:
    workload = Workload.preset("agentic")
    one_gpu = Candidate("", 1, 1, 0, "kvmesh", 0, False)
    eight_gpus = Candidate("", 8, 1, 0, "kvmesh", 0, False)
    cap = capacity(one_gpu, "llama-3.1-8b", "h100", workload.mean_context_tokens(), 30, "0.8")
    assert cap.batch_at_target > 0 and cap.decode_tok_s > 0
    many = Targets(agents=800, ttft_p90_s=2, user_tok_s=30)
    few = Targets(agents=20, ttft_p90_s=2, user_tok_s=30)
    args = (workload, "llama-3.1-8b", "h100", 2.0, "0.8")
    kept, pruned = prune([one_gpu, eight_gpus], many, *args)
    assert [(p.candidate, p.rule) for p in pruned] == [(one_gpu, "decode capacity")]
    assert kept == [eight_gpus]
    assert f"{cap.decode_tok_s:,.0f} tok/s" in pruned[0].detail
    kept, pruned = prune([one_gpu], few, *args)  # the same fleet serves 20 agents
    assert kept == [one_gpu] and not pruned


def test_the_budget_prunes_what_costs_more() -> None:
    fleets = enumerate_candidates("llama-3.1-8b", "h100", 4, host_tier_gib=0)
    targets = Targets(agents=4, ttft_p90_s=2, user_tok_s=10, budget_usd_per_hour=5.0)
    kept, pruned = prune(fleets, targets, Workload.preset("agentic"), "llama-3.1-8b", "h100",
                         2.35, "0.8")  # fmt: skip
    assert {c.gpus for c in kept} == {1, 2}
    assert pruned and {p.rule for p in pruned} == {"budget"}
    assert all(p.candidate.gpus >= 3 for p in pruned)


def test_candidates_cover_layouts_pd_tier_and_mtp_where_the_model_has_it() -> None:
    dense = enumerate_candidates("llama-3.1-8b", "h100", 4, host_tier_gib=32)
    assert {c.tp for c in dense} == {1, 2, 4}
    assert any(c.prefill_units for c in dense) and any(c.host_tier_gib == 32 for c in dense)
    assert not any(c.mtp for c in dense)  # Llama ships no MTP layers
    moe = enumerate_candidates("glm-5.2-moe", "h100", 64)
    assert {c.layout for c in moe} >= {"dp32"} and any(c.mtp for c in moe)
    assert all(c.gpus <= 64 for c in moe)
    with pytest.raises(ValueError, match="--workload"):
        Workload.preset("nope")


def test_values_text_sets_what_the_plan_chose(tmp_path: Path) -> None:
    import yaml

    from kvmesh.plan.outputs import helm_values

    c = Candidate("dp16", 0, 3, 1, "pd", 64, True)
    values = helm_values(c, "glm-5.2-moe")
    assert values["pd"] == {"enabled": True, "prefill": {"replicas": 1}, "decode": {"replicas": 2}}
    ms = values["modelServer"]
    assert ms["dataParallel"] == {"size": 16, "expertParallel": True} and ms["gpus"] == 16
    assert "--speculative-config" in ms["vllm"]["extraArgs"]
    assert yaml.safe_load(yaml.safe_dump(values)) == values


def test_a_host_tier_is_pruned_where_the_gpus_hold_all_the_agents_can_reuse() -> None:
    workload = Workload.preset("agentic")
    plain = Candidate("", 1, 1, 0, "kvmesh", 0, False)
    tiered = Candidate("", 1, 1, 0, "kvmesh", 64, False)
    args = (workload, "llama-3.1-8b", "h100", 2.35, "0.8")
    few = Targets(agents=4, ttft_p90_s=2, user_tok_s=30)
    kept, pruned = prune([plain, tiered], few, *args)
    assert kept == [plain] and [(p.candidate, p.rule) for p in pruned] == [
        (tiered, "host tier idle")
    ]
    more = Targets(agents=60, ttft_p90_s=2, user_tok_s=30)  # more context than one GPU holds
    assert workload.working_set_tokens(60) > capacity(tiered, "llama-3.1-8b", "h100", 9000, 30,
                                                      "0.8").kv_tokens  # fmt: skip
    kept, _ = prune([plain, tiered], more, *args)
    assert kept == [plain, tiered]


def test_the_search_probes_doubling_counts_then_bisects_to_the_cheapest(monkeypatch) -> None:
    from kvmesh.plan import search
    from kvmesh.plan.results import judge

    targets = Targets(agents=4, ttft_p90_s=1, user_tok_s=50)

    def fake_run(fleet: Candidate, policy: str, agents) -> dict:  # meets from 5 engines on
        speed = 60.0 if fleet.gpus >= 5 else 40.0
        return {"ttft_ms_p90": 100.0, "user_tok_s_p50": speed}

    monkeypatch.setattr(search, "simulate", fake_run)
    fleets = [Candidate("", 1, n, 0, "kvmesh", 0, False) for n in range(1, 17)]
    lines: list[str] = []
    s = search.Search(fleets, lambda c: c, None, lambda c, summary: judge(
        c, summary, targets, float(c.gpus), None), jobs=1, top=1, log=lines.append)  # fmt: skip
    results = s.run()
    assert [r.candidate.gpus for r in results] == [1, 2, 4, 8, 6, 5]
    assert [r.candidate.gpus for r in results if r.meets] == [8, 6, 5]
    assert lines[0] == "1 GPUs: 1 candidates"


def test_bad_targets_get_a_message_not_a_traceback(capsys) -> None:
    assert main(plan("--ttft-p90", "2", "--user-tok-s", "0")) == 2
    assert "--ttft-p90 and --user-tok-s must be positive" in capsys.readouterr().err
    assert main(plan("--ttft-p90", "2", "--user-tok-s", "60", "--workload", "chat")) == 2
    assert "--workload must be one of" in capsys.readouterr().err
    assert main(plan("--ttft-p90", "2", "--user-tok-s", "60", "--policies", "nope")) == 2
    assert "--policies takes router presets" in capsys.readouterr().err
