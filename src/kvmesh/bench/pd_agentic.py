"""The fleet side of `kvmesh bench pd`: four emulated engines started once with KV transfer and
KV events, and each configuration (a router over them) run in turn with the engines' prefix caches
cleared in between. Configurations: aggregated (4 engines, `kvmesh` preset) and P/D (2 prefill +
2 decode, decode-first `disagg-profile-handler` with a `nonCachedTokens` threshold; 0 always
disaggregates). How many requests were disaggregated comes from the router's own counters
(kvmesh_router_requests_total{outcome="prefill_ok"}: a prefill leg that handed its KV over).
The client's hit rate counts KV pulled from a prefill engine as cached, as the decode engine
reports it; `computed_fraction` (the engines' prefix-cache queries minus hits, over the prompt
tokens) is the share of prompt tokens some engine actually prefilled."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvmesh.bench import loadgen
from kvmesh.bench.engine_probes import reset_caches, router_metrics
from kvmesh.bench.fleet_procs.engines import start_fleet_engines
from kvmesh.bench.fleet_procs.procs import Proc, start_healthy
from kvmesh.bench.progress import BenchRun
from kvmesh.bench.workloads import Workload

TRANSFER = json.dumps(
    {"kv_connector": "NixlConnector", "kv_role": "kv_both"}, separators=(",", ":")
)
ROLES = ("prefill", "prefill", "decode", "decode")

# fmt: off
# Coding agents over long shared contexts (2k system + 2k tool definitions, one of 4 repositories
# of 8k tokens): a session's first turn is ~12k tokens, and every later turn adds a tool output and
# an answer (~230 tokens, mostly below the 256-token threshold) to a context its decode engine
# already holds. About 190 requests, ~2.6M prompt tokens, 15k output tokens per configuration.
AGENTIC = {"sessions": 16, "turns": 6, "system_tokens": 2000, "tool_def_tokens": 2000,
           "repos": 4, "repo_tokens": 8000, "task_tokens": 200, "tool_tokens": 150,
           "answer_tokens": 80, "think_s": 2.0, "fanout": 3, "fanout_rate": 0.2,
           "sub_turns": 2, "sub_task_tokens": 150, "return_tokens": 150, "session_rate": 0.5}
AGENTIC_QUICK = {"sessions": 4, "turns": 3, "system_tokens": 400, "tool_def_tokens": 400,
                 "repos": 2, "repo_tokens": 800, "task_tokens": 100, "tool_tokens": 100,
                 "answer_tokens": 16, "think_s": 0.1, "fanout": 2, "fanout_rate": 0.5,
                 "sub_turns": 1, "session_rate": 2.0}
# fmt: on


@dataclass(frozen=True)
class Configuration:
    name: str
    router_args: tuple[str, ...]
    disaggregated: bool  # the P/D pools (2 prefill + 2 decode) rather than 4 aggregated


def slug(name: str) -> str:
    """A configuration's name as a file name part."""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def pd_scheduler_yaml(threshold: int) -> str:
    """An EndpointPickerConfig for selective P/D (the `pd` preset's shape) at `threshold`
    uncached tokens on the chosen decode endpoint; 0 disaggregates every request."""
    score = [
        {"pluginRef": "precise-prefix-cache-scorer", "weight": 2},
        {"pluginRef": "queue-scorer", "weight": 2},
        {"pluginRef": "active-request-scorer", "weight": 2},
    ]
    config = {
        "plugins": [
            {"type": "disagg-profile-handler", "parameters": {"nonCachedTokens": threshold}},
            {"type": "decode-filter"},
            {"type": "prefill-filter"},
            {"type": "precise-prefix-cache-scorer"},
            {"type": "prefix-cache-scorer"},
            {"type": "queue-scorer"},
            {"type": "active-request-scorer"},
        ],
        "schedulingProfiles": [
            {
                "name": "decode",
                "plugins": [
                    {"pluginRef": "decode-filter"},
                    *score[:1],
                    {"pluginRef": "prefix-cache-scorer", "weight": 1},
                    *score[1:],
                ],
            },
            {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}, *score]},
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


def configurations(mode: str, urls: list[str], threshold: int, out: Path) -> list[Configuration]:
    """The configurations one mode compares, their endpoint and scheduler files written to out."""
    endpoints = out / "endpoints.yaml"
    labelled = [
        {"url": u, "labels": {"llm-d.ai/role": r}} for u, r in zip(urls, ROLES, strict=True)
    ]
    endpoints.write_text(yaml.safe_dump(labelled))
    aggregated = (*(a for u in urls for a in ("--endpoint", u)), "--preset", "kvmesh")

    def pd(name: str, at: int) -> Configuration:
        path = out / f"scheduler-{slug(name)}.yaml"
        path.write_text(pd_scheduler_yaml(at))
        args = ("--endpoints-file", str(endpoints), "--scheduler-config", str(path))
        return Configuration(name, args, True)

    if mode == "agentic":
        return [
            Configuration("never", aggregated, False),
            pd("always", 0),
            pd("selective", threshold),
        ]
    return [Configuration("aggregated 4", aggregated, False), pd("P/D 2P+2D", threshold)]


def start_router(config: Configuration, out: Path) -> tuple[Proc, str]:
    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "kvmesh.cli", "--log-level", "WARNING", "router"]
        return cmd + ["--host", "127.0.0.1", "--port", str(port), *config.router_args]

    return start_healthy(command, out / f"router-{slug(config.name)}.log", f"router {config.name}")


def prefill_legs(metrics: dict[str, float]) -> dict[str, int]:
    """Prefill legs that handed their KV over (ok) and that failed (the decode engine then
    prefilled), summed over endpoints, from the router's request counters."""
    legs = {"ok": 0, "failed": 0}
    for key, value in metrics.items():
        if key.startswith("kvmesh_router_requests_total{"):
            for outcome in legs:
                if f'outcome="prefill_{outcome}"' in key:
                    legs[outcome] += int(value)
    return legs


def run_configurations(
    args: argparse.Namespace,
    wl: Workload,
    mode: str,
    threshold: int,
    scale: float,
    out: Path,
    bench: BenchRun,
) -> tuple[list[str], dict[str, dict], list[str]]:
    """(engine URLs, a summary per configuration, notes): the workload through every
    configuration of `mode` over the same four engines, each summary saved by `bench` as it
    finishes."""
    engine_args = argparse.Namespace(
        emulate_gpu=args.gpu,
        emulate_model=args.model,
        emulate_time_scale=scale,
        serve_args=f"--kv-transfer-config {TRANSFER}",
    )
    engines, urls = start_fleet_engines(engine_args, 4, out)
    rows: dict[str, dict] = {}
    notes: list[str] = []
    try:
        for config in configurations(mode, urls, threshold, out):
            notes += [f"cache not reset before {config.name}: {n}" for n in reset_caches(urls)]
            router, url = start_router(config, out)
            try:
                summary = asyncio.run(
                    loadgen.run_workload(
                        url,
                        wl,
                        concurrency=args.concurrency,
                        engines=urls,
                        label=config.name,
                        progress=bench.progress,
                        timeout_s=args.request_timeout,
                        time_scale=scale,
                    )
                )
                metrics = router_metrics(url)
                legs = prefill_legs(metrics)
                if not metrics.get('kvmesh_router_index_entries{index="precise"}'):
                    notes.append(f"{config.name}: the router's precise index stayed empty")
            finally:
                router.stop()
            summary["disaggregated"] = legs["ok"]
            summary["prefill_failed"] = legs["failed"]
            summary["disaggregated_fraction"] = round(legs["ok"] / max(1, summary["requests"]), 4)
            # prompt tokens some engine computed (the rest came from a cache or a transfer)
            computed = sum(
                e.get("queries", 0) - e.get("hits", 0) for e in summary["engines"].values()
            )
            summary["computed_tokens"] = int(computed)
            summary["computed_fraction"] = round(computed / max(1, summary["prompt_tokens"]), 4)
            summary["pools"] = "2 prefill + 2 decode" if config.disaggregated else "4 aggregated"
            rows[config.name] = summary
            bench.add({"name": config.name, **summary}, config.name)
    finally:
        engines.stop()
    return urls, rows, notes
