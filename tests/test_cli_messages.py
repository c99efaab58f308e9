"""What `kvmesh` says first: a wrong --model path before any load-time talk, a load line with no
time estimate it cannot keep, counts with the right plural."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

from kvmesh.cli import main
from kvmesh.commands.checks import DEFAULT_MODEL_ALIASES, model_problem
from kvmesh.protocol.wording import noun_for, plural
from tests.helpers import free_port


def test_plural() -> None:
    assert [plural(n, "endpoint") for n in (0, 1, 2)] == [
        "0 endpoints",
        "1 endpoint",
        "2 endpoints",
    ]
    assert plural(1, "emulated engine") == "1 emulated engine"
    assert plural(3, "entry", "entries") == "3 entries"
    assert [noun_for(n, "layer") for n in (1, 2)] == ["layer", "layers"]
    assert noun_for(1, "is", "are") == "is" and noun_for(0, "is", "are") == "are"


@pytest.mark.parametrize("command", [["serve"], ["serve", "--emulate"], ["up"], ["router"]])
def test_a_wrong_model_path_is_said_first(command, tmp_path, capsys, caplog) -> None:
    caplog.set_level(logging.INFO)
    missing = str(tmp_path / "no-such-model")
    argv = ["--log-level", "INFO", *command, "--model", missing, "--port", str(free_port())]
    if command == ["router"]:
        argv += ["--endpoint", "http://127.0.0.1:1"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    name = command[0]
    assert err.splitlines()[0] == (
        f"kvmesh {name}: --model {missing}: no such file or directory (give a local Hugging "
        "Face model directory, a .gguf file or 'default')"
    )
    assert out == "" and caplog.records == []  # nothing loaded, nothing started


def test_what_a_model_path_must_hold(tmp_path) -> None:
    assert model_problem(None, weights=True) is None
    assert model_problem("default", weights=True) is None
    (tmp_path / "m.gguf").write_bytes(b"")
    assert model_problem(str(tmp_path / "m.gguf"), weights=True) is None
    (tmp_path / "notes.txt").write_text("")
    assert "not a .gguf file" in model_problem(str(tmp_path / "notes.txt"), weights=False)
    assert "no config.json" in model_problem(str(tmp_path), weights=True)
    assert "no tokenizer files" in model_problem(str(tmp_path), weights=False)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert model_problem(str(tmp_path), weights=False) is None  # emulated engines, the router
    (tmp_path / "config.json").write_text("{}")
    assert model_problem(str(tmp_path), weights=True) is None


def test_the_embedded_model_has_the_loaders_names() -> None:
    from kvmesh.engine.models.loader import DEFAULT_ALIASES

    assert set(DEFAULT_ALIASES) == {None, *DEFAULT_MODEL_ALIASES}


@pytest.mark.parametrize(
    "model, said",
    [
        (None, "loading the embedded SmolLM2-135M-Instruct on cpu (can take a minute on a busy"),
        ("smollm2", "loading the embedded SmolLM2-135M-Instruct on cpu"),
        ("/models/qwen3", "loading /models/qwen3 on cpu..."),
    ],
)
def test_the_load_line_names_the_model_and_no_time_it_cannot_keep(
    model, said, monkeypatch, caplog
) -> None:
    import torch

    from kvmesh.engine import builder
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.models import loader

    def stop(*args, **kwargs):
        raise RuntimeError("stopped before the load")

    monkeypatch.setattr(loader, "load_model", stop)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the session's stays as is
    monkeypatch.setattr(torch, "manual_seed", lambda seed: None)
    with caplog.at_level(logging.INFO, "kvmesh.engine.builder"), pytest.raises(RuntimeError):
        builder.build_engine(EngineConfig(model=model))
    assert said in caplog.text and " s " not in caplog.text and "10-40" not in caplog.text
    assert ("embedded" in caplog.text) == (model != "/models/qwen3")


def test_the_routers_ready_line_counts_one_endpoint_in_the_singular() -> None:
    cmd = [sys.executable, "-m", "kvmesh.cli", "--log-level", "WARNING", "router", "--port", "0"]
    cmd += ["--endpoint", f"http://127.0.0.1:{free_port()}", "--preset", "round-robin"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, line = time.monotonic() + 120, ""
        while time.monotonic() < deadline and "ready" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "router exited before it was ready"
        assert "/v1 (1 endpoint, 0 healthy, preset round-robin)" in line, line
    finally:
        proc.terminate()
        proc.wait(timeout=15)
