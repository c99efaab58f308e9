"""`kvmesh`'s parsers: lazy imports, no abbreviations, the subcommand's own usage on errors, and
one flag name per concept across serve, router and up (old spellings kept, with a warning)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvmesh.cli import build_parser

HEAVY = ("torch", "transformers", "matplotlib")


def _imported_after_parsing(argv: list[str], build_only: bool = False) -> set[str]:
    """The modules of interest in sys.modules of a fresh interpreter after `kvmesh argv` built
    its parser and parsed argv (build_only: a --help that would exit)."""
    code = (
        "import json, sys\n"
        "from kvmesh.cli import build_parser\n"
        f"argv = {argv!r}\n"
        "parser = build_parser(argv)\n"
        f"{'' if build_only else 'parser.parse_args(argv)'}\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_top_level_help_imports_no_subcommand() -> None:
    loaded = _imported_after_parsing(["--help"], build_only=True)
    for module in (*HEAVY, "aiohttp", "numpy", "kvmesh.router.app", "kvmesh.engine.builder"):
        assert module not in loaded, module
    assert not {m for m in loaded if m.startswith(("kvmesh.bench.", "kvmesh.sim."))}


# what reading a settings dataclass for --help must not pull in: the engine and router proper,
# their HTTP and array libraries (each settings class lives apart from what it configures)
NOT_FOR_FLAGS = (
    *HEAVY,
    "aiohttp",
    "numpy",
    "kvmesh.engine.builder",
    "kvmesh.engine.emulation.builder",
    "kvmesh.router.app",
)


@pytest.mark.parametrize("command", ["serve", "router", "up"])
def test_a_servers_help_reads_settings_not_servers(command) -> None:
    loaded = _imported_after_parsing([command, "--help"], build_only=True)
    assert not set(NOT_FOR_FLAGS) & loaded, set(NOT_FOR_FLAGS) & loaded
    assert "kvmesh.router.config" in loaded or command == "serve"
    assert "kvmesh.engine.emulation.config" in loaded or command == "router"


def test_sims_help_reads_flag_modules_not_the_simulator() -> None:
    # the flags of `kvmesh sim` (fleet, workload, agents, cost) live apart from the simulator,
    # the load client and the workload generators, which load when a run starts
    loaded = _imported_after_parsing(["sim", "--help"], build_only=True)
    assert not set(NOT_FOR_FLAGS) & loaded, set(NOT_FOR_FLAGS) & loaded
    heavy = ("kvmesh.sim.fleet", "kvmesh.sim.agents_cli", "kvmesh.bench.workloads", "tqdm")
    assert not set(heavy) & loaded, set(heavy) & loaded
    assert {"kvmesh.sim.replay", "kvmesh.sim.fleet_args", "kvmesh.sim.agent_args"} <= loaded
    parsed = _imported_after_parsing(["sim", "--workload", "agentic", "--agents", "4"])
    assert not {"torch", "numpy", "aiohttp", "kvmesh.sim.fleet"} & parsed


def test_a_subcommand_imports_only_what_its_flags_need() -> None:
    serve = _imported_after_parsing(["serve", "--port", "0"])
    assert not {*HEAVY, "kvmesh.router.app"} & serve
    assert not {m for m in serve if m.startswith(("kvmesh.bench.", "kvmesh.sim."))}
    router = _imported_after_parsing(["router", "--endpoint", "http://127.0.0.1:1"])
    assert not {*HEAVY, "kvmesh.engine.builder"} & router
    bench = _imported_after_parsing(["--log-level", "WARNING", "bench", "tiers", "--help"], True)
    assert "kvmesh.bench.tiers_bench" in bench and "kvmesh.bench.chaos" not in bench
    assert not set(HEAVY) & bench


def test_the_words_that_choose_what_is_built() -> None:
    from kvmesh.cli import named

    assert named(["--log-level", "DEBUG", "bench", "engine", "--help"]) == ["bench", "engine"]
    assert named(["serve", "--model", "default"]) == ["serve"]
    assert named(["--help"]) == []


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_parser_takes_abbreviations(capsys) -> None:
    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 10 and not [p.prog for p in parsers if p.allow_abbrev]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--max-num-seq", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-num-seq 4" in err


@pytest.mark.parametrize(
    "argv, usage",
    [
        (["serve", "--max-num-seq", "4"], "usage: kvmesh serve "),
        (["up", "--emulate", "2", "--bogus"], "usage: kvmesh up "),
        (["router", "--endpoint", "http://x:1", "--kv-event", "none"], "usage: kvmesh router "),
        (["bench", "tiers", "--bogus"], "usage: kvmesh bench tiers "),
        (["serve", "--port", "eighty"], "usage: kvmesh serve "),
    ],
)
def test_a_usage_error_prints_the_subcommands_usage(argv, usage, capsys) -> None:
    for parser in (build_parser(), build_parser(argv)):  # in full, and as `kvmesh` builds it
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(usage), err
        assert "kvmesh: error" not in err


def test_router_names_the_model_and_kv_events_as_the_engine_does(capsys) -> None:
    new = ["router", "--model", "/m", "--kv-events-config", "none"]
    args = build_parser().parse_args(new)
    assert (args.tokenizer, args.kv_events) == ("/m", "none")
    assert capsys.readouterr().err == ""
    engine = build_parser().parse_args(["serve", "--model", "/m", "--kv-events-config", "{}"])
    assert (engine.model, engine.kv_events_config) == ("/m", "{}")
    helps = build_parser(["router"])._subparsers._group_actions[0].choices["router"]
    text = helps.format_help()
    assert "--model MODEL" in text and "--kv-events-config KV_EVENTS_CONFIG" in text
    assert "--tokenizer TOKENIZER" not in text and "--kv-events KV_EVENTS" not in text


def test_the_routers_old_spellings_still_work_and_say_so(capsys) -> None:
    old = ["router", "--tokenizer", "/m", "--kv-events", "none"]
    args = build_parser().parse_args(old)
    assert (args.tokenizer, args.kv_events) == ("/m", "none")
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "kvmesh router: --tokenizer is deprecated; use --model",
        "kvmesh router: --kv-events is deprecated; use --kv-events-config",
    ]
    default = build_parser().parse_args(["router"])
    assert (default.tokenizer, default.kv_events) == (None, "auto")


def test_up_starts_its_router_with_the_new_names(tmp_path, capsys) -> None:
    from kvmesh.commands.serve import _engine_config, up_router_config
    from kvmesh.commands.up import router_command

    args = build_parser().parse_args(["up", "--model", str(tmp_path), "--port", "9300"])
    config = _engine_config(args)
    rcfg = up_router_config(config, args, ["http://127.0.0.1:9301"], kv_events=None)
    cmd = router_command(rcfg, config, args)
    assert "--tokenizer" not in cmd and "--kv-events" not in cmd
    routed = build_parser().parse_args(cmd[3:])
    assert (routed.tokenizer, routed.kv_events) == (str(tmp_path), "none")
    assert capsys.readouterr().err == ""
