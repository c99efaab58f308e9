"""`kvmesh bench up`: the ratios it reports (up over separate processes, a preset over round
robin) and none from a row whose requests failed; and a tiny run of both setups end to end."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvmesh.bench.kv_regime import cache_tokens, regime, regime_line
from kvmesh.bench.up_bench import add_args, cache_lines, main, ratios
from kvmesh.bench.workloads import agentic, shared_prefix


def row(p50: float, p90: float, errors: int = 0) -> dict:
    return {"ttft_ms_p50": p50, "ttft_ms_p90": p90, "errors": errors, "requests": 10}


def test_ratios_pair_up_with_separate_and_each_preset_with_round_robin() -> None:
    rows = {
        "b: kvmesh up [kvmesh]": row(50.0, 100.0),
        "c: serve + router [kvmesh]": row(40.0, 100.0),
        "b: kvmesh up [round-robin]": row(100.0, 400.0),
        "c: serve + router [round-robin]": row(80.0, 200.0, errors=1),
    }
    got = {(r["setup"], r["what"]): r for r in ratios(rows)}
    assert set(got) == {
        ("b: kvmesh up [kvmesh]", "up / separate"),
        ("b: kvmesh up [kvmesh]", "kvmesh / round-robin"),
        ("c: serve + router [kvmesh]", "kvmesh / round-robin"),
        ("b: kvmesh up [round-robin]", "up / separate"),
    }
    assert got["b: kvmesh up [kvmesh]", "up / separate"] == {
        "setup": "b: kvmesh up [kvmesh]", "over": "c: serve + router [kvmesh]",
        "what": "up / separate", "p50": 1.25, "p90": 1.0,
    }  # fmt: skip
    assert got["b: kvmesh up [kvmesh]", "kvmesh / round-robin"]["p90"] == 0.25
    # a row with a failed request gives no ratio, in either role
    assert got["c: serve + router [kvmesh]", "kvmesh / round-robin"]["failed"] == 1
    assert "p50" not in got["b: kvmesh up [round-robin]", "up / separate"]


def info(blocks: int, size: int = 16, rank: str = "0") -> str:
    labels = f'block_size="{size}",enable_prefix_caching="True",engine="{rank}",'
    return f'vllm:cache_config_info{{{labels}num_gpu_blocks="{blocks}"}} 1.0\n'


def test_cache_tokens_read_from_vllm_cache_config_info() -> None:
    page = "# HELP vllm:cache_config_info Information of the cache config.\n" + info(1024)
    assert cache_tokens(page + "vllm:num_requests_running 0.0\n") == 16 * 1024
    assert cache_tokens(info(100, 32) + info(50, 32, "1")) == 32 * 150  # ranks on one page
    assert cache_tokens("vllm:num_requests_running 0.0\n") is None


def test_regime_says_whether_one_engine_or_only_the_fleet_holds_the_groups() -> None:
    small = regime([16384] * 4, groups=16, prefix_tokens=3000)
    assert small["regime"] == "the fleet holds every group's prefix, one engine does not"
    assert (small["groups_one_engine_holds"], small["groups_fleet_holds"]) == (5, 21)
    assert regime([450_000] * 4, 8, 3000)["regime"] == "one engine holds every group's prefix"
    assert regime([4000] * 4, 8, 3000)["regime"] == "the fleet cannot hold every group's prefix"
    assert regime([16384, None], 16, 3000)["regime"] == "unknown"
    line = regime_line(small)
    assert "16,384 tokens per engine (65,536 over 4)" in line
    assert "16 groups x 3,000-token prefix = 48,000 tokens: one engine holds 5 of the 16" in line
    assert line.endswith("the fleet 16 (the fleet holds every group's prefix, one engine does not)")
    # what one engine or the fleet could hold beyond the groups there are is not counted
    assert "one engine holds 5 of the 8, the fleet 8 (" in regime_line(regime([16384] * 4, 8, 3000))


def test_cache_lines_state_the_regime_once_per_fleet() -> None:
    wl = shared_prefix(groups=16, prompts_per_group=2, system_tokens=3000)
    rows = {
        "b: kvmesh up [kvmesh]": {"kv_cache_tokens": [16384] * 4},
        "c: serve + router [kvmesh]": {"kv_cache_tokens": [16384] * 4},
        "b: kvmesh up [round-robin]": {"kv_cache_tokens": [16384] * 4},
    }
    (line,) = cache_lines(wl, rows)
    assert "one engine holds 5 of the 16, the fleet 16" in line
    assert line.endswith("[b: kvmesh up, c: serve + router]")
    (line,) = cache_lines(
        agentic(sessions=1, turns=1), {"b: kvmesh up [kvmesh]": rows["b: kvmesh up [kvmesh]"]}
    )
    assert line == "KV cache per engine, tokens: [16384, 16384, 16384, 16384] [b: kvmesh up]"


@pytest.mark.slow
def test_a_tiny_run_measures_both_setups_and_presets(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_args(parser)
    argv = ["--workload", "agentic", "--sessions", "2", "--turns", "2", "--fanout", "0"]
    argv += ["--engines", "2", "--presets", "kvmesh,round-robin", "--stop-load", "2"]
    assert main(parser.parse_args([*argv, "--out", str(tmp_path)])) == 0
    doc = json.loads((tmp_path / "up_bench.json").read_text())
    setups, presets = ("b: kvmesh up", "c: serve + router"), ("kvmesh", "round-robin")
    assert set(doc["rows"]) == {f"{s} [{p}]" for s in setups for p in presets}
    for result in doc["rows"].values():
        assert result["errors"] == 0 and result["requests"] == 4 and result["ttft_ms_p50"] > 0
    assert len(doc["ratios"]) == 4
    # the engines' KV caches as they declare them (emulated H100s: the same for all)
    caches = [r["kv_cache_tokens"] for r in doc["rows"].values()]
    assert all(len(c) == 2 and c[0] > 0 and c == caches[0] for c in caches)
