"""Reading the load gauges a router needs from a vLLM-compatible /metrics page."""

from __future__ import annotations

from typing import NamedTuple

# current names first, then the names older vLLM versions used
WAITING = ("vllm:num_requests_waiting",)
RUNNING = ("vllm:num_requests_running",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


class EngineLoad(NamedTuple):
    waiting: float
    running: float
    kv_usage: float  # 0..1, the mean over data-parallel engines on one page


def parse_engine_load(text: str) -> EngineLoad:
    """Sum queue gauges and average KV usage over every `engine` series on the page."""
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = line.find("{")
        if name_end < 0:
            name_end = line.find(" ")
        name = line[:name_end]
        if name in WAITING or name in RUNNING or name in KV_USAGE:
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            found.setdefault(name, []).append(value)

    def first(names: tuple[str, ...]) -> list[float]:
        for n in names:
            if n in found:
                return found[n]
        return []

    usage = first(KV_USAGE)
    return EngineLoad(
        sum(first(WAITING)), sum(first(RUNNING)), sum(usage) / len(usage) if usage else 0.0
    )
