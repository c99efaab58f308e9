"""The in-process request path of `kvmesh bench router`: every timed request goes through the
router's front door, pick and proxy to an endpoint and back, or the run fails."""

from __future__ import annotations

import pytest

from kvmesh.bench import router_path
from kvmesh.bench.router_path import run_path


def test_every_request_is_answered_through_the_router(tokenizer) -> None:
    out = run_path(["kvmesh", "round-robin"], 60, 2, tokenizer)
    assert out["requests"] == 60 and out["rounds"] == 2
    for figures in out["presets"].values():
        for kind in ("repeated", "new", "extended"):
            assert len(figures[kind]["runs"]) == 2
            assert figures[kind]["us"] == min(figures[kind]["runs"]) > 0


def test_a_request_the_router_does_not_answer_200_fails_the_run(tokenizer, monkeypatch) -> None:
    bad = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}"
    monkeypatch.setattr(router_path, "ANSWER", bad)
    with pytest.raises(RuntimeError, match="0 of 60 answered"):
        run_path(["round-robin"], 60, 1, tokenizer)
