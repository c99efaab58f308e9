"""The `kvmesh` command: serve an engine, start the whole stack, route, run benchmarks.

Only the subcommand named on the command line is built in full, so `kvmesh --help` and
`kvmesh serve --help` import no more than that subcommand's flags need (no router for `serve`, no
benchmark for `router`); `build_parser()` without argv builds them all (tests, the CLI reference).
No parser takes abbreviations, and a subcommand's usage error prints that subcommand's usage."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from kvmesh.commands import convert
from kvmesh.commands.flags import add_dataclass_args, add_listen_args

BENCH_COMMANDS = {
    "engine": (
        "kvmesh.bench.engine_bench",
        "Engine tokens/s at batch 1, 8, 32 vs HF transformers; TTFT cold vs cached.",
    ),
    "emulation": (
        "kvmesh.bench.emulation_bench",
        "Emulated engines' measured TTFT and ITL vs what their latency model predicts.",
    ),
    "router": (
        "kvmesh.bench.router_bench",
        "Router added latency, top rate and scheduling time vs sglang-router, vllm-router.",
    ),
    "pd": (
        "kvmesh.bench.pd_bench",
        "P/D vs aggregated: long prompts, or agent sessions (--workload agentic) through "
        "never / always / selective disaggregation: TTFT, ITL, e2e.",
    ),
    "fleet": (
        "kvmesh.bench.fleet",
        "One workload through each routing policy over the same emulated fleet.",
    ),
    "tiers": (
        "kvmesh.bench.tiers_bench",
        "TTFT of a long prompt with its prefix on device, host tier, disk, a peer, or recomputed.",
    ),
    "tier-stall": (
        "kvmesh.bench.tier_stall_bench",
        "Decode stall while another request's prefix loads from disk: sync vs async loads.",
    ),
    "ep": (
        "kvmesh.bench.ep_bench",
        "Wide EP (DP8/16/32 with EP) vs TP8 on the emulated GLM-5.2-class MoE at rising "
        "concurrency, in virtual time: output tok/s per GPU, ITL, TTFT.",
    ),
    "up": (
        "kvmesh.bench.up_bench",
        "`kvmesh up` (supervised engine and router processes) vs the same engines behind a "
        "separate `kvmesh router`: hit rate, KV-event lag, TTFT on a Mooncake-format trace.",
    ),
    "chaos": (
        "kvmesh.bench.chaos",
        "Engine and router kills, dropped KV events, 5xx, hangs and stalls on an emulated fleet "
        "in one run: lost requests, eject / re-admit times, hit rate, index warm-up.",
    ),
    "spec": (
        "kvmesh.bench.spec_bench",
        "Speculative decoding off / n-gram / MTP head on the real model: tok/s and ITL per "
        "user on agentic edit tasks and plain chat at batch 1 and 8, greedy outputs checked.",
    ),
}


WORKLOAD_COMMANDS = {
    "agentic": "Coding-agent sessions (growing contexts, think time, sub-agent fan-outs) "
    "against one OpenAI-compatible URL: TTFT, ITL, hit rate, errors.",
    "shared-prefix": "Groups of prompts sharing a system prompt against one URL.",
    "trace": "Replay a Mooncake-format trace (equal hash_ids become equal 512-token blocks) "
    "against one URL.",
}


COMMANDS = {
    "serve": "Serve one engine with the OpenAI API on HTTP.",
    "up": "Start kvmesh on this machine: the router on --port in front of the engine "
    "(or of --emulate N emulated engines) on the ports after it.",
    "router": "Cache-aware router in front of vLLM-compatible engines.",
    "convert-gguf": convert.CONVERT_HELP,
    "sim": "Replay a trace through routing policies on emulated engines in virtual time.",
    "plan": "The cheapest fleets that meet N agents' TTFT and per-user speed targets, found by "
    "simulating candidate fleets pruned with the cost model.",
    "bench": "Benchmarks: each compares against its baseline in one run, writing JSON and plots.",
}


class Parser(argparse.ArgumentParser):
    """No abbreviations: --max-num-seq is an error, not --max-num-seqs."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


class SubcommandParser(Parser):
    """A subcommand's parser: arguments it does not know are its usage error (argparse would
    hand them up to `kvmesh`, whose usage says nothing of the subcommand's flags)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def named(argv: Sequence[str]) -> list[str]:
    """The positional words of argv before the first option after them: ['bench', 'engine'] for
    `kvmesh --log-level DEBUG bench engine --help`."""
    words: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--log-level" and not words:
            next(tokens, None)
        elif token.startswith("-"):
            if words:
                break
        else:
            words.append(token)
    return words


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `kvmesh` parser. With argv, only the subcommand (and bench) argv names is built in
    full, the others listed by name; without, every one."""
    words = None if argv is None else named(argv)

    def wanted(*path: str) -> bool:
        return words is None or words[: len(path)] == list(path)

    parser = Parser(
        prog="kvmesh",
        description="kvmesh: LLM inference for agentic workloads. An OpenAI-compatible engine "
        "with paged KV cache and prefix caching, speaking vLLM's wire formats.",
    )
    parser.add_argument("--log-level", default="INFO", help="Logging level [default: INFO].")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)
    for name, text in COMMANDS.items():
        if not wanted(name):
            sub.add_parser(name, help=text, description=text)
        elif name in ("serve", "up"):
            _add_serve(sub, name, text)
        elif name == "router":
            _add_router(sub, text)
        elif name == "convert-gguf":
            cp = sub.add_parser(name, help=text, description=convert.__doc__)
            convert.add_args(cp)
            cp.set_defaults(func=convert.main)
        elif name == "sim":
            from kvmesh.sim import replay

            _add_module_command(sub, name, text, replay)
        elif name == "plan":
            from kvmesh.plan import cli as plan_cli

            _add_module_command(sub, name, text, plan_cli)
        else:
            _add_bench(sub, text, wanted)
    return parser


def _add_module_command(sub, name: str, text: str, module) -> None:
    """A subcommand whose module describes it (its docstring), adds its flags (add_args) and
    runs it (main)."""
    p = sub.add_parser(
        name,
        help=text,
        description=(module.__doc__ or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_args(p)
    p.set_defaults(func=module.main)


def _add_serve(sub, name: str, text: str) -> None:
    from kvmesh.commands.serve_flags import add_serve_args

    p = sub.add_parser(name, help=text, description=text)
    add_serve_args(p)
    if name == "serve":
        from kvmesh.commands.serve import cmd_serve

        p.set_defaults(func=cmd_serve)
        return
    from kvmesh.commands.router import ROUTER_HELP
    from kvmesh.commands.serve import UP_ROUTER_FLAGS
    from kvmesh.router.config import RouterConfig

    routing = p.add_argument_group(
        "router", "The router's scheduling and failure handling, as `kvmesh router`'s."
    )
    helps = {k: ROUTER_HELP[k] for k in UP_ROUTER_FLAGS}
    add_dataclass_args(routing, RouterConfig, helps)
    from kvmesh.commands.up_supervisor import RESTART_HELP, RestartPolicy

    restarts = p.add_argument_group(
        "restarts",
        "A child (engine or router process) that exits once the stack is ready is "
        "restarted with exponential back-off; a crash loop stops `up`.",
    )
    add_dataclass_args(restarts, RestartPolicy, RESTART_HELP)
    from kvmesh.commands.up import cmd_up

    p.set_defaults(func=cmd_up)


def _add_router(sub, text: str) -> None:
    from kvmesh.commands.router import ROUTER_HELP, ROUTER_RENAMED, cmd_router
    from kvmesh.router.config import RouterConfig

    rp = sub.add_parser(
        "router",
        help=text,
        description="Serve the OpenAI API on one port and send each request to the engine where "
        "it is served fastest: above all the one that already holds its prefix (from the "
        "engines' KV events and the router's own decisions), then the least loaded.",
    )
    rp.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="URL",
        help="An engine's base URL (repeatable), e.g. http://127.0.0.1:8001.",
    )
    add_listen_args(rp)
    add_dataclass_args(rp, RouterConfig, ROUTER_HELP, ROUTER_RENAMED)
    rp.set_defaults(func=cmd_router)


def _add_bench(sub, text: str, wanted) -> None:
    bench = sub.add_parser("bench", help=text, description=text)
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module_name, help_text) in BENCH_COMMANDS.items():
        if not wanted("bench", name):
            bench_sub.add_parser(name, help=help_text, description=help_text)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a benchmark module not in this checkout
            if exc.name != module_name:
                raise
            continue
        bp = bench_sub.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_args(bp)
        bp.set_defaults(func=module.main)
    for kind, help_text in WORKLOAD_COMMANDS.items():
        bp = bench_sub.add_parser(kind, help=help_text, description=help_text)
        if wanted("bench", kind):
            from kvmesh.bench import workload_cmd

            workload_cmd.add_args_workload(bp, kind)
            bp.set_defaults(func=workload_cmd.main_workload)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
