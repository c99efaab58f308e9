"""`kvmesh up` takes the router's scheduling and failure-handling flags, checked before start."""

from __future__ import annotations

from kvmesh.cli import build_parser, main
from kvmesh.commands.serve import _engine_config, up_router_config


def test_up_passes_router_flags_and_the_engines_shared_settings(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    argv = ["up", "--preset", "load", "--stream-idle-timeout", "5", "--block-size", "32"]
    args = build_parser().parse_args([*argv, "--api-key", "k1", "--max-retries", "4"])
    config = _engine_config(args)
    rcfg = up_router_config(config, args, ["http://127.0.0.1:8001"])
    assert (rcfg.preset, rcfg.stream_idle_timeout, rcfg.max_retries) == ("load", 5.0, 4)
    assert rcfg.block_size == 32 and rcfg.api_key == rcfg.endpoint_api_key == "k1"
    default = build_parser().parse_args(["up"])
    assert up_router_config(_engine_config(default), default, []).preset == "kvmesh"


def test_up_refuses_a_bad_router_flag_before_starting_anything(capsys):
    assert main(["up", "--stream-idle-timeout", "-1"]) == 2
    assert "--stream-idle-timeout" in capsys.readouterr().err
