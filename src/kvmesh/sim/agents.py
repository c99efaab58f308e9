"""Coding agents in a closed loop: `kvmesh sim --workload agentic --agents N --duration S`.

Each of N agents runs agentic sessions back to back, each session the shape
`kvmesh.bench.workloads.agentic` generates for one session (shared system prompt and tool
definitions, one of the shared repositories, a task, a context that grows by an answer and a tool
output per turn, sub-agent fan-outs whose results join the parent's next turn, think time between
turns). The agent's next session starts a think time after the last request of its previous one
finishes, so the concurrency is the number of agents, as the seed's "concurrent agents" means.

Invariants:
- an agent has at most max(1, fanout) requests in flight: its turns are sequential (a turn
  arrives `delay` after the turns it follows finish) and only a fan-out's sub-agents overlap;
- a session starts only after the agent's previous session has entirely finished;
- no session starts at or after `duration`; requests of a running session still arrive until
  the run ends at `duration`, and what is in flight then stays unfinished in the records;
- one seed gives one run: each agent draws from its own RNG, seeded by (seed, agent index).

Prompts are runs of token ids as `sim.requests.workload_requests` makes them: the shared segments
(system, tools, repoK) have one id range for the whole run, every other segment an id range of
its own, so prompts share exactly what their segments share.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from kvmesh.bench.workloads import SEGMENT_BASE, SEGMENT_SPAN, agentic
from kvmesh.sim.fleet import FleetSim, SimRecord, SimRequest

SHARED = re.compile(r"(system|tools|repo\d+)")  # the segments sessions share with each other


@dataclass(slots=True)
class AgentConfig:
    agents: int = 100
    duration: float = 60.0  # virtual seconds
    ramp: float = 10.0  # agents start at uniform offsets in [0, ramp) (no thundering herd)
    seed: int = 0
    # the parameters of `kvmesh.bench.workloads.agentic` for one session (sessions and
    # session_rate are the loop's business and are ignored)
    workload: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.agents < 1:
            raise ValueError("--agents must be at least 1")
        if not self.duration > 0:
            raise ValueError("--duration must be positive")
        if self.ramp < 0:
            raise ValueError("--ramp-s must not be negative")
        self.workload = {
            k: v for k, v in self.workload.items() if k not in ("sessions", "session_rate")
        }

    @property
    def think_s(self) -> float:
        return float(self.workload.get("think_s", 1.0))

    @property
    def max_in_flight(self) -> int:
        """The most requests one agent can have in flight (a fan-out's sub-agents)."""
        return max(1, int(self.workload.get("fanout", 3)))


class ClosedLoop:
    """Drives a FleetSim with N agents; `run()` returns the records by rid."""

    def __init__(self, sim: FleetSim, config: AgentConfig) -> None:
        self.sim = sim
        self.config = config
        self.requests: dict[int, SimRequest] = {}  # every request issued, by rid
        self.agent_of: dict[int, int] = {}  # rid -> agent index
        self.sessions_started = 0
        self.sessions_finished = 0
        self._rngs = [random.Random(f"{config.seed}|agent{a}") for a in range(config.agents)]
        self._shared: dict[str, int] = {}  # shared segment key -> first token id
        self._next_range = 0  # segment id ranges handed out so far
        self._left: dict[int, int] = {}  # agent -> requests of its session not finished
        self._next_rid = 0
        sim.on_finish = self._finished

    def run(self, progress=None) -> dict[str, SimRecord]:
        """`progress(now)`: called about once per simulated second."""
        for a, rng in enumerate(self._rngs):
            self._start_session(a, rng.random() * self.config.ramp)
        self.sim.run_until(self.config.duration, progress)
        return self.sim.records

    def _start(self, key: str, private: dict[str, int]) -> int:
        """The first token id of segment `key` (shared across the run or private to a session)."""
        table = self._shared if SHARED.fullmatch(key) else private
        start = table.get(key)
        if start is None:
            start = table[key] = SEGMENT_BASE + self._next_range * SEGMENT_SPAN
            self._next_range += 1
        return start

    def _start_session(self, agent: int, at: float) -> None:
        """One session of the agentic shape for `agent`, its first turn arriving at `at`."""
        if at >= self.config.duration:
            return
        rng = self._rngs[agent]
        wl = agentic(sessions=1, **self.config.workload, seed=rng.getrandbits(63))
        n, private, rids = self.sessions_started, {}, {}
        self.sessions_started += 1
        for r in wl.requests:
            rid = rids[r.rid] = self._next_rid
            self._next_rid += 1
            runs = tuple((self._start(k, private), c) for k, c in r.prompt if c > 0)
            deps = tuple(rids[d] for d in r.deps)
            # x-session-id: the agent's session, or a sub-agent's thread within it
            tag = f"a{agent}.{n}" + r.agent.removeprefix("s0")
            req = SimRequest(rid, at, runs, max(1, r.max_tokens), tag, deps, r.delay)
            self.requests[rid] = req
            self.agent_of[rid] = agent
            self.sim.submit(req)
        self._left[agent] = len(wl.requests)

    def _finished(self, rec: SimRecord) -> None:
        agent = self.agent_of[rec.rid]
        self._left[agent] -= 1
        if self._left[agent] == 0:
            self.sessions_finished += 1
            rng = self._rngs[agent]
            think = rng.expovariate(1 / self.config.think_s) if self.config.think_s > 0 else 0.0
            self._start_session(agent, self.sim.now + think)
