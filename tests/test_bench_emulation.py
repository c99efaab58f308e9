"""`kvmesh bench emulation --quick` end to end: emulated engines in a subprocess, this client."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from kvmesh.bench.emulation_bench import add_args, main, token_event


def test_token_event_tells_tokens_from_usage() -> None:
    assert token_event(b'{"id":"x","choices":[{"index":0,"text":" a"}]}')
    assert token_event(b'{"id": "x", "choices": [ {"index": 0, "text": ""}]}')
    assert not token_event(b'{"id":"x","choices":[],"usage":{"completion_tokens":3}}')
    assert not token_event(b'{"choices": [ ], "usage": {}}')
    assert not token_event(b"")


def test_help_explains_what_is_measured() -> None:
    parser = argparse.ArgumentParser()
    add_args(parser)
    text = parser.format_help()
    for word in ("TTFT", "ITL", "/admin/timing", "--light-streams", "--quick", "10%"):
        assert word in text


def test_quick_run_reports_ratios_for_both_loads(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = ["--quick", "--time-scale", "3", "--out", str(tmp_path)]
    assert main(parser.parse_args(args)) == 0
    result = json.loads((tmp_path / "emulation.json").read_text())
    assert (tmp_path / "emulation.png").stat().st_size > 0
    assert set(result["ratios"]) == {"light", "heavy", "heavy x3"}
    assert result["phases"]["heavy x3"]["time_scale"] == 3.0
    for name, ratios in result["ratios"].items():
        for key in ("ttft", "itl"):
            assert math.isfinite(ratios[key]) and ratios[key] > 0, (name, key, ratios)
        phase = result["phases"][name]
        overall = phase["overall"]
        assert overall["errors"] == 0, phase["per_engine"]
        # the client saw exactly the requests and token gaps the engines predicted times for
        assert overall["requests"] == overall["pred_ttft_count"] > 0
        assert overall["itl_gaps"] == overall["pred_itl_count"] > 0
        assert len(phase["per_engine"]) == phase["engines"]
    assert result["phases"]["heavy"]["engines"] == 2
    assert result["phases"]["heavy"]["streams_per_engine"] == 2
