"""What the fleet simulator steps: dense engines, or serving instances of an MoE layout.

A unit is what takes a step on the event heap. A dense unit is one engine core with one endpoint
(the engine of `kvmesh serve --emulate`). An instance unit is a `DPGroup`, one real engine core per
data-parallel rank stepped in lockstep (`kvmesh bench ep`'s instance), with one endpoint per rank
as the HTTP router makes them for a DP server (router.endpoints.data_parallel_ranks:
`<name>#dp<rank>`, `dp_rank` set): the router picks a rank, and the request joins that rank.

Time: a dense step lasts what its runner's clock advanced (roofline, tier copies, idle waits for
a load), as before. An instance step lasts the instance roofline's time for all ranks' batches;
a rank's tier copies (stores overlap the step, synchronous loads hold it) stretch the step to the
longest of them, and when no rank ran a batch but some wait for a load, the step is the wait for
the first load to land. After each step every rank's runner clock is the group's time, so the
asynchronous tier loads of a rank land as the group's time passes.

Invariants: every endpoint belongs to exactly one unit; a unit has at most one step in flight;
an instance's step occupies all its GPUs (each rank's busy time is the step's).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.core import EngineCore, RequestOutput
from kvmesh.engine.emulation.builder import (
    EmulationConfig,
    build_emulated_engine,
    with_vllm_batch_defaults,
)
from kvmesh.engine.emulation.dp_group import DPGroup
from kvmesh.engine.emulation.instance_roofline import InstanceRoofline
from kvmesh.engine.emulation.layouts import build_roofline, layout_name, parse_layout
from kvmesh.engine.emulation.spec import parse_acceptance
from kvmesh.engine.sequence import Request
from kvmesh.protocol.wording import plural
from kvmesh.router.endpoints import Endpoint, data_parallel_ranks
from kvmesh.router.plugins.base import ROLE_LABEL
from kvmesh.sim.quiet import quieten


@dataclass(slots=True)
class SimEngine:
    """One endpoint of the fleet and the engine core behind it: a dense engine or a DP rank."""

    core: EngineCore
    endpoint: Endpoint
    unit: int  # index of its unit in FleetSim.units
    rank: int = 0  # its data-parallel rank within the unit
    events: list = field(default_factory=list)  # KV events of the step in flight
    busy_s: float = 0.0  # virtual seconds its GPUs spent stepping (steps started so far)
    busy_until: float = 0.0  # when the last step started ends


class DenseUnit:
    """One engine core: a step lasts what its runner's clock advanced."""

    __slots__ = ("engines", "busy")

    def __init__(self, engine: SimEngine) -> None:
        self.engines = [engine]
        self.busy = False  # a step is in flight (its end is on the event heap)

    def add_request(self, engine: SimEngine, request: Request) -> None:
        engine.core.add_request(request)

    def has_work(self) -> bool:
        return self.engines[0].core.has_work()

    def step(self, now: float) -> tuple[float, list[RequestOutput]]:
        core = self.engines[0].core
        runner = core.runner
        runner.clock = max(runner.clock, now)  # idle time passes on the engine's clock
        before = runner.clock
        outputs = core.step()
        return runner.clock - before, outputs


class InstanceUnit:
    """One DPGroup: every rank steps, the step lasts the instance roofline's time."""

    __slots__ = ("engines", "busy", "group", "runners")

    def __init__(self, group: DPGroup, engines: list[SimEngine]) -> None:
        self.group, self.engines = group, engines
        self.runners = [core.runner for core in group.ranks]
        self.busy = False

    def add_request(self, engine: SimEngine, request: Request) -> None:
        self.group.add_request(request, dp_rank=engine.rank)

    def has_work(self) -> bool:
        return self.group.has_work()

    def step(self, now: float) -> tuple[float, list[RequestOutput]]:
        runners = self.runners
        steps = []
        for runner in runners:
            runner.clock = now
            steps.append(runner.num_steps)
        self.group.now = now
        step = self.group.step()
        dt, waits = step.time, []
        for runner, before in zip(runners, steps, strict=True):
            own = runner.clock - now  # the rank's tier copies, or its idle wait for a load
            if runner.num_steps != before:
                dt = max(dt, own)
            elif own > 0:
                waits.append(own)
        if dt <= 0 and waits:
            dt = min(waits)
        for runner in runners:
            runner.clock = now + dt
        return dt, [out for _, out in step.outputs]


Unit = DenseUnit | InstanceUnit


def instance_roofline(layout: str, emu: EmulationConfig, placement: str) -> InstanceRoofline:
    """The roofline of one instance of `layout` ("dpN" / "tpN") for the emulated GPU and model."""
    if emu.emulate_ttft_ms is not None:
        raise ValueError(
            "--layout prices steps with the instance roofline; --emulate-ttft-ms and "
            "--emulate-itl-ms are for dense engines"
        )
    if emu.tensor_parallel_size != 1:
        raise ValueError("--layout names the parallelism; leave --tensor-parallel-size at 1")
    kind, n = parse_layout(layout)
    return build_roofline(
        kind,
        n,
        emu.emulate_gpu,
        emu.emulate_model,
        step_overhead_ms=emu.step_overhead_ms,
        gpu_memory_utilization=emu.gpu_memory_utilization,
        placement=placement,
    )


def build_units(
    engines: int,
    layout: str,
    engine_config: EngineConfig,
    emu: EmulationConfig,
    tokenizer,
    first: int = 0,
    role: str = "",
) -> list[Unit]:
    """`engines` dense engines, or with a layout `engines` instances of it, quiet (sim.quiet)
    and publishing their KV events into their endpoint's list; the first is unit `first` of
    the fleet. `role` ("prefill" / "decode"): their endpoints carry it as llm-d's role label
    (the router's P/D filters read it) and are named `<role>-<k>`; "": no label."""
    units: list[Unit] = []
    labels = {ROLE_LABEL: role} if role else {}
    if not layout:
        for i in range(engines):
            bundle = build_emulated_engine(engine_config, emu, tokenizer)
            name = f"{role or 'engine'}-{i}"
            endpoint = Endpoint(f"http://{name}", name=name, labels=dict(labels))
            units.append(DenseUnit(_engine(bundle.engine.core, endpoint, first + i, 0)))
        return units
    kind, n = parse_layout(layout)
    roofline = instance_roofline(layout, emu, engine_config.expert_placement_strategy)
    config = replace(
        with_vllm_batch_defaults(engine_config, emu),
        data_parallel_size=roofline.dp_size,
        enable_expert_parallel=kind == "dp" and n > 1,
    )
    acceptance = parse_acceptance(emu.emulate_spec_acceptance)
    for k in range(engines):
        group = DPGroup(roofline, config, tokenizer, acceptance)
        name = f"{role or 'instance'}-{k}"
        base = Endpoint(f"http://{name}", name=name, labels=dict(labels))
        ranks = data_parallel_ranks(base, group.dp_size)
        members = []
        for r, (core, endpoint) in enumerate(zip(group.ranks, ranks, strict=True)):
            members.append(_engine(core, endpoint, first + k, r))
            if core.runner.acceptance is not None:  # each instance draws its own acceptances
                core.runner.acceptance.rng.seed(str((config.seed, r, first + k)))
        units.append(InstanceUnit(group, members))
    return units


def _engine(core: EngineCore, endpoint: Endpoint, unit: int, rank: int) -> SimEngine:
    e = SimEngine(core, endpoint, unit, rank)
    core.publish_events = e.events.extend
    quieten(core)
    return e


def gpus_per_engine(layout: str, emu: EmulationConfig) -> int:
    """GPUs of one dense engine (--tensor-parallel-size) or of one instance of `layout`."""
    return parse_layout(layout)[1] if layout else emu.tensor_parallel_size


def fleet_size(engines: int, gpus: int, layout: str, emu: EmulationConfig) -> int:
    """Engines (or instances) of the fleet: `engines`, or `gpus` over the GPUs of one, which
    must divide it."""
    per = gpus_per_engine(layout, emu)  # parses the layout
    if gpus:
        unit = f"{layout_name(*parse_layout(layout))} instances" if layout else "engines"
        if gpus < 0 or gpus % per:
            raise ValueError(
                f"--gpus {gpus} is not a whole number of {unit} of {per} GPUs "
                f"({gpus // per} x {per} leaves {gpus % per})"
            )
        engines = gpus // per
    if engines < 1:
        raise ValueError("the fleet needs at least one engine or instance")
    return engines


def describe(engines: int, layout: str, gpus: int) -> str:
    """'4 engines' or '34 DP16/EP16 instances (544 GPUs)'."""
    if not layout:
        return plural(engines, "engine")
    name = layout_name(*parse_layout(layout))
    return f"{plural(engines, name + ' instance')} ({plural(gpus, 'GPU')})"
