"""The scheduling pipeline: a profile handler runs profiles of filters, weighted scorers and a
picker. A pure function of (request, endpoint states, indexes), shared by the HTTP router and the
simulator. Each pass starts a SchedulingState on the request and, before any filter, looks up the
prefix matches its plugins declare they read, over every candidate endpoint."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import yaml

from kvmesh.router.endpoints import Endpoint
from kvmesh.router.plugins import (
    HANDLER,
    PICKER,
    SCORER,
    PluginContext,
    ProfileResult,
    SchedulingRequest,
    SchedulingResult,
    SchedulingState,
    build_plugin,
    plugin_type,
)
from kvmesh.router.plugins.terms import ProfileTotals, compile_profile

_NO_SCORES: Mapping[str, list[float]] = MappingProxyType({})  # a pass that does not explain

__all__ = ["PRESETS", "Pipeline", "Profile", "ProfileResult", "SchedulingResult"]

PRESETS: dict[str, str] = {
    "round-robin": """
plugins: [{type: round-robin-picker}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: round-robin-picker}]}]
""",
    "random": """
plugins: [{type: random-picker}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: random-picker}]}]
""",
    "load": """
plugins: [{type: queue-scorer}, {type: kv-cache-utilization-scorer}, {type: active-request-scorer}]
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer, weight: 2},
            {pluginRef: kv-cache-utilization-scorer, weight: 2},
            {pluginRef: active-request-scorer, weight: 1}]
""",
    "approx-prefix": """
plugins: [{type: prefix-cache-scorer}, {type: queue-scorer}, {type: kv-cache-utilization-scorer}]
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-scorer, weight: 3}, {pluginRef: queue-scorer, weight: 2},
            {pluginRef: kv-cache-utilization-scorer, weight: 2}]
""",
    "precise-prefix": """
plugins: [{type: precise-prefix-cache-scorer}, {type: queue-scorer},
          {type: kv-cache-utilization-scorer}]
schedulingProfiles:
- name: default
  plugins: [{pluginRef: precise-prefix-cache-scorer, weight: 3},
            {pluginRef: queue-scorer, weight: 2},
            {pluginRef: kv-cache-utilization-scorer, weight: 2}]
""",
    # events say what is cached; the router's own recent decisions cover blocks whose events have
    # not arrived yet; every match counts, and what a match is worth is priced in prefill by the
    # placement cost: the holder's queued prefill plus the tokens this request would compute
    # there, paid once by the request and once by every request decoding beside it; so a long
    # context stays with its holder, while a prefix every session shares (a system prompt) does
    # not pull new sessions onto a busy holder when an idle engine can compute it once; LRU
    # spreads cold prompts; the prompt tokens in flight on each endpoint (token load) keep
    # long contexts from piling onto the engines that hold shared prefixes while others idle:
    # a decode step reads every running context; tuned with `kvmesh sim` on the agentic
    # workload (open and closed loop, --agents) and the Mooncake trace. The requests queued on
    # each endpoint are priced in prompt tokens at the rate the fleet's own times to first
    # token show (predicted latency): a few tokens each where prefill is the slow part, where
    # this weight changes nothing `kvmesh sim` shows; thousands where the host is (engines
    # starved of CPU, a step costing host time whatever its tokens), where it spreads what
    # affinity would queue on a holder
    "kvmesh": """
plugins:
- {type: precise-prefix-cache-scorer}
- {type: prefix-cache-scorer}
- {type: placement-cost-scorer}
- {type: queue-scorer}
- {type: active-request-scorer}
- {type: kv-cache-utilization-scorer}
- {type: session-affinity-scorer}
- {type: no-hit-lru-scorer}
- {type: token-load-scorer, parameters: {queueThresholdTokens: 262144}}
- {type: predicted-latency-scorer}
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: precise-prefix-cache-scorer, weight: 8}
  - {pluginRef: prefix-cache-scorer, weight: 1}
  - {pluginRef: placement-cost-scorer, weight: 8}
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: active-request-scorer, weight: 1}
  - {pluginRef: kv-cache-utilization-scorer, weight: 1}
  - {pluginRef: session-affinity-scorer, weight: 1}
  - {pluginRef: no-hit-lru-scorer, weight: 1}
  - {pluginRef: token-load-scorer, weight: 4}
  - {pluginRef: predicted-latency-scorer, weight: 32}
""",
    # selective P/D over endpoints labelled llm-d.ai/role: prefill | decode | both. A decode
    # step reads every running context, and the ranks of a wide-EP instance step together, so
    # the slowest sets the pace: decode picks balance the prompt tokens and requests in flight
    # first and follow a cached prefix only between equals (tuned with `kvmesh sim --layout
    # dp32 --prefill-gpus`: +17% output on 1,000-token answers, the same on 120-token ones and
    # on dense engines); prefill picks follow the cache
    "pd": """
plugins:
- {type: disagg-profile-handler, parameters: {nonCachedTokens: 256}}
- {type: decode-filter}
- {type: prefill-filter}
- {type: precise-prefix-cache-scorer}
- {type: queue-scorer}
- {type: active-request-scorer}
- {type: token-load-scorer, parameters: {queueThresholdTokens: 262144}}
schedulingProfiles:
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: precise-prefix-cache-scorer, weight: 1},
            {pluginRef: active-request-scorer, weight: 2},
            {pluginRef: token-load-scorer, weight: 4}]
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: precise-prefix-cache-scorer, weight: 2},
            {pluginRef: queue-scorer, weight: 2}, {pluginRef: active-request-scorer, weight: 2}]
""",
}
# the kvmesh preset without its predicted-latency scorer (the default before it), for A/B runs
PRESETS["kvmesh-affinity"] = "\n".join(
    line for line in PRESETS["kvmesh"].splitlines() if "predicted-latency" not in line
)


@dataclass(slots=True)
class Profile:
    name: str
    filters: list[Any] = field(default_factory=list)
    scorers: list[tuple[Any, float]] = field(default_factory=list)
    picker: Any = None
    hooks: list[Any] = field(default_factory=list)  # its scorers with a `chosen` hook
    # (req, endpoints) -> (weighted totals, None): its scorers joined (plugins.terms); and
    # the same with each scorer's scores, for a pipeline that explains its picks
    totals: ProfileTotals | None = None
    explained: ProfileTotals | None = None

    def plugins(self) -> list[Any]:
        return [*self.filters, *(s for s, _ in self.scorers), self.picker]


class Pipeline:
    """Built once from an EndpointPickerConfig. Its capabilities are those its profile handler
    and the plugins its profiles use declare: `reads_tokens` (else the router skips tokenizing),
    `reads_precise_index` (else no KV-event subscriptions) and `reads_approximate_index`."""

    def __init__(self, config: dict, ctx: PluginContext, explain: bool = False) -> None:
        # keep each scorer's scores in the profiles' results (ProfileResult.scores; debug
        # logs, tests), else only their totals
        self.explain = explain
        self.plugins: dict[str, Any] = {}
        kinds: dict[str, str] = {}
        handler: tuple[str, str, Any] = ("single-profile-handler", "single-profile-handler", None)
        for spec in config.get("plugins") or []:
            type_name = spec["type"]
            name = spec.get("name") or type_name
            kind = plugin_type(type_name).kind
            if kind == HANDLER:
                handler = (type_name, name, spec.get("parameters"))
                continue
            self.plugins[name] = build_plugin(type_name, name, spec.get("parameters"), ctx)
            kinds[name] = kind
        self.profiles: dict[str, Profile] = {}
        for spec in config.get("schedulingProfiles") or [{"name": "default", "plugins": []}]:
            profile = Profile(spec["name"])
            for ref in spec.get("plugins") or []:
                plugin = self.plugins.get(ref["pluginRef"])
                if plugin is None:
                    raise ValueError(
                        f"profile {profile.name!r} references unknown plugin {ref['pluginRef']!r}"
                    )
                kind = kinds[ref["pluginRef"]]
                if kind == PICKER:
                    profile.picker = plugin
                elif kind == SCORER:
                    profile.scorers.append((plugin, float(ref.get("weight", 1.0))))
                else:
                    profile.filters.append(plugin)
            if profile.picker is None:  # injected default, as llm-d's
                profile.picker = build_plugin("max-score-picker", "max-score-picker", {}, ctx)
            profile.hooks = [s for s, _ in profile.scorers if hasattr(s, "chosen")]
            if profile.scorers:
                profile.totals = compile_profile(profile.scorers)
                profile.explained = compile_profile(profile.scorers, explain=True)
            self.profiles[profile.name] = profile
        self.handler = build_plugin(*handler, self.profiles)
        used = [self.handler, *(p for prof in self.profiles.values() for p in prof.plugins())]
        self.reads_precise_index = any(p.reads_precise_index for p in used)
        self.reads_approximate_index = any(p.reads_approximate_index for p in used)
        self.reads_tokens = (
            self.reads_precise_index
            or self.reads_approximate_index
            or any(p.reads_tokens for p in used)
        )
        # the indexes each pass looks up, before any filter (None: not read by any plugin)
        self.precise_index = ctx.precise_index if self.reads_precise_index else None
        self.approximate_index = ctx.approximate_index if self.reads_approximate_index else None
        self.looks_up = self.reads_precise_index or self.reads_approximate_index

    @classmethod
    def from_yaml(cls, text: str, ctx: PluginContext) -> Pipeline:
        config = yaml.safe_load(text) or {}
        if not isinstance(config, dict):
            raise ValueError("scheduler config must be a YAML mapping (EndpointPickerConfig)")
        return cls(config, ctx)

    @classmethod
    def preset(cls, name: str, ctx: PluginContext) -> Pipeline:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
        return cls.from_yaml(PRESETS[name], ctx)

    def run_profile(
        self, profile: Profile, req: SchedulingRequest, endpoints: list[Endpoint]
    ) -> ProfileResult:
        """One profile's pick, kept in the request's state under the profile's name."""
        for f in profile.filters:
            endpoints = f.filter(req, endpoints)
        profiles = req.state.profiles
        if not endpoints:
            result = profiles[profile.name] = ProfileResult(None, endpoints, [], {})
            return result
        # every score and total is a list aligned with `endpoints`
        run = profile.explained if self.explain else profile.totals
        if run is None:  # no scorer: every total 0
            totals, scores = [0.0] * len(endpoints), None
        else:
            totals, scores = run(req, endpoints)
        chosen = profile.picker.pick(totals, endpoints)
        for scorer in profile.hooks:
            scorer.chosen(req, chosen)
        result = profiles[profile.name] = ProfileResult(
            chosen, endpoints, totals, _NO_SCORES if scores is None else scores
        )
        return result

    def schedule(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> SchedulingResult:
        state = req.state = SchedulingState.of(req)
        if self.looks_up and req.block_keys:
            names = state.names(endpoints)
            state.look_up(req.block_keys, names, self.precise_index, self.approximate_index)
        return self.handler.run(self, req, endpoints)
