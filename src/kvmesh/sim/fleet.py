"""A fleet in virtual time: the real router pipeline in front of real engine cores.

Each engine is the engine core of `kvmesh serve --emulate` (scheduler, block pool, prefix cache,
tiers, KV events) around an EmulatedRunner, stepped on a virtual clock instead of the event
loop: a step that the roofline model says lasts 12 ms ends 12 virtual ms after it began, and
nothing waits for it. The router is the real scheduling pipeline over `Endpoint` states kept
as the HTTP router keeps them: queue gauges from a scrape every `scrape_interval`, in-flight
counts, prefill backlog and the approximate index from the forward bookkeeping the HTTP router
calls too (router.forward_load), and the precise index from the engines' KV events (delivered when
the step that made them ends). Router and engines share one hashing of each prompt's blocks
(sim.digests), and the engines skip the metrics, step log and output text no one here reads
(sim.quiet): the same decisions and the same virtual times, in less wall time.

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
from kvmesh.engine.core import EngineCore
from kvmesh.engine.emulation.builder import EmulationConfig, build_emulated_engine
from kvmesh.engine.sequence import Request as EngineRequest
from kvmesh.engine.sequence import SamplingParams
from kvmesh.protocol.hashing import BlockHasher
from kvmesh.protocol.kv_events import KVEventBatch
from kvmesh.router import forward_load
from kvmesh.router.endpoints import Endpoint
from kvmesh.router.index import ApproximateIndex, PreciseIndex
from kvmesh.router.pipeline import Pipeline
from kvmesh.router.plugins import SchedulingRequest
from kvmesh.sim.digests import PromptDigests
from kvmesh.sim.quiet import no_text, quieten

NULL_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "null"})


@dataclass(slots=True)
class SimRequest:
    """One request of the replay: its arrival (virtual s), prompt and output length. The prompt
    is runs of consecutive token ids, (first id, count), so that a trace of 12k requests of 12k
    tokens holds kilobytes until a request arrives, not gigabytes."""

    rid: int
    at: float
    prompt: tuple[tuple[int, int], ...]
    max_tokens: int
    session: str = ""  # x-session-id
    deps: tuple[int, ...] = ()  # rids that must finish first (a session's previous turn)
    delay: float = 0.0  # think / tool time after the deps finish, virtual s

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prompt)

    def token_ids(self) -> list[int]:
        return [*itertools.chain.from_iterable(range(first, first + n) for first, n in self.prompt)]


@dataclass(slots=True)
class SimRecord:
    """How one request went: where it ran, what hit, when its tokens came (virtual s)."""

    rid: int
    engine: int
    arrival: float
    prompt_tokens: int
    cached_tokens: int = 0
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    best_known_tokens: int = 0  # the longest prefix the router knew on any engine at arrival
    chosen_known_tokens: int = 0  # ... and on the engine it chose

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(slots=True)
class _Engine:
    core: EngineCore
    endpoint: Endpoint
    busy: bool = False  # a step is in flight (its end is on the event heap)
    events: list = field(default_factory=list)  # KV events of the step in flight
    busy_s: float = 0.0  # virtual seconds spent stepping (steps started so far)
    busy_until: float = 0.0  # when the last step started ends


class _Policy:
    """What `kvmesh.router.app.Router` offers its plugins: the two indexes."""

    def __init__(self, index_capacity: int, approx_capacity: int) -> None:
        self.precise_index = PreciseIndex(index_capacity)
        self.approximate_index = ApproximateIndex(approx_capacity)


@dataclass(slots=True)
class FleetSimConfig:
    engines: int = 4
    scrape_interval: float = 0.1  # virtual seconds between the router's metric scrapes
    index_capacity: int = 8_000_000
    approx_capacity_per_endpoint: int = 31_250
    seed: int = 0  # seeds the pickers' random tie-breaks: one seed, one outcome
    # look up what the router knew on every engine at each arrival (SimRecord.*_known_tokens,
    # "lost to routing"): a second index lookup per request
    measure_known: bool = True
    engine: EngineConfig = field(default_factory=EngineConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)


class FleetSim:
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
        self.engines: list[_Engine] = []
        for i in range(config.engines):
            bundle = build_emulated_engine(engine_config, config.emulation, tokenizer)
            e = _Engine(bundle.engine.core, Endpoint(f"http://engine-{i}", name=f"engine-{i}"))
            e.core.publish_events = e.events.extend
            quieten(e.core)
            self.engines.append(e)
        self._engine_of = {id(e.endpoint): i for i, e in enumerate(self.engines)}
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.records: dict[str, SimRecord] = {}
        self._loads: dict[str, forward_load.Load] = {}  # rid -> its forward's load, until finished
        self._deps_left: dict[int, int] = {}  # rid -> its deps not finished yet
        self._dependents: dict[int, list[SimRequest]] = defaultdict(list)
        self.on_finish = None  # called with each finished SimRecord (a closed-loop driver)

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

    def run_until(self, end: float) -> None:
        """Every event up to virtual time `end`; `on_finish` may submit more requests. Steps
        in flight at `end` stay unfinished: records hold what had happened by then."""
        self._push(0.0, "scrape", None)
        while self._heap and self._heap[0][0] <= end:
            self._next_event()
        self.now = end

    def _next_event(self) -> int:
        """Handle the earliest event; the number of requests that finished in it."""
        self.now, _, kind, payload = heapq.heappop(self._heap)
        if kind == "arrive":
            self._arrive(payload)
        elif kind == "step":
            return self._step_done(payload)
        else:
            self._scrape()
            self._push(self.now + self.config.scrape_interval, "scrape", None)
        return 0

    def _scrape(self) -> None:
        for e in self.engines:
            s = e.core.scheduler
            e.endpoint.waiting, e.endpoint.running = s.num_waiting, s.num_running
            e.endpoint.kv_usage = e.core.kv.usage

    def _arrive(self, r: SimRequest) -> None:
        headers = {"x-session-id": r.session} if r.session else {}
        token_ids = r.token_ids()
        digests, keys = self.digests.digests(r.prompt, token_ids)
        req = SchedulingRequest(str(r.rid), None, token_ids, list(keys), headers, self.block_size)
        endpoints = [e.endpoint for e in self.engines]
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
        self._loads[req.request_id] = forward_load.sent(chosen, req, self.state.approximate_index)
        sampling = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        request = EngineRequest(req.request_id, token_ids, sampling)
        if e.core.kv.enable_caching:  # the engine hashes only the blocks after these
            request.block_hashes = list(digests)
        e.core.add_request(request)
        no_text(e.core, req.request_id)
        if not e.busy:
            self._start_step(i)

    def _start_step(self, i: int) -> None:
        e = self.engines[i]
        runner = e.core.runner
        runner.clock = max(runner.clock, self.now)  # idle time passes on the engine's clock
        before = runner.clock
        outputs = e.core.step()
        dt = runner.clock - before
        if dt <= 0 and not outputs:
            e.busy = False  # nothing could run: the next arrival wakes it
            self._deliver(e)
            return
        e.busy = True
        e.busy_s += dt
        e.busy_until = self.now + dt
        self._push(self.now + dt, "step", (i, outputs))

    def _deliver(self, e: _Engine) -> None:
        if e.events:
            self.state.precise_index.apply(e.endpoint.name, KVEventBatch(self.now, e.events))
            e.events.clear()

    def _step_done(self, payload) -> int:
        i, outputs = payload
        e = self.engines[i]
        self._deliver(e)
        finished = 0
        for out in outputs:
            rec = self.records[out.request_id]
            if rec.first_token is None:
                rec.first_token = self.now
                rec.cached_tokens = max(0, out.num_cached_tokens)
                forward_load.prefilled(self._loads[out.request_id])
            rec.output_tokens = out.num_output_tokens
            if out.finished:
                rec.finished = self.now
                forward_load.finished(self._loads.pop(out.request_id))
                finished += 1
                for nxt in self._dependents.pop(rec.rid, ()):
                    self._deps_left[nxt.rid] -= 1
                    if not self._deps_left[nxt.rid]:
                        del self._deps_left[nxt.rid]
                        self._push(self.now + nxt.delay, "arrive", nxt)
                if self.on_finish is not None:
                    self.on_finish(rec)
        if e.core.has_work():
            self._start_step(i)
        else:
            e.busy = False
        return finished
