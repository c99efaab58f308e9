"""`kvmesh bench tiers --quick` end to end: three real engines, every prefix source checked."""

from __future__ import annotations

import pytest

from tests.helpers import run_quick_bench


def test_quick_tiers_bench(tmp_path):
    # one sample per row (each row is still measured and its source checked); one torch thread
    # per engine: four engines' threads on a 2-core box stall each other's small ops
    flags = ("--repeats", "1", "--threads", "1")
    data = run_quick_bench("tiers", tmp_path / "tiers", "tiers.json", *flags)
    n = data["settings"]["prompt_tokens"]
    full = (n - 1) // 16 * 16
    assert data["recomputed"]["cached_tokens"] == 0
    for name in ("device", "host", "disk", "peer", "peer_shm"):
        assert data[name]["cached_tokens"] == full, name
        assert data[name]["ttft_s"] > 0
    # each row's tokens came from where its name says
    assert data["device"]["moved"] == {}
    assert data["host"]["moved"] == {"kvmesh:kv_offload_hits_total[CPU]": full}
    assert data["disk"]["moved"].get("kvmesh:kv_offload_hits_total[DISK]", 0) >= full - 4 * 16
    for name, transport in (("peer", "tcp"), ("peer_shm", "shm")):
        assert data[name]["moved"] == {
            "kvmesh:kv_peer_pulled_tokens_total": full,
            f"kvmesh:kv_peer_transfers_total[{transport}/ok]": 1,
        }, name


def test_engines_start_together_and_all_stop_when_one_fails(tmp_path):
    from kvmesh.bench.fleet_procs.ports import free_port
    from kvmesh.bench.fleet_procs.serve import EngineProcess, engine_processes

    good = EngineProcess(free_port(), [], tmp_path / "good.log")
    bad = EngineProcess(free_port(), ["--no-such-flag"], tmp_path / "bad.log")
    with (
        pytest.raises(RuntimeError, match="exited with 2"),
        engine_processes(bad, good),
    ):
        raise AssertionError("not reached: the bad engine never comes up")
    assert good.proc is not None and good.proc.poll() is not None  # started, and stopped
    assert bad.proc is not None and bad.proc.returncode == 2  # argparse's usage error
