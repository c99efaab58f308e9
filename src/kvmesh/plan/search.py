"""Which surviving candidates are simulated, in what order, in parallel processes.

Candidates are grouped by GPU count (their cost). The search assumes a fleet of a family (the
same layout, P/D share and techniques) does no worse with more GPUs, and runs whole GPU counts:

1. probe: the smallest count, then counts at least doubling, up to the largest, until one has a
   candidate that meets the targets (or the largest missed: no plan);
2. bisect: between the last count that missed and the first that met, down to the cheapest
   count that meets;
3. fill: the counts above it, until `top` plans meet; a family that met at fewer GPUs is not run
   again at more (it would cost more for nothing).

Each run is one closed loop of agents on a fresh fleet (kvmesh.sim.agents_cli.run_agents) in a
process of a spawned pool; stderr gets a line as each run ends, and one a minute otherwise."""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, ProcessPoolExecutor, wait

from kvmesh.plan.candidates import Candidate
from kvmesh.sim.agents import AgentConfig
from kvmesh.sim.fleet import FleetSimConfig

HEARTBEAT_S = 60.0  # a progress line this often while no run ends


def simulate(config: FleetSimConfig, policy: str, agents: AgentConfig) -> dict:
    """One candidate's closed-loop run (in a worker process): its summary."""
    from kvmesh.sim.agents_cli import run_agents

    return run_agents(config, policy, agents, ceiling=False, progress_bar=False)[1]


class Search:
    """Runs candidates level by level; `judge(candidate, summary)` -> a result with `.meets`."""

    def __init__(
        self,
        survivors: list[Candidate],
        configs: Callable[[Candidate], FleetSimConfig],
        agents: AgentConfig,
        judge: Callable,
        jobs: int,
        top: int,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.levels: dict[int, list[Candidate]] = {}
        for c in survivors:
            self.levels.setdefault(c.gpus, []).append(c)
        self.counts = sorted(self.levels)
        self.configs, self.agents, self.judge = configs, agents, judge
        self.jobs, self.top = max(1, jobs), top
        self.say = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.results: list = []
        self.met_families: dict[tuple, int] = {}  # family -> fewest GPUs it met at
        self.done: set[int] = set()
        self.started = time.monotonic()
        self.runs = 0

    def run(self) -> list:
        if not self.counts:
            return []
        pool: Executor | None = None
        if self.jobs > 1:
            context = multiprocessing.get_context("spawn")
            pool = ProcessPoolExecutor(self.jobs, mp_context=context)
        try:
            self._search(pool)
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
        return self.results

    def _search(self, pool: Executor | None) -> None:
        last = len(self.counts) - 1
        missed, met, i = -1, None, 0
        while True:  # probe
            if self._level(i, pool):
                met = i
                break
            missed = i
            if i == last:
                return
            gpus = self.counts[i]
            i = next((j for j in range(i + 1, last + 1) if self.counts[j] >= 2 * gpus), last)
        lo, hi = missed + 1, met - 1
        while lo <= hi:  # bisect
            mid = (lo + hi) // 2
            if self._level(mid, pool):
                met, hi = mid, mid - 1
            else:
                lo = mid + 1
        for j in range(met, last + 1):  # fill
            if sum(r.meets for r in self.results) >= self.top:
                return
            self._level(j, pool)

    def _level(self, index: int, pool: Executor | None) -> bool:
        """Run the candidates of one GPU count; whether any met the targets."""
        gpus = self.counts[index]
        if gpus in self.done:
            return any(r.meets for r in self.results if r.candidate.gpus == gpus)
        self.done.add(gpus)
        todo = [
            c
            for c in self.levels[gpus]
            if self.met_families.get(c.family, gpus + 1) > gpus  # not met at fewer GPUs
        ]
        self.say(f"{gpus} GPUs: {len(todo)} candidates")
        found = False
        for c, summary in self._run_all(todo, pool):
            result = self.judge(c, summary)
            self.results.append(result)
            self.runs += 1
            if result.meets:
                found = True
                self.met_families[c.family] = min(self.met_families.get(c.family, gpus), gpus)
            verdict = "meets" if result.meets else "misses"
            took = time.monotonic() - self.started
            self.say(
                f"  {c.label()}: TTFT p90 {summary['ttft_ms_p90'] / 1e3:.2f} s, "
                f"{summary['user_tok_s_p50']:.0f} tok/s per user: {verdict} ({took:.0f} s)"
            )
        return found

    def _run_all(self, todo: list[Candidate], pool: Executor | None):
        calls = [(self.configs(c), c.policy, self.agents) for c in todo]
        if pool is None or len(todo) <= 1:
            for c, args in zip(todo, calls, strict=True):
                yield c, simulate(*args)
            return
        index = {pool.submit(simulate, *args): c for c, args in zip(todo, calls, strict=True)}
        pending = set(index)
        while pending:
            done, pending = wait(pending, timeout=HEARTBEAT_S, return_when=FIRST_COMPLETED)
            if not done:
                took = time.monotonic() - self.started
                self.say(f"  {len(todo) - len(pending)}/{len(todo)} done ({took:.0f} s)")
            for future in done:
                yield index[future], future.result()
