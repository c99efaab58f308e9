"""An engine's start says what it is doing: a line per step, and how far a long step has got."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time

import pytest

from kvmesh.engine import load_progress


def test_counted_reports_at_most_every_interval_and_once_at_the_end(caplog) -> None:
    ticks = iter(float(t) for t in range(100))  # one second per item
    with caplog.at_level(logging.INFO, logger="kvmesh.engine.load"):
        got = list(load_progress.counted(range(10), 10, "tensors", every_s=3, clock=ticks.__next__))
    assert got == list(range(10))
    assert caplog.messages == [
        "tensors: 3/10 (30%)",
        "tensors: 6/10 (60%)",
        "tensors: 9/10 (90%)",
        "tensors: 10/10 in 10.0 s",
    ]


def test_counted_says_nothing_of_an_end_that_never_came(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvmesh.engine.load"):
        assert list(load_progress.counted(iter([1, 2]), 5, "tensors", every_s=60)) == [1, 2]
    assert caplog.messages == []


def started(cmd: list[str], ready: str, timeout: float) -> list[str]:
    """The lines `cmd` printed until one holds `ready` (the process is stopped then)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not any(ready in line for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "exited before it was ready:\n" + "".join(lines)
            lines.append(line)
        assert any(ready in line for line in lines), "".join(lines)
        return lines
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def in_order(lines: list[str], steps: list[str]) -> bool:
    at = [next((i for i, line in enumerate(lines) if step in line), -1) for step in steps]
    return -1 not in at and at == sorted(at)


def test_emulated_serve_says_what_it_loads_before_the_engines_are_up() -> None:
    cmd = [sys.executable, "-m", "kvmesh.cli", "serve", "--emulate", "2", "--port", "0"]
    lines = started(cmd, "engine http://", 60)
    steps = ["loading the tokenizer", "building 2 emulated engines", "2 emulated engines"]
    assert in_order(lines, steps), "".join(lines)


@pytest.mark.slow  # loads the embedded model: 20-40 s on a small CPU
def test_serve_says_each_step_of_the_model_load() -> None:
    cmd = [sys.executable, "-m", "kvmesh.cli", "serve", "--port", "0", "--num-gpu-blocks", "64"]
    lines = started(cmd, "kvmesh engine ready: http://", 300)
    steps = [
        "loading the embedded SmolLM2-135M-Instruct on cpu",
        "reading SmolLM2-135M-Instruct.Q4_1.gguf",
        "building the model (30 layers, hidden size 576)",
        "dequantizing the weights: ",
        "loading the tokenizer",
        "allocating the KV cache",
        "kvmesh engine ready: http://127.0.0.1:",
    ]
    assert in_order(lines, steps), "".join(lines)
    assert any(re.search(r"dequantizing the weights: (\d+)/\1 in", line) for line in lines)
