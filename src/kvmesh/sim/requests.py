"""The requests of a `kvmesh sim` run: a Mooncake trace's rows, or a benchmark workload's
sessions (agentic, shared-prefix), as prompts of token-id runs with their arrival times and the
turns each waits for; and the hit-rate ceiling of a request list."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.protocol.ceiling import hit_ceiling as prefix_hit_ceiling
from kvmesh.protocol.trace import arrival_offsets, read_trace
from kvmesh.sim.records import SimRequest

if TYPE_CHECKING:  # the workload generators import the load client: loaded when one is converted
    from kvmesh.bench.workloads import Workload


def trace_requests(
    path: str, limit: int = 0, start: int = 0, time_scale: float = 1.0
) -> list[SimRequest]:
    """The trace's rows as kvmesh.protocol.trace converts them (block h is token ids
    h*512 .. h*512+511 wherever it appears), arriving at their timestamps times `time_scale`."""
    rows = read_trace(path, limit, start)
    offsets = arrival_offsets(rows, time_scale)
    return [
        SimRequest(rid, at, row.token_runs(), row.max_tokens)
        for rid, (row, at) in enumerate(zip(rows, offsets, strict=True))
    ]


def hit_ceiling(requests: list[SimRequest], block_size: int) -> float:
    """The requests' hit-rate ceiling (kvmesh.protocol.ceiling), as a rate."""
    return prefix_hit_ceiling((r.prompt for r in requests), block_size).hit_rate


def workload_requests(wl: Workload) -> list[SimRequest]:
    """A benchmark workload as the sim's requests, prompts as the benchmark's ceiling sees them
    (bench.workloads.segment_runs: each segment a run of token ids of its own, so prompts share
    exactly the segments they share in the benchmark); a turn arrives its think time after the
    turns it follows finish."""
    from kvmesh.bench.workloads import segment_runs

    return [
        SimRequest(r.rid, r.at, runs, max(1, r.max_tokens), r.agent, r.deps, r.delay)
        for r, runs in zip(wl.requests, segment_runs(wl.requests), strict=True)
    ]


def load_requests(source: tuple | list[SimRequest]) -> list[SimRequest]:
    """`source` is trace_requests' arguments (so a worker process reads the trace itself) or the
    requests themselves."""
    return trace_requests(*source) if isinstance(source, tuple) else source
