"""Command-line arguments shared by `kvmesh bench agentic|shared-prefix|trace` and `kvmesh bench
fleet`: the workload's parameters (each defaults to its generator's default) and the load mode."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the generators import the load client (aiohttp): only a run needs them
    from kvmesh.bench import workloads

KINDS = ("agentic", "shared-prefix", "trace")
DEFAULT_TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"

# (flag, type, generator keyword, help) per workload kind; defaults are the generators'
_ARGS: dict[str, list[tuple[str, type, str, str]]] = {
    "agentic": [
        ("--sessions", int, "sessions", "Agent sessions [16]."),
        ("--turns", int, "turns", "Turns per session [6]."),
        ("--system-tokens", int, "system_tokens", "Shared system prompt [1500 / 2000]."),
        ("--tool-def-tokens", int, "tool_def_tokens", "Shared tool definitions [1500]."),
        ("--repos", int, "repos", "Repositories; each session works in one [4]."),
        ("--repo-tokens", int, "repo_tokens", "Repository context per session [4000]."),
        ("--task-tokens", int, "task_tokens", "The session's task [200]."),
        ("--tool-tokens", int, "tool_tokens", "Mean tool output appended per turn [600]."),
        ("--answer-tokens", int, "answer_tokens", "Mean answer (max_tokens) per turn [120]."),
        ("--think-s", float, "think_s", "Mean think + tool time between turns, s [1.0]."),
        ("--fanout", int, "fanout", "Sub-agents per fan-out [3]."),
        ("--fanout-rate", float, "fanout_rate", "Chance that a turn fans out [0.2]."),
        ("--sub-turns", int, "sub_turns", "Turns of each sub-agent [2]."),
        ("--sub-task-tokens", int, "sub_task_tokens", "A sub-agent's task [150]."),
        ("--return-tokens", int, "return_tokens", "A sub-agent's result in the parent [150]."),
        (
            "--session-rate",
            float,
            "session_rate",
            "Open loop: session arrivals per second, Poisson (0: all at once) [0].",
        ),
    ],
    "shared-prefix": [
        ("--groups", int, "groups", "Shared system prompts [8]."),
        ("--prompts-per-group", int, "prompts_per_group", "Questions per group [16]."),
        ("--system-tokens", int, "system_tokens", "Shared system prompt [1500 / 2000]."),
        ("--question-tokens", int, "question_tokens", "Question length [200]."),
        ("--output-tokens", int, "output_tokens", "Output length [100]."),
        ("--rate", float, "rate", "Open loop: requests per second (0: trace times / at once)."),
    ],
    "trace": [
        ("--trace", str, "path", f"Mooncake-format JSONL [{DEFAULT_TRACE}]."),
        ("--trace-limit", int, "limit", "Requests replayed (0: all) [0]."),
        ("--trace-start", int, "start", "First request replayed [0]."),
        ("--time-scale", float, "time_scale", "Multiply the trace's timestamps [1.0]."),
        ("--rate", float, "rate", "Open loop: requests per second (0: trace times / at once)."),
        ("--max-output", int, "max_output", "Cap on output lengths (0: none) [0]."),
    ],
}


def add_workload_params(group, kinds: tuple[str, ...]) -> None:
    """The generator parameters of the given kinds (a flag shared by two kinds appears once)."""
    seen: set[str] = set()
    for kind in kinds:
        for flag, typ, _, text in _ARGS[kind]:
            if flag not in seen:
                seen.add(flag)
                group.add_argument(flag, type=typ, default=None, help=text)


def add_workload_args(parser: argparse.ArgumentParser, kinds: tuple[str, ...] = KINDS) -> None:
    """The parameters of the given workload kinds (a flag shared by two kinds appears once)."""
    if len(kinds) > 1:
        parser.add_argument(
            "--workload", choices=kinds, default=kinds[0], help=f"Workload to run [{kinds[0]}]."
        )
    group = parser.add_argument_group("workload")
    add_workload_params(group, kinds)
    group.add_argument("--seed", type=int, default=0, help="Workload seed [0].")
    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="Closed loop: sessions (requests, for shared-prefix and trace) in "
        "flight at once; 0: open loop at the workload's arrival times [0].",
    )
    load.add_argument(
        "--prompt-format",
        choices=("text", "ids"),
        default="text",
        help="Send prompts as text (the router and engine tokenize them) or as token ids, as a "
        "client that tokenizes itself does: the same tokens, without the tokenizing CPU, for "
        "long-prompt replays on a small host [text].",
    )
    load.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="Seconds before one request counts as an error [600].",
    )


def build_workload(
    args: argparse.Namespace, kind: str | None = None, **overrides
) -> workloads.Workload:
    """The workload the arguments describe; `overrides` fill parameters the user left unset."""
    from kvmesh.bench import workloads

    kind = kind or args.workload
    kw = {**overrides}
    for flag, _, name, _ in _ARGS[kind]:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            kw[name] = value
    kw["seed"] = args.seed
    if kind == "agentic":
        return workloads.agentic(**kw)
    if kind == "shared-prefix":
        return workloads.shared_prefix(**kw)
    kw.setdefault("path", DEFAULT_TRACE)
    if not Path(kw["path"]).is_file():
        raise SystemExit(f"trace file not found: {kw['path']}")
    return workloads.mooncake(**kw)
