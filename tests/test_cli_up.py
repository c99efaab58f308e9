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


def test_up_starts_serve_and_router_with_its_flags_and_keys_by_environment(monkeypatch):
    """The children's command lines parse back to the very configs `up` validated; no key is
    on a command line, each is in the children's environment."""
    import dataclasses

    from kvmesh.commands import up_supervisor
    from kvmesh.commands.flags import config_from_args
    from kvmesh.commands.router import router_config_from
    from kvmesh.commands.up import child_env, engine_command, router_command
    from kvmesh.engine.emulation.builder import EmulationConfig

    for var in ("VLLM_API_KEY", "KVMESH_ADMIN_API_KEY", "PYTHONHASHSEED"):
        monkeypatch.delenv(var, raising=False)
    argv = ["up", "--emulate", "3", "--port", "9100", "--block-size", "32", "--max-num-seqs", "7"]
    argv += ["--no-enable-chunked-prefill", "--emulate-gpu", "h200", "--emulate-ttft-ms", "5"]
    argv += ["--emulate-itl-ms", "1", "--prefix-caching-hash-algo", "xxhash", "--preset", "load"]
    argv += ["--max-retries", "4", "--trust-request-chat-template", "--api-key", "k1"]
    args = build_parser().parse_args([*argv, "--admin-api-key", "adm"])
    config, emu = _engine_config(args), config_from_args(EmulationConfig, args)
    urls = [f"http://127.0.0.1:{9101 + i}" for i in range(3)]
    rcfg = up_router_config(config, args, urls)
    engine, router = engine_command(config, emu, args), router_command(rcfg, config, args)
    assert not {"k1", "adm"} & {*engine, *router}
    env = child_env(config)
    assert (env["VLLM_API_KEY"], env["KVMESH_ADMIN_API_KEY"]) == ("k1", "adm")
    assert env["PYTHONHASHSEED"].isdigit()  # xxhash: engines and router share one NONE_HASH
    for var in ("VLLM_API_KEY", "KVMESH_ADMIN_API_KEY"):
        monkeypatch.setenv(var, env[var])

    served = build_parser().parse_args(engine[3:])  # from --log-level on
    assert (served.command, served.emulate, served.port) == ("serve", 3, 9101)
    assert _engine_config(served) == config
    assert config_from_args(EmulationConfig, served) == emu

    routed = build_parser().parse_args(router[3:])
    assert (routed.command, routed.port, routed.endpoint) == ("router", 9100, urls)
    got = router_config_from(routed, routed.endpoint)
    # the key unset (its --api-key), and the drain within the grace `up` gives the router
    drains = dataclasses.replace(rcfg, shutdown_timeout=up_supervisor.ROUTER_DRAIN_S)
    assert dataclasses.replace(got, endpoint_api_key="k1") == drains
    assert got.upstream_authorization(None) == rcfg.upstream_authorization(None)
    assert (got.block_size, got.preset, got.max_retries) == (32, "load", 4)


def test_up_says_what_it_waits_for_while_children_start(monkeypatch, capsys):
    """While the engines load, a line at least every WAITING_EVERY_S says how many answer;
    then one when they all do, one as the router starts, one when it answers. The engine
    answers from its third look on; the router stops `up` once it said ready."""
    import sys

    from kvmesh.commands import up, up_ports, up_supervisor
    from tests.test_up_supervisor import IGNORES_SIGTERM, SLEEP, _model_name_then_mark

    looks: list[str] = []

    def healthy(url: str) -> bool:
        looks.append(url)
        return url.endswith(":9400") or looks.count(url) >= 3  # the router's: at once

    monkeypatch.setattr(up, "engine_command", lambda *a: [sys.executable, "-c", SLEEP])
    monkeypatch.setattr(up, "router_command", lambda *a: [sys.executable, "-c", IGNORES_SIGTERM])
    monkeypatch.setattr(up_supervisor, "_healthy", healthy)
    monkeypatch.setattr(up_supervisor, "_listens", lambda pid, port: True)
    monkeypatch.setattr(up_ports, "taken", lambda host, ports: [])  # fixed ports, never bound
    monkeypatch.setattr(up, "_model_name", _model_name_then_mark)
    monkeypatch.setattr(up_supervisor, "WAITING_EVERY_S", 0.0)  # a line at every look
    monkeypatch.setattr(up_supervisor, "GRACE_S", 0.5)
    monkeypatch.setattr(up_supervisor, "ROUTER_DRAIN_S", 0.0)
    args = build_parser().parse_args(["up", "--port", "9400"])
    assert up.run_up(_engine_config(args), None, args) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("kvmesh")]
    waiting = "kvmesh up: waiting for the engine: 0 of 1 answer /health after "
    assert sum(line.startswith(waiting) for line in lines) == 2  # the two looks it failed
    order = [
        "kvmesh up: starting the engine",
        "kvmesh up: waiting for the engine",
        "kvmesh up: the engine answers /health after",
        "kvmesh up: starting the router on port 9400",
        "kvmesh up: the router answers /health after",
        "kvmesh ready: http://127.0.0.1:9400/v1",
    ]
    at = [next(i for i, line in enumerate(lines) if line.startswith(o)) for o in order]
    assert at == sorted(at)
