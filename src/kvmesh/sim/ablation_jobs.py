"""Runs of independent simulations (the rows of `--ablation`) in parallel processes.

Each run is one call of a module-level function in a fresh process (spawned: it imports what it
needs and shares nothing with its parent), so a fleet's memory is its own process's and is
returned to the system when the run ends. Results come back in the order of the calls, each as
soon as it and every call before it have finished, so a table can be printed row by row while
later rows still run. Progress goes to stderr: a line as each run ends, and one every
`heartbeat_s` while none does.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

from kvmesh.protocol.wording import plural


def default_jobs(num_calls: int) -> int:
    """One process per core, never more than there are runs."""
    return max(1, min(num_calls, multiprocessing.cpu_count()))


def elapsed(seconds: float) -> str:
    """'42 s' or '3 m 07 s'."""
    whole = int(seconds)
    return f"{whole} s" if whole < 60 else f"{whole // 60} m {whole % 60:02d} s"


def in_order(
    run: Callable[..., Any],
    calls: Sequence[tuple],
    names: Sequence[str],
    jobs: int,
    heartbeat_s: float = 60.0,
    log: Callable[[str], None] | None = None,
) -> Iterator[tuple[int, Any]]:
    """(index, run(*calls[index])) for every call, in index order; `jobs` processes at a time
    (1: in this process, one after another, with no progress lines)."""
    if jobs <= 1 or len(calls) <= 1:
        for i, args in enumerate(calls):
            yield i, run(*args)
        return
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    start = time.monotonic()
    total = len(calls)
    workers = min(jobs, total)
    say(f"{plural(total, 'run')} in {plural(workers, 'process', 'processes')}")
    context = multiprocessing.get_context("spawn")
    # a process per run: its peak RSS is its own, and its memory goes back when it ends
    with ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1) as pool:
        index: dict[Future, int] = {pool.submit(run, *args): i for i, args in enumerate(calls)}
        pending: set[Future] = set(index)
        results: dict[int, Any] = {}
        next_index = completed = 0
        while pending:
            done, pending = wait(pending, timeout=heartbeat_s, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=index.__getitem__):
                i = index[future]
                results[i] = future.result()
                completed += 1
                took = elapsed(time.monotonic() - start)
                say(f"  {names[i]} done ({completed}/{total}, {took})")
            if not done:
                running = min(workers, sum(1 for f in pending if f.running()))
                took = elapsed(time.monotonic() - start)
                say(f"  {completed}/{total} done, {running} running ({took})")
            while next_index in results:
                yield next_index, results.pop(next_index)
                next_index += 1
