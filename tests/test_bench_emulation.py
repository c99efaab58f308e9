"""`kvmesh bench emulation` end to end at --quick's sizes with 1 s phases: emulated engines in
a subprocess, this client."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from kvmesh.bench import emulation_bench
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


def test_quick_sizes_the_run_for_ci(monkeypatch, tmp_path: Path) -> None:
    """--quick: heavy 2 engines x 2 streams, light 1 x 1, 3 s a phase (the run below gives
    these sizes as flags, with 1 s phases)."""
    sizes = []

    def no_engines(args, count, streams, scale=1.0):
        sizes.append((args.engines, args.streams, args.light_engines, args.light_streams))
        sizes.append(args.duration)
        raise RuntimeError("no engines in this test")

    monkeypatch.setattr(emulation_bench, "start_engines", no_engines)
    parser = argparse.ArgumentParser()
    add_args(parser)
    assert main(parser.parse_args(["--quick", "--out", str(tmp_path)])) == 1
    assert sizes == [(2, 2, 1, 1), 3.0]


def test_quick_run_reports_ratios_for_both_loads(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = ["--engines", "2", "--streams", "2", "--light-engines", "1", "--light-streams", "1"]
    args += ["--duration", "1", "--time-scale", "2", "--out", str(tmp_path)]
    assert main(parser.parse_args(args)) == 0
    result = json.loads((tmp_path / "emulation.json").read_text())
    assert (tmp_path / "emulation.png").stat().st_size > 0
    assert set(result["ratios"]) == {"light", "heavy", "heavy x2"}
    assert result["phases"]["heavy x2"]["time_scale"] == 2.0
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
    rows = json.loads((tmp_path / "emulation.rows.json").read_text())  # saved as they ended
    assert rows["status"] == "complete" and rows["rows_done"] == rows["rows_total"] == 3
    assert [r["phase"] for r in rows["rows"]] == ["light", "heavy", "heavy x2"]
