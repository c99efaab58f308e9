"""benchmarks/third_party_load.py: the parsing of GuideLLM's JSON report (a trimmed report of a
real GuideLLM 0.8.1 run against an emulated engine answering 500 to some requests), the rule that
no ratio comes from a run with failures, and a tiny real run when GuideLLM's venv is there."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "third_party_load.py"
REPORT = Path(__file__).parent / "data" / "guidellm_0.8.1_report.json"
TOOL = ROOT / ".venv-loadgen" / "bin" / "guidellm"


def load_script():
    spec = importlib.util.spec_from_file_location("third_party_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_report_counts_failures_and_reads_ttft():
    tpl = load_script()
    got = tpl.parse_report(REPORT)
    assert got["tool_version"] == "0.8.1"
    assert (got["requests"], got["successful"], got["failed"]) == (10, 6, 4)
    assert sum(got["errors"].values()) == 4
    assert all("500 Internal Server Error" in msg for msg in got["errors"])
    ttft = json.loads(REPORT.read_text())["benchmarks"][0]["metrics"]["time_to_first_token_ms"]
    ttft = ttft["successful"]
    assert got["ttft_ms_p50"] == ttft["percentiles"]["p50"]
    assert got["ttft_ms_p90"] == ttft["percentiles"]["p90"]
    assert got["ttft_ms_mean"] == ttft["mean"]
    assert 0 < got["ttft_ms_p50"] <= got["ttft_ms_p90"]


def test_a_request_missing_from_the_report_counts_as_failed(tmp_path):
    tpl = load_script()
    doc = json.loads(REPORT.read_text())
    doc["benchmarks"][0]["scheduler_state"]["created_requests"] = 11  # one sent, never reported
    path = tmp_path / "report.json"
    path.write_text(json.dumps(doc))
    got = tpl.parse_report(path)
    assert (got["requests"], got["successful"], got["failed"]) == (11, 6, 5)
    assert got["errors"]["sent by GuideLLM but missing from its report"] == 1


def test_a_poisson_schedule_sent_as_one_burst_is_found(tmp_path):
    tpl = load_script()
    assert tpl.parse_report(REPORT)["burst"] == 0
    doc = json.loads(REPORT.read_text())
    for r in doc["benchmarks"][0]["requests"]["errored"]:  # arrival offsets from 0, not the start
        r["info"]["timings"]["targeted_start"] -= doc["benchmarks"][0]["scheduler_state"][
            "start_time"
        ]
    path = tmp_path / "report.json"
    path.write_text(json.dumps(doc))
    assert tpl.parse_report(path)["burst"] == 4


def run(stack: str, preset: str, failed: int, p50: float, rnd: int = 0) -> dict:
    ttft = {"ttft_ms_p50": p50, "ttft_ms_p90": 2 * p50, "ttft_ms_mean": 1.5 * p50}
    return {
        "stack": stack,
        "preset": preset,
        "round": rnd,
        "requests": 10,
        "failed": failed,
        "errors": {"boom": failed} if failed else {},
        "burst": 0,
        "hit_rate": 0.5,
        **ttft,
    }


def test_no_ratio_from_a_run_with_failures_and_medians_over_rounds():
    tpl = load_script()
    runs = [
        run("up", "kvmesh", 0, 50.0),
        run("up", "round-robin", 0, 100.0),
        run("up", "kvmesh", 0, 70.0, 1),
        run("up", "round-robin", 0, 100.0, 1),
        run("separate", "kvmesh", 2, 10.0),
        run("separate", "round-robin", 0, 100.0),
    ]
    rows = {(r["stack"], r["preset"]): r for r in tpl.summarize(runs, 5.0)}
    up = rows[("up", "kvmesh")]
    assert (up["ttft_ms_p50"], up["vs_rr_p50"], up["vs_rr_p90"]) == (60.0, 0.6, 0.6)
    assert up["ttft_emulated_ms_p50"] == 12.0 and up["requests"] == 20
    sep = rows[("separate", "kvmesh")]
    assert sep["failed"] == 2 and sep["vs_rr_p50"] is None and sep["vs_rr_p90"] is None
    lines = tpl.failures(runs)
    assert len(lines) == 1 and lines[0].startswith("FAILED: separate/kvmesh")
    burst = run("up", "kvmesh", 0, 900.0, 2) | {"burst": 10}
    rows = {(r["stack"], r["preset"]): r for r in tpl.summarize([*runs, burst], 5.0)}
    assert rows[("up", "kvmesh")]["ttft_ms_p50"] == 60.0  # the burst run is left out
    assert tpl.failures([burst])[0].startswith("LEFT OUT: up/kvmesh round 2")


def test_the_report_states_the_fleets_kv_caches_against_the_groups():
    tpl = load_script()
    args = tpl.parse_args(["--prefix-groups", "16", "--serve-args", "--num-gpu-blocks 1024"])
    assert args.serve_args == "--num-gpu-blocks 1024"
    broken = tpl.broken_run(args, "up", "kvmesh", 0, RuntimeError("no stack"))
    runs = [broken, run("up", "kvmesh", 0, 5.0) | {"kv_cache_tokens": [16384] * 4}]
    got = tpl.fleet_regime(runs, args)
    assert got["regime"] == "the fleet holds every group's prefix, one engine does not"
    assert (got["groups_one_engine_holds"], got["groups_fleet_holds"]) == (5, 21)
    assert tpl.fleet_regime([broken], args)["regime"] == "unknown"  # never read: not guessed


@pytest.mark.slow
@pytest.mark.skipif(not TOOL.exists(), reason=f"GuideLLM not installed in {TOOL.parent.parent}")
def test_tiny_run_through_guidellm(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--engines", "2", "--requests", "6", "--rate", "4"]
    cmd += ["--prefix-groups", "2", "--prefix-tokens", "128", "--prompt-tokens", "16"]
    cmd += ["--output-tokens", "4", "--stacks", "up", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "third_party_load.json").read_text())
    assert [r["preset"] for r in doc["summary"]] == ["kvmesh", "round-robin"]
    for r in doc["runs"]:
        assert r["failed"] == 0 and r["requests"] == 6 and r["ttft_ms_p50"] > 0
        assert 0 <= r["hit_rate"] <= 1
    assert "| up | kvmesh | 6 | 0 |" in proc.stdout
    for r in doc["runs"]:  # the emulated H100's default cache, as the engines declare it
        assert len(r["kv_cache_tokens"]) == 2 and r["kv_cache_tokens"][0] > 100_000
    assert doc["kv_regime"]["regime"] == "one engine holds every group's prefix"
    assert "(one engine holds every group's prefix)" in proc.stdout
