"""kvmesh sim --ablation: its rows, the flags each drops, the prefill-share estimate."""

from __future__ import annotations

import json

import pytest

from kvmesh.sim.ablation import PD_ROUND_ROBIN, prefill_share, variants, without_flag
from kvmesh.sim.ablation_cli import gpu_price

MTP = '{"method": "mtp", "num_speculative_tokens": 3}'


def test_without_flag_drops_both_spellings_and_keeps_the_rest() -> None:
    words, found = without_flag("--kv-offloading-size 64 --max-num-seqs 8", "--kv-offloading-size")
    assert found and words == ("--max-num-seqs", "8")
    words, found = without_flag("--kv-offloading-size=64 --block-size 32", "--kv-offloading-size")
    assert found and words == ("--block-size", "32")
    words, found = without_flag(("--speculative-config", MTP), "--speculative-config")
    assert found and words == ()
    assert without_flag("--max-num-seqs 8", "--kv-offloading-size") == (
        ("--max-num-seqs", "8"),
        False,
    )


def test_full_stack_then_each_technique_off_in_turn() -> None:
    rows = variants("kvmesh", "--kv-offloading-size 64", "dp16", ("--speculative-config", MTP))
    by_off = {r.off: r for r in rows}
    assert rows[0].off == "" and not rows[0].skipped
    assert [r.off for r in rows[1:]] == [
        "precise routing", "host tier", "peer sharing", "P/D", "wide EP", "MTP"
    ]  # fmt: skip
    full = rows[0]
    # each row changes exactly its own technique and keeps the others of the full stack
    assert by_off["precise routing"].policy == "round-robin"
    assert by_off["precise routing"].layout == "dp16"
    assert by_off["host tier"].serve_args == "" and by_off["host tier"].policy == "kvmesh"
    assert by_off["host tier"].engine_flags == full.engine_flags
    assert by_off["wide EP"].layout == "tp8"
    assert by_off["wide EP"].serve_args == full.serve_args
    assert by_off["MTP"].engine_flags == () and by_off["MTP"].layout == "dp16"
    assert by_off["MTP"].serve_args == full.serve_args
    assert "--kv-peer-min-cached-token-delta" in by_off["peer sharing"].skipped
    assert "--prefill-gpus" in by_off["P/D"].skipped
    # with both in the full stack, each row turns its own off
    rows = variants("pd", "", "dp16", (), prefill_gpus=64, peer_delta=2048)
    by_off = {r.off: r for r in rows}
    assert not any(by_off[t].skipped for t in ("precise routing", "peer sharing", "P/D"))
    assert rows[0].prefill_gpus == 64 and rows[0].peer_delta == 2048
    assert by_off["P/D"].prefill_gpus == 0 and by_off["P/D"].policy == "kvmesh"
    assert by_off["P/D"].peer_delta == 2048
    assert by_off["peer sharing"].peer_delta == 0 and by_off["peer sharing"].prefill_gpus == 64
    assert by_off["precise routing"].policy == PD_ROUND_ROBIN
    assert by_off["wide EP"].prefill_gpus == 64 and by_off["MTP"].prefill_gpus == 64


def test_a_technique_the_full_stack_lacks_is_listed_not_run() -> None:
    rows = variants("round-robin", "--max-num-seqs 64", "", ())
    skipped = {r.off: r.skipped for r in rows[1:]}
    assert all(skipped.values())
    assert "--kv-offloading-size" in skipped["host tier"]
    assert "--layout" in skipped["wide EP"]
    assert "--speculative-config" in skipped["MTP"]
    # MTP given through --serve-args counts too, and is dropped from them
    mtp = variants("kvmesh", f"--speculative-config '{MTP}' --max-num-seqs 64", "", ())[-1]
    assert not mtp.skipped and mtp.serve_args == "--max-num-seqs 64"


def test_prefill_share_is_compute_time_of_the_missed_tokens_over_busy_time() -> None:
    # 1e6 tokens x 2 x 1e9 params = 2e15 FLOPs at 1e15 x 0.5 = 4 s of 40 busy GPU-seconds
    assert prefill_share(1_000_000, 40.0, 1e9, 1e15, 0.5) == pytest.approx(0.1)
    assert prefill_share(10**12, 1.0, 1e9, 1e15, 0.5) == 1.0  # capped
    assert prefill_share(0, 10.0, 1e9, 1e15, 0.5) == 0.0
    assert prefill_share(5, 0.0, 1e9, 1e15, 0.5) == 0.0


def test_gpu_price_from_flag_or_price_file() -> None:
    assert gpu_price(3.5, "h100") == (3.5, "--gpu-hour-price")
    usd, source = gpu_price(None, "h100")
    assert usd > 0 and "http" in source
    with pytest.raises(ValueError):
        gpu_price(0.0, "h100")


def test_cli_ablation_runs_each_row_and_prices_the_full_stack(tmp_path, capsys) -> None:
    from kvmesh.cli import main

    out = tmp_path / "abl.json"
    argv = ["sim", "--workload", "agentic", "--agents", "6", "--duration", "6", "--layout"]
    argv += ["dp8", "--gpus", "16", "--emulate-gpu", "h200", "--no-ceiling", "--ablation"]
    argv += ["--serve-args", "--block-size 64 --kv-offloading-size 8", "--speculative-config", MTP]
    assert main([*argv, "--policies", "kvmesh", "--gpu-hour-price", "3", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ablation: 6 agents for 6 simulated s, 2 DP8/EP8 instances (16 GPUs)" in text
    assert "API/fleet" in text and "$3.00/GPU-hour from --gpu-hour-price" in text
    assert "assumed: mtp drafts (3) accepted per position at 0.8, 0.7, 0.6" in text
    assert "2.70 tokens per step" in text
    result = json.loads(out.read_text())
    assert result["spec_acceptance"] == [0.8, 0.7, 0.6]
    rows = {r["off"]: r for r in result["rows"]}
    assert set(rows) == {
        "",
        "precise routing",
        "host tier",
        "peer sharing",
        "P/D",
        "wide EP",
        "MTP",
    }
    ran = [r for r in result["rows"] if not r["skipped"]]
    assert {r["off"] for r in ran} == {"", "precise routing", "host tier", "wide EP", "MTP"}
    assert rows["wide EP"]["layout"] == "tp8" and rows["precise routing"]["policy"] == "round-robin"
    for r in ran:
        assert r["summary"]["output_tok_per_min"] > 0 and r["summary"]["gpus"] == 16
    # the bill is GPUs x hours x price, whatever the row: 16 x 6 s at $3/h
    assert rows[""]["cost"]["total_usd"] == pytest.approx(16 * 6 / 3600 * 3, abs=0.01)
    assert result["api_comparison"] and all(c["ratio"] > 0 for c in result["api_comparison"])
    assert (tmp_path / "abl.png").stat().st_size > 0
    assert (tmp_path / "abl-cost.png").stat().st_size > 0


def test_cli_ablation_needs_one_agent_count(capsys) -> None:
    from kvmesh.cli import main

    argv = ["sim", "--workload", "agentic", "--engines", "2", "--ablation"]
    assert main(argv) == 2
    assert main([*argv, "--agents", "2,4"]) == 2
    assert "--ablation" in capsys.readouterr().err


def test_cli_ablation_rows_in_parallel_processes_match_rows_run_in_turn(tmp_path, capsys) -> None:
    from kvmesh.cli import main

    argv = ["sim", "--workload", "agentic", "--agents", "6", "--duration", "4", "--layout"]
    argv += ["dp8", "--gpus", "16", "--emulate-gpu", "h200", "--no-ceiling", "--ablation"]
    argv += ["--serve-args", "--block-size 64 --kv-offloading-size 8", "--speculative-config", MTP]
    argv += ["--policies", "kvmesh", "--gpu-hour-price", "3"]
    results = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}.json"
        assert main([*argv, "--jobs", str(jobs), "--output", str(out)]) == 0
        results[jobs] = json.loads(out.read_text())
    err = capsys.readouterr().err
    assert "5 runs in 2 processes" in err and "MTP done (" in err
    wall = {"sim_wall_s", "wall_s_per_sim_min", "peak_rss_mb"}
    for one, two in zip(results[1]["rows"], results[2]["rows"], strict=True):
        assert one["name"] == two["name"] and one["cost"] == two["cost"]
        if one["summary"] is None:
            assert two["summary"] is None
            continue
        same = {k: v for k, v in one["summary"].items() if k not in wall}
        assert same == {k: v for k, v in two["summary"].items() if k not in wall}


def test_spec_acceptance_is_a_sim_flag_and_the_ablation_states_it() -> None:
    import argparse

    from kvmesh.sim.ablation_cli import drafter_assumption
    from kvmesh.sim.fleet_args import engine_flags, fleet_config

    args = argparse.Namespace(
        emulate_gpu="h200", speculative_config=MTP, emulate_spec_acceptance="0.5,0"
    )
    flags = engine_flags(args)
    assert flags[-2:] == ("--emulate-spec-acceptance", "0.5,0")
    config = fleet_config("--emulate-spec-acceptance 0.9", 0, 0.1, 0, "dp8", 16, flags)
    line, rates = drafter_assumption(config)
    assert rates == [0.5, 0.0]  # the sim flag wins over --serve-args
    assert "accepted per position at 0.5, 0 " in line and "1.50 tokens per step" in line
    no_mtp = fleet_config("", 0, 0.1, 0, "dp8", 16, ("--emulate-gpu", "h200"))
    assert drafter_assumption(no_mtp) is None
