"""A data-parallel group in virtual time: one real engine core per DP rank, stepped in lockstep.

Each rank is the engine core `kvmesh serve --emulate` runs (scheduler, block pool, prefix cache)
with its own KV capacity, the one the instance roofline leaves a rank. A step of the group is one
step of every rank: each schedules its own batch, and the step lasts what the instance roofline
(wide EP or TP) says for all the batches together, so the slowest rank sets it, and a rank with
nothing to run still takes part (its dummy batch is priced by the roofline). When no rank has
work the group takes no step. The front door is vLLM's internal load balancer: the rank with the
lowest 4 x waiting + running (ties to the lowest rank), unless the request names its rank as
`X-data-parallel-rank` does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from kvmesh.engine.builder import assemble
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.core import EngineCore, RequestOutput
from kvmesh.engine.emulation.instance_roofline import InstanceRoofline, StepCost
from kvmesh.engine.emulation.latency import LatencyModel, ModelSpec, SequenceWork
from kvmesh.engine.emulation.runner import EmulatedRunner
from kvmesh.engine.emulation.spec import DEFAULT_ACCEPTANCE
from kvmesh.engine.sequence import Request

NULL_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "null"})
WAITING_WEIGHT = 4  # vLLM's DP load balancer scores a rank 4 x waiting + running


def pick_dp_rank(counts: Sequence[tuple[int, int]], start: int = 0) -> int:
    """vLLM's internal load balancer over (waiting, running) per rank: the lowest score, the
    first found from `start` on a tie."""
    n = len(counts)
    best, best_score = start % n, None
    for i in range(n):
        rank = (start + i) % n
        waiting, running = counts[rank]
        score = WAITING_WEIGHT * waiting + running
        if best_score is None or score < best_score:
            best, best_score = rank, score
    return best


class _WorkRecorder(LatencyModel):
    """A rank's latency model inside a group: it keeps the rank's work of the step and charges
    nothing; the group prices every rank's work at once."""

    def __init__(self, model: ModelSpec) -> None:
        self.model = model  # the runner reads the KV bytes per token from it
        self.work: list[SequenceWork] = []

    def step_time(self, work: list[SequenceWork]) -> float:
        self.work = work
        return 0.0


class GroupStep(NamedTuple):
    time: float  # virtual seconds the step took
    cost: StepCost
    outputs: list[tuple[int, RequestOutput]]  # (dp rank, what the step added to a request)


class DPGroup:
    def __init__(
        self,
        roofline: InstanceRoofline,
        config: EngineConfig,
        tokenizer,
        spec_acceptance: tuple[float, ...] = DEFAULT_ACCEPTANCE,
    ) -> None:
        self.roofline = roofline
        spec = roofline.model
        per_block = spec.kv_bytes_per_token * config.block_size
        self.num_blocks = int(roofline.kv_capacity_bytes() // per_block)
        if self.num_blocks < 2:
            raise ValueError(f"{spec.name} leaves no room for a KV cache on a rank")
        max_len = min(config.max_model_len or spec.max_model_len, spec.max_model_len)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.ranks: list[EngineCore] = []
        self._recorders: list[_WorkRecorder] = []
        for rank in range(roofline.dp_size):
            cfg = replace(
                config,
                num_gpu_blocks=self.num_blocks,
                data_parallel_size=roofline.dp_size,
                data_parallel_rank=rank,
                kv_events_config=NULL_EVENTS,
            )
            recorder = _WorkRecorder(spec)
            runner = EmulatedRunner(recorder, self.num_blocks, cfg.block_size, max_len, tokenizer)
            runner.spec_acceptance, runner.spec_seed = spec_acceptance, (config.seed, rank, 0)
            bundle = assemble(
                cfg,
                runner,
                tokenizer,
                spec.name,
                f"emulated:{roofline.gpu.name}",
                (eos,) if isinstance(eos, int) else (),
            )
            core = bundle.engine.core
            core.step_observer = None
            self.ranks.append(core)
            self._recorders.append(recorder)
        self.now = 0.0  # virtual seconds
        self.num_steps = 0
        self.rank_of: dict[str, int] = {}  # request id -> its rank, until it finishes

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    def counts(self) -> list[tuple[int, int]]:
        """(waiting, running) per rank, what the balancer reads."""
        return [(c.scheduler.num_waiting, c.scheduler.num_running) for c in self.ranks]

    def add_request(self, request: Request, dp_rank: int | None = None) -> int:
        """Queue `request` on `dp_rank` (as X-data-parallel-rank names it) or on the rank the
        balancer picks; returns the rank."""
        if dp_rank is None:
            dp_rank = pick_dp_rank(self.counts())
        elif not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"data-parallel rank {dp_rank} is out of range [0, {self.dp_size})")
        self.ranks[dp_rank].add_request(request)
        self.rank_of[request.request_id] = dp_rank
        return dp_rank

    def has_work(self) -> bool:
        return any(c.has_work() for c in self.ranks)

    def step(self) -> GroupStep:
        """One lockstep step of every rank; its outputs are those at `now` after it."""
        outputs: list[tuple[int, RequestOutput]] = []
        for rank, (core, recorder) in enumerate(zip(self.ranks, self._recorders, strict=True)):
            recorder.work = []
            if core.has_work():
                outputs.extend((rank, out) for out in core.step())
        cost = self.roofline.step_cost([r.work for r in self._recorders])
        if cost.time > 0:
            self.now += cost.time
            self.num_steps += 1
        for _, out in outputs:
            if out.finished:
                self.rank_of.pop(out.request_id, None)
        return GroupStep(cost.time, cost, outputs)
