"""The real-time clock of an emulated data-parallel group whose ranks step in lockstep (expert
parallelism): the ranks' engines run in one process, and each rank's step ends when the group's
step does.

A group step opens when the first rank submits its batch (from its EmulatedRunner, through its
RankClock) and closes once every rank that has work has submitted, or GRACE_S after it starts
(a rank with work that scheduled nothing, e.g. waiting for KV, does not hold the others up; a
rank whose wake-up is due but has not run yet, as when the event loop lags, is waited for). Its
duration is the group cost over all ranks' batches (WideEPRoofline: the slowest rank sets the
step, idle ranks pay the dummy step), and every participant wakes at the same deadline. A rank
that gets work while a step runs joins the next one, which starts when the running one ends.
Invariants: one open step at a time; a rank submits at most once per step; deadlines follow one
ideal timeline (a step starts at its predecessor's end unless the group fell CATCH_UP_S behind).
What the engine stamps inside a step (token times for the TTFT / ITL histograms) uses a
provisional time, the previous group step's; the step's real end is the group's. Tier copy
times of a rank (--kv-offloading-*) are not added to a lockstep step.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvmesh.engine.async_engine import CATCH_UP_S
from kvmesh.engine.emulation.instance_roofline import StepCost
from kvmesh.engine.emulation.latency import LatencyModel, ModelSpec, SequenceWork

GRACE_S = 0.005  # wall seconds a step waits past its start for ranks with work to submit
LAG_LIMIT_S = 1.0  # ... and at most this long past it for ranks whose wake-up is due


class GroupCost(Protocol):
    """What prices a group step: an InstanceRoofline, or SlowestRank in constant mode."""

    model: ModelSpec

    def step_cost(self, works: Sequence[Sequence[SequenceWork]]) -> StepCost: ...

    def kv_capacity_bytes(self) -> float | None: ...


class SlowestRank:
    """Constant mode (--emulate-ttft-ms / --emulate-itl-ms) in lockstep: each rank's batch is
    priced alone and the slowest sets the step; idle ranks cost nothing."""

    def __init__(self, latency: LatencyModel, model: ModelSpec, dp_size: int) -> None:
        self.latency, self.model, self.dp_size = latency, model, dp_size

    def step_cost(self, works: Sequence[Sequence[SequenceWork]]) -> StepCost:
        times = [self.latency.step_time(list(w)) for w in works if w]
        time = max(times, default=0.0)
        return StepCost(time, time, 0.0, 1.0, sum(1 for w in works if not w))

    def kv_capacity_bytes(self) -> float | None:
        return None


class StepRecord(NamedTuple):
    index: int  # 1, 2, ... in the order the group's steps closed
    time: float  # emulated seconds the step lasted (every participant's step)
    ranks: tuple[int, ...]  # ranks that ran a batch; the others ran a dummy step
    cost: StepCost


@dataclass(slots=True)
class _Step:
    start: float  # loop time the step starts (its predecessor's end, or when it opened)
    works: list[list[SequenceWork] | None]  # per rank: its batch, or None (not submitted)
    done: asyncio.Future  # the loop time the step ends, once it closed


class GroupClock:
    def __init__(self, cost: GroupCost, dp_size: int, time_scale: float = 1.0) -> None:
        self.cost, self.dp_size, self.time_scale = cost, dp_size, time_scale
        self.has_work: list[Callable[[], bool]] = []  # per rank, set once the engines exist
        self.runners: list = []  # per rank: its EmulatedRunner (slowdown, last_step_time)
        self.num_steps = 0
        self.history: deque[StepRecord] = deque(maxlen=4096)
        self.on_step: list[Callable[[StepRecord], None]] = []
        self.due = [math.inf] * dp_size  # loop time each rank's engine wakes (inf: not asleep)
        self._open: _Step | None = None
        self._last_end: float | None = None  # loop time the last closed step ends
        self._last_time = 0.0

    def rank(self, index: int) -> RankClock:
        return RankClock(self, index)

    def submit(self, rank: int, work: list[SequenceWork]) -> tuple[_Step, float]:
        """Queue `rank`'s batch in the open step (opening one if none is): the step, and a
        provisional time (the last step's) for what the engine stamps before the step closes."""
        loop = asyncio.get_running_loop()
        step = self._open
        if step is None:
            now = loop.time()
            late = now - self._last_end if self._last_end is not None else math.inf
            start = self._last_end if late < CATCH_UP_S * self.time_scale else now
            assert start is not None
            step = self._open = _Step(start, [None] * self.dp_size, loop.create_future())
            loop.call_at(max(start, now) + GRACE_S, self._timeout, step)
        if step.works[rank] is not None:
            raise RuntimeError(f"data-parallel rank {rank} submitted twice in one lockstep step")
        step.works[rank] = list(work)
        self.due[rank] = math.inf
        loop.call_soon(self._check, step)
        estimate = self._last_time or self.cost.step_cost(self._works(step)).time
        return step, estimate

    def _works(self, step: _Step) -> list[list[SequenceWork]]:
        return [w if w is not None else [] for w in step.works]

    def _check(self, step: _Step) -> None:
        if step is not self._open:
            return
        if all(
            w is not None or not busy() for w, busy in zip(step.works, self.has_work, strict=True)
        ):
            self._close(step)

    def _timeout(self, step: _Step) -> None:
        """Close a step some rank with work did not join, unless that rank's wake-up is due
        (the loop ran the timer first): then look again once it has run."""
        if step is not self._open:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        waiting = any(
            w is None and busy() and self.due[r] <= now
            for r, (w, busy) in enumerate(zip(step.works, self.has_work, strict=True))
        )
        if waiting and now < step.start + LAG_LIMIT_S:
            loop.call_soon(self._timeout, step)
        else:
            self._close(step)

    def _close(self, step: _Step) -> None:
        if step is not self._open:
            return
        self._open = None
        cost = self.cost.step_cost(self._works(step))
        ranks = tuple(r for r, w in enumerate(step.works) if w is not None)
        slowdown = max((_slowdown(self.runners[r]) for r in ranks), default=1.0)
        time = cost.time * slowdown
        for r in ranks:  # every participant's step is the group's step
            runner = self.runners[r]
            delta = time - runner.last_step_time
            runner.last_step_time = time
            runner.predicted_time_total += delta
            runner.clock += delta
        self._last_time = time
        self._last_end = step.start + time * self.time_scale
        self.num_steps += 1
        record = StepRecord(self.num_steps, time, ranks, cost)
        self.history.append(record)
        for hook in self.on_step:
            hook(record)
        step.done.set_result(self._last_end)

    def close(self) -> None:
        """Stop: an open step ends now, so no rank waits on it."""
        step, self._open = self._open, None
        if step is not None and not step.done.done():
            step.done.set_result(asyncio.get_running_loop().time())


class RankClock(LatencyModel):
    """One rank's view of the group clock: the latency model of the rank's EmulatedRunner (its
    step time is provisional) and the runner's `lockstep_clock` (AsyncEngine awaits the end)."""

    def __init__(self, group: GroupClock, rank: int) -> None:
        self.group, self.rank_index = group, rank
        self.model = group.cost.model  # the runner reads KV bytes per token from it
        self._step: _Step | None = None

    def step_time(self, work: list[SequenceWork]) -> float:
        self._step, estimate = self.group.submit(self.rank_index, work)
        return estimate

    def kv_capacity_bytes(self) -> float | None:
        return self.group.cost.kv_capacity_bytes()

    async def step_end(self, fallback: float) -> float:
        """The loop time this rank's step ends: the group step's end, or `fallback` when the
        rank ran no batch this iteration."""
        step, self._step = self._step, None
        # shielded: a rank cancelled while it waits leaves the shared step to the others
        end = fallback if step is None else await asyncio.shield(step.done)
        self.group.due[self.rank_index] = end
        return end


def _slowdown(runner) -> float:
    faults = getattr(runner, "faults", None)
    return runner.slowdown * (faults.config.slowdown if faults is not None else 1.0)
