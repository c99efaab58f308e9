"""`kvmesh bench up`: the ratios it reports (up over separate processes, a preset over round
robin) and none from a row whose requests failed; and a tiny run of both setups end to end."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvmesh.bench.up_bench import add_args, main, ratios


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
