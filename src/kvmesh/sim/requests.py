"""The requests of a `kvmesh sim` run: a Mooncake trace's rows, or a benchmark workload's
sessions (agentic, shared-prefix), as prompts of token-id runs with their arrival times and the
turns each waits for; and the hit-rate ceiling of a request list."""

from __future__ import annotations

from kvmesh.bench.workloads import Workload, read_trace_rows
from kvmesh.sim.fleet import SimRequest

TRACE_BLOCK = 512  # Mooncake hash_ids cover 512-token blocks
_TAIL_BASE = 1 << 40  # token ids of unshared tails start here, clear of every block's ids


def trace_requests(
    path: str, limit: int = 0, start: int = 0, time_scale: float = 1.0
) -> list[SimRequest]:
    """Block h of the trace is token ids h*512 .. h*512+511 wherever it appears (cut to the
    input length in a prompt's last block), so the prefix reuse is exactly the trace's."""
    rows = read_trace_rows(path, limit, start)
    t0 = rows[0]["timestamp"] if rows else 0
    out = []
    for rid, row in enumerate(rows):
        n = int(row["input_length"])
        prompt: list[tuple[int, int]] = []
        for j, h in enumerate(row["hash_ids"]):
            take = min(TRACE_BLOCK, n - j * TRACE_BLOCK)
            if take <= 0:
                break
            prompt.append((h * TRACE_BLOCK, take))
        covered = sum(k for _, k in prompt)
        if n > covered:
            prompt.append((_TAIL_BASE + (start + rid) * (1 << 20), n - covered))
        at = (row["timestamp"] - t0) / 1000 * time_scale
        out.append(SimRequest(rid, at, tuple(prompt), max(1, int(row["output_length"]))))
    return out


def hit_ceiling(requests: list[SimRequest], block_size: int) -> float:
    """An infinite cache on one engine: leading full blocks seen in an earlier prompt (at most
    (n - 1) // block_size of an n-token prompt, as vLLM). A block is known by its whole prefix."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        ids = r.token_ids()
        n = len(ids)
        total += n
        keys, parent = [], 0
        for k in range(0, n - block_size + 1, block_size):
            parent = hash((parent, tuple(ids[k : k + block_size])))
            keys.append(parent)
        run, limit = 0, (n - 1) // block_size
        while run < limit and keys[run] in seen:
            run += 1
        hit += run * block_size
        seen.update(keys)
    return hit / total if total else 0.0


_SEGMENT_BASE = 1 << 41  # token ids of workload segments start here, clear of the trace's


def workload_requests(wl: Workload) -> list[SimRequest]:
    """A benchmark workload as the sim's requests: each segment (system prompt, repository,
    tool output ...) is a run of token ids of its own, numbered by first appearance, so prompts
    share exactly the segments they share in the benchmark; a turn arrives its think time after
    the turns it follows finish."""
    starts: dict[str, int] = {}

    def start(key: str) -> int:  # runs 2^20 ids apart: room for any segment
        return starts.setdefault(key, _SEGMENT_BASE + (len(starts) << 20))

    return [
        SimRequest(
            r.rid,
            r.at,
            tuple((start(key), n) for key, n in r.prompt if n > 0),
            max(1, r.max_tokens),
            r.agent,
            r.deps,
            r.delay,
        )
        for r in wl.requests
    ]


def load_requests(source: tuple | list[SimRequest]) -> list[SimRequest]:
    """`source` is trace_requests' arguments (so a worker process reads the trace itself) or the
    requests themselves."""
    return trace_requests(*source) if isinstance(source, tuple) else source
