"""The in-process micro-benchmarks of the router (benchmarks/router_path.py and
benchmarks/router_scheduling.py): every timed request goes through the router's front door, pick
and proxy to an endpoint and back, or the run fails; the scheduling figures cover every stage."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def script(name: str) -> ModuleType:
    """A script under benchmarks/, imported as the module it is when run there."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_every_request_is_answered_through_the_router(tokenizer) -> None:
    out = script("router_path").run_path(["kvmesh", "round-robin"], 60, 2, tokenizer)
    assert out["requests"] == 60 and out["rounds"] == 2
    for figures in out["presets"].values():
        for kind in ("repeated", "new", "extended"):
            assert len(figures[kind]["runs"]) == 2
            assert figures[kind]["us"] == min(figures[kind]["runs"]) > 0


def test_a_request_the_router_does_not_answer_200_fails_the_run(tokenizer, monkeypatch) -> None:
    router_path = script("router_path")
    bad = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}"
    monkeypatch.setattr(router_path, "ANSWER", bad)
    with pytest.raises(RuntimeError, match="0 of 60 answered"):
        router_path.run_path(["round-robin"], 60, 1, tokenizer)


def test_scheduling_times_tokenizing_hashing_and_the_pick_warm_and_cold(capsys) -> None:
    scheduling = script("router_scheduling")
    micro = scheduling.run_micro(tokens=1024, n_endpoints=16, repeats=6, cold_repeats=2,
                                 noise_blocks=50)  # fmt: skip
    assert micro["endpoints"] == 16 and micro["blocks"] == micro["prompt_tokens"] // 16 > 0
    for phase, repeats in (("warm", 6), ("cold", 2)):
        assert micro[phase]["repeats"] == repeats == sum(micro[phase]["chosen"].values())
        for part in ("total_ms", "tokenize_ms", "hash_ms", "schedule_ms"):
            assert micro[phase][part]["p50"] > 0 and micro[phase][part]["p99"] > 0
    scheduling.print_table(micro)
    assert "in-process scheduling: 1024 tokens" in capsys.readouterr().out
