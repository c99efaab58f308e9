"""A fleet in virtual time: the real router pipeline in front of real engine cores.

Each engine is the engine core of `kvmesh serve --emulate` (scheduler, block pool, prefix cache,
tiers, KV events) around an EmulatedRunner, stepped on a virtual clock instead of the event
loop: a step that the roofline model says lasts 12 ms ends 12 virtual ms after it began, and
nothing waits for it. With a layout (`dp16`, `tp8`) the fleet is instances of an MoE model, each
a lockstep group of one engine core per DP rank, with an endpoint per rank (sim.instances).

The router is the real scheduling pipeline over `Endpoint` states kept as the HTTP router keeps
them: queue gauges from a scrape every `scrape_interval`, in-flight counts, prefill backlog and
the approximate index from the forward bookkeeping the HTTP router calls too
(router.forward_load), and the precise index from the engines' KV events (delivered when the step
that made them ends). Router and engines share one hashing of each prompt's blocks
(sim.digests), and the engines skip the metrics, step log and output text no one here reads
(sim.quiet): the same decisions and the same virtual times, in less wall time.

With a prefill pool (P/D: role-labelled endpoints behind the router's disagg profile handler)
or peer sharing, a prompt's KV moves between engines through the engines' own export and
import, taking the transfer time they compute (sim.pd).

No HTTP, no sockets, no sleeping: a trace of an hour on four engines replays in minutes, so a
policy can be tuned against a whole trace before a fleet run confirms it.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
from collections import defaultdict
from dataclasses import dataclass, field, replace

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.emulation.builder import EmulationConfig
from kvmesh.engine.sequence import Request as EngineRequest
from kvmesh.engine.sequence import SamplingParams
from kvmesh.protocol.hashing import BlockHasher
from kvmesh.protocol.kv_events import KVEventBatch
from kvmesh.router import forward_load
from kvmesh.router.approx_index import ApproximateIndex
from kvmesh.router.index import PreciseIndex
from kvmesh.router.peer_source import PeerSourceConfig, select_source
from kvmesh.router.pipeline import Pipeline
from kvmesh.router.plugins import SchedulingRequest
from kvmesh.sim.digests import PromptDigests
from kvmesh.sim.instances import SimEngine, Unit, build_units, describe, fleet_size, gpus_per_engine
from kvmesh.sim.pd import KVMoves, Transfer, check_policy, prefill_pool
from kvmesh.sim.quiet import no_text
from kvmesh.sim.records import SimRecord, SimRequest  # noqa: F401 - this module's API too

NULL_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "null"})


class _Policy:
    """What `kvmesh.router.app.Router` offers its plugins: the two indexes."""

    def __init__(self, index_capacity: int, approx_capacity: int) -> None:
        self.precise_index = PreciseIndex(index_capacity)
        self.approximate_index = ApproximateIndex(approx_capacity)


@dataclass(slots=True)
class FleetSimConfig:
    engines: int = 4  # dense engines, or with a layout its instances
    # "": dense engines; "dpN": DPN/EPN wide-EP instances of an MoE model; "tpN": TPN replicas
    layout: str = ""
    gpus: int = 0  # 0: `engines` engines or instances; else the fleet's GPUs, which set `engines`
    # P/D: GPUs of the fleet in its prefill pool (as many engines or instances of the layout),
    # the rest decode; 0: every engine serves whole requests (sim.pd)
    prefill_gpus: int = 0
    # peer sharing: the chosen engine pulls a prefix a peer holds this many tokens beyond its
    # own (the router's --kv-peer-min-cached-token-delta); 0: off (sim.pd)
    kv_peer_min_cached_token_delta: int = 0
    scrape_interval: float = 0.1  # virtual seconds between the router's metric scrapes
    index_capacity: int = 8_000_000
    approx_capacity_per_endpoint: int = 31_250
    seed: int = 0  # seeds the pickers' random tie-breaks: one seed, one outcome
    # look up what the router knew on every engine at each arrival (SimRecord.*_known_tokens,
    # "lost to routing"): a second index lookup per request
    measure_known: bool = True
    # a busy host (engines starved of CPU, as `kvmesh bench up --hog`): each engine step lasts
    # at least host_step_s plus host_request_s per request running there, virtual seconds of
    # host work whatever the roofline says (0, 0: the GPU's time alone)
    host_step_s: float = 0.0
    host_request_s: float = 0.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    prefill_engines: int = field(init=False, default=0)  # of `engines`, from prefill_gpus

    def __post_init__(self) -> None:
        self.layout = self.layout.strip().lower()
        self.engines = fleet_size(self.engines, self.gpus, self.layout, self.emulation)
        per = gpus_per_engine(self.layout, self.emulation)
        self.prefill_engines = prefill_pool(self.prefill_gpus, self.engines, self.layout, per)
        if self.host_step_s < 0 or self.host_request_s < 0:
            raise ValueError("--host-step-ms and --host-request-ms must be >= 0")
        if self.kv_peer_min_cached_token_delta < 0:
            raise ValueError("--kv-peer-min-cached-token-delta must be 0 (off) or positive")

    @property
    def num_gpus(self) -> int:
        return self.engines * gpus_per_engine(self.layout, self.emulation)

    def describe(self) -> str:
        """'4 engines', or '34 DP16/EP16 instances (544 GPUs)', and the P/D split."""
        text = describe(self.engines, self.layout, self.num_gpus)
        if self.prefill_engines:
            text += (
                f": {self.prefill_engines} prefill, {self.engines - self.prefill_engines} decode"
            )
        return text


class FleetSim(KVMoves):
    """Replays requests through one policy (a preset name or an EndpointPickerConfig YAML)."""

    def __init__(self, config: FleetSimConfig, policy: str, tokenizer) -> None:
        self.config = config
        engine_config = replace(config.engine, kv_events_config=NULL_EVENTS)
        self.state = _Policy(config.index_capacity, config.approx_capacity_per_endpoint)
        self.pipeline = (
            Pipeline.from_yaml(policy, self.state)
            if "\n" in policy
            else Pipeline.preset(policy, self.state)
        )
        for plugin in self.pipeline.plugins.values():  # random tie-breaks repeat with the seed
            if isinstance(getattr(plugin, "rng", None), random.Random):
                plugin.rng.seed(config.seed)
        for profile in self.pipeline.profiles.values():
            if isinstance(getattr(profile.picker, "rng", None), random.Random):
                profile.picker.rng.seed(config.seed)
        self.block_size = engine_config.block_size
        # one hashing per prompt block for router and engines (sim.digests)
        self.digests = PromptDigests(
            BlockHasher(engine_config.prefix_caching_hash_algo, self.block_size)
        )
        check_policy(self.pipeline, config.prefill_engines)
        if config.prefill_engines:  # decode units first, then the prefill pool
            decode = config.engines - config.prefill_engines
            build = (engine_config, config.emulation, tokenizer)
            self.units: list[Unit] = build_units(decode, config.layout, *build, role="decode")
            self.units += build_units(
                config.prefill_engines, config.layout, *build, first=decode, role="prefill"
            )
        else:
            self.units = build_units(
                config.engines, config.layout, engine_config, config.emulation, tokenizer
            )
        # one per endpoint: the dense engines, or every rank of every instance
        self.engines: list[SimEngine] = [e for u in self.units for e in u.engines]
        self.endpoints = [e.endpoint for e in self.engines]
        self._engine_of = {id(e.endpoint): i for i, e in enumerate(self.engines)}
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.records: dict[str, SimRecord] = {}
        self._loads: dict[str, forward_load.Load] = {}  # rid -> its forward's load, until finished
        self._deps_left: dict[int, int] = {}  # rid -> its deps not finished yet
        self._dependents: dict[int, list[SimRequest]] = defaultdict(list)
        self.on_finish = None  # called with each finished SimRecord (a closed-loop driver)
        self.transfers: dict[str, Transfer] = {}  # request id -> its KV move (P/D, peer)
        self._legs: dict[str, Transfer] = {}  # prefill legs in flight, by their engine request
        self.peer_sources = None
        if config.kv_peer_min_cached_token_delta:
            delta = config.kv_peer_min_cached_token_delta
            self.peer_sources = PeerSourceConfig(delta, self.block_size)
            for e in self.endpoints:  # the router names a source by host:port
                e.url += ":8000"

    # ---- the event loop ------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def submit(self, r: SimRequest) -> None:
        """Schedule `r`: it arrives at `r.at + r.delay`, or with deps `delay` after the last of
        them finishes (deps not yet submitted or finished count as pending)."""
        if r.deps:
            self._deps_left[r.rid] = len(r.deps)
            for d in r.deps:
                self._dependents[d].append(r)
        else:
            self._push(r.at + r.delay, "arrive", r)

    def run(self, requests: list[SimRequest], progress=None) -> list[SimRecord]:
        """Every request, each arriving at its time or, with deps, `delay` after the last of
        them finishes (a closed-loop session: the next turn follows the answer)."""
        for r in requests:
            self.submit(r)
        self._push(0.0, "scrape", None)
        pending = len(requests)
        while self._heap and pending:
            finished = self._next_event()
            if finished:
                pending -= finished
                if progress is not None:
                    progress(len(requests) - pending)
        return sorted(self.records.values(), key=lambda r: r.rid)

    def run_until(self, end: float, progress=None) -> None:
        """Every event up to virtual time `end`; `on_finish` may submit more requests. Steps
        in flight at `end` stay unfinished: records hold what had happened by then.
        `progress(now)` is called about once per simulated second."""
        self._push(0.0, "scrape", None)
        mark = 1.0
        while self._heap and self._heap[0][0] <= end:
            self._next_event()
            if progress is not None and self.now >= mark:
                progress(self.now)
                mark = int(self.now) + 1.0
        self.now = end

    def _next_event(self) -> int:
        """Handle the earliest event; the number of requests that finished in it."""
        self.now, _, kind, payload = heapq.heappop(self._heap)
        if kind == "arrive":
            return self._arrive(payload)
        elif kind == "step":
            return self._step_done(payload)
        elif kind == "add":  # a request whose KV has arrived joins its engine
            self._add(*payload)
        else:
            self._scrape()
            self._push(self.now + self.config.scrape_interval, "scrape", None)
        return 0

    def _scrape(self) -> None:
        for e in self.engines:
            s = e.core.scheduler
            e.endpoint.waiting, e.endpoint.running = s.num_waiting, s.num_running
            e.endpoint.kv_usage = e.core.kv.usage

    def _arrive(self, r: SimRequest) -> int:
        headers = {"x-session-id": r.session} if r.session else {}
        token_ids, digests, keys = self.digests.prepare(r.prompt)
        req = SchedulingRequest(str(r.rid), None, token_ids, list(keys), headers, self.block_size)
        endpoints = list(self.endpoints)  # the pipeline may keep the list it was given
        result = self.pipeline.schedule(req, endpoints)
        chosen = result.primary or self.engines[0].endpoint
        i = self._engine_of[id(chosen)]
        e = self.engines[i]
        n = len(token_ids)
        rec = self.records[req.request_id] = SimRecord(r.rid, i, self.now, n)
        if self.config.measure_known:
            # measured before the forward records its own decision, over both indexes whatever
            # the policy reads, on a copy: the forward's bookkeeping reads the pass's state, as
            # the HTTP router's does
            known = replace(req.state, profiles={})
            names = [ep.name for ep in endpoints]
            precise, approximate = self.state.precise_index, self.state.approximate_index
            known.look_up(req.block_keys, names, precise, approximate)
            rec.best_known_tokens = max(n - known.uncached_tokens(name) for name in names)
            rec.chosen_known_tokens = n - known.uncached_tokens(chosen.name)
        refused = r.max_tokens > e.core.runner.max_model_len - n  # the engine's 400
        if result.prefill is not None and not refused:  # P/D: the prefill leg first
            self._prefill_leg(req, i, self._engine_of[id(result.prefill)], r.max_tokens, digests)
            return 0
        self._loads[req.request_id] = forward_load.sent(
            chosen, req, self.state.approximate_index, now=self.now
        )
        if refused:  # past the engine's context
            rec.refused = True
            return self._finish(rec, req.request_id)
        request = self._request(req.request_id, token_ids, digests, r.max_tokens, e)
        if self.peer_sources is not None:
            source = select_source(
                self.state.precise_index, endpoints, chosen, req, self.peer_sources
            )
            if source is not None:
                peer = self._engine_of[id(source.endpoint)]
                if self._pull(peer, i, request):
                    return 0
        self._add(i, request)
        return 0

    def _request(
        self, request_id: str, token_ids: list[int], digests, max_tokens: int, e: SimEngine
    ) -> EngineRequest:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = EngineRequest(request_id, token_ids, sampling)
        if e.core.kv.enable_caching:  # the engine hashes only the blocks after these
            request.block_hashes = list(digests)
        return request

    def _add(self, i: int, request: EngineRequest) -> None:
        e = self.engines[i]
        unit = self.units[e.unit]
        unit.add_request(e, request)
        no_text(e.core, request.request_id)
        if not unit.busy:
            self._start_step(e.unit)

    def _start_step(self, u: int) -> None:
        unit = self.units[u]
        dt, outputs = unit.step(self.now)
        if dt <= 0 and not outputs:
            unit.busy = False  # nothing could run: the next arrival wakes it
            self._deliver(unit)
            return
        cfg = self.config
        if cfg.host_step_s or cfg.host_request_s:  # the host's time, when it is the longer
            running = max(e.core.scheduler.num_running for e in unit.engines)
            dt = max(dt, cfg.host_step_s + cfg.host_request_s * running)
        unit.busy = True
        for e in unit.engines:  # a step occupies every GPU of the unit
            e.busy_s += dt
            e.busy_until = self.now + dt
        self._push(self.now + dt, "step", (u, outputs))

    def _deliver(self, unit: Unit) -> None:
        for e in unit.engines:
            if e.events:
                self.state.precise_index.apply(e.endpoint.name, KVEventBatch(self.now, e.events))
                e.events.clear()

    def _step_done(self, payload) -> int:
        u, outputs = payload
        unit = self.units[u]
        self._deliver(unit)
        finished = 0
        legs = self._legs
        for out in outputs:
            if legs and out.request_id in legs:  # a P/D prefill leg
                self._prefilled(legs[out.request_id], out)
                continue
            rec = self.records[out.request_id]
            if rec.first_token is None:
                rec.first_token = self.now
                rec.cached_tokens = max(0, out.num_cached_tokens)
                forward_load.prefilled(self._loads[out.request_id], self.now)
                if self.transfers and out.request_id in self.transfers:
                    t = self.transfers[out.request_id]
                    t.decode_cached = rec.cached_tokens
                    if t.kind == "pd":  # the tokens no engine computed: the prefill's hit
                        rec.cached_tokens = t.prefill_cached
            rec.output_tokens = out.num_output_tokens
            if out.finished:
                finished += self._finish(rec, out.request_id)
        if unit.has_work():
            self._start_step(u)
        else:
            unit.busy = False
        return finished

    def _finish(self, rec: SimRecord, request_id: str) -> int:
        """`rec` ended now: its forward's load is released and the turns after it may come."""
        rec.finished = self.now
        forward_load.finished(self._loads.pop(request_id))
        for nxt in self._dependents.pop(rec.rid, ()):
            self._deps_left[nxt.rid] -= 1
            if not self._deps_left[nxt.rid]:
                del self._deps_left[nxt.rid]
                self._push(self.now + nxt.delay, "arrive", nxt)
        if self.on_finish is not None:
            self.on_finish(rec)
        return 1
