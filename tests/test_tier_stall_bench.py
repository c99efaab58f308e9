"""`kvmesh bench tier-stall --quick` end to end: each trial's prefix came from where its mode
says (disk for sync and async, the device for the floor), and the stream was measured."""

from __future__ import annotations

from tests.helpers import run_quick_bench


def test_quick_tier_stall_bench(tmp_path):
    # one torch thread: a second one waiting for a busy core stalls every decode step
    data = run_quick_bench("tier-stall", tmp_path / "stall", "tier_stall.json", "--threads", "1")
    full = (400 - 1) // 16 * 16
    modes = {t["mode"]: t for t in data["trials"]}
    assert set(modes) == {"sync", "async", "device"}
    for mode, trial in modes.items():
        assert trial["cached_tokens"] == full, mode
        assert trial["max_gap_s"] > 0 and trial["ttft_s"] > 0
        assert (trial["disk_blocks_loaded"] > 0) == (mode != "device"), mode
    assert set(data["summary"]) == {"sync", "async", "device"}
