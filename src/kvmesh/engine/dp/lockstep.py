"""Lockstep stepping of data-parallel ranks whose MoE layers exchange tokens (expert parallel).

Every engine iteration each rank calls ``agree`` exactly once with whether it has work; one
all_reduce over the control group tells every rank how many ranks have work. When any has, every
rank runs exactly one model forward that step: its own batch, or ``run_idle_step`` (every MoE
layer's collectives with zero local tokens) when it scheduled nothing. So all ranks issue the
same sequence of collectives and none waits forever for a peer that skipped one.
When none has work, ranks wait at most IDLE_POLL_S for new work before agreeing again: a request
that reaches one idle rank starts within that time on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from prometheus_client import Counter

from kvmesh.engine.dp.group import DataParallelGroup
from kvmesh.engine.metrics import EngineMetrics

IDLE_POLL_S = 0.02


class LockstepBroken(RuntimeError):
    """A peer rank is gone or stuck past the collective timeout: this rank cannot step."""


class Lockstep:
    idle_wait_s = IDLE_POLL_S

    def __init__(self, group: DataParallelGroup, metrics: EngineMetrics | None = None) -> None:
        self.group = group
        self._flag = torch.zeros(1, dtype=torch.int64)
        self.num_agreements = 0  # all_reduces done: equal on every rank at any agreed point
        self.num_steps = 0  # agreements in which some rank had work (a forward on every rank)
        self.num_idle_steps = 0  # of those, steps this rank had no work of its own
        self.hooks: list[Callable[[int], None]] = []  # after_step(num_steps), every rank
        self._steps = self._idle = None
        if metrics is not None:
            names = list(metrics.labels)
            self._steps = Counter(
                "kvmesh:dp_lockstep_steps",
                "Engine steps this data-parallel rank took in lockstep with its peers.",
                names,
                registry=metrics.registry,
            ).labels(**metrics.labels)
            self._idle = Counter(
                "kvmesh:dp_idle_steps",
                "Lockstep steps in which this rank had no work and ran an idle (dummy) step.",
                names,
                registry=metrics.registry,
            ).labels(**metrics.labels)

    def agree(self, has_work: bool) -> bool:
        """Whether any rank has work this step; raises LockstepBroken if a peer is lost."""
        self._flag[0] = int(has_work)
        try:
            dist.all_reduce(self._flag, op=dist.ReduceOp.SUM, group=self.group.control)
        except RuntimeError as exc:  # gloo: "Connection closed by peer", or a timeout
            raise LockstepBroken("a data-parallel peer rank was lost") from exc
        self.num_agreements += 1
        busy = int(self._flag[0]) > 0
        if busy:
            self.num_steps += 1
            if self._steps is not None:
                self._steps.inc()
            if not has_work:
                self.num_idle_steps += 1
                if self._idle is not None:
                    self._idle.inc()
        return busy

    def after_step(self) -> None:
        """After the step of an agreement that had work, on every rank: the hooks may run
        collectives (all ranks reach this point at the same num_steps)."""
        for hook in self.hooks:
            hook(self.num_steps)
