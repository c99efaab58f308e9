"""The scheduling pipeline: a profile handler runs profiles of filters, weighted scorers and a
picker. A pure function of (request, endpoint states, indexes), shared by the HTTP router and the
simulator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import yaml

from kvmesh.router import backlog  # noqa: F401 - registers the backlog and placement scorers
from kvmesh.router.endpoints import Endpoint
from kvmesh.router.plugin_params import ReadParameters
from kvmesh.router.plugins import REGISTRY, PluginContext, SchedulingRequest, build_plugin

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
    # spreads cold prompts; tuned with `kvmesh sim` on the agentic workload and the Mooncake trace
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
""",
    # selective P/D over endpoints labelled llm-d.ai/role: prefill | decode | both
    "pd": """
plugins:
- {type: disagg-profile-handler, parameters: {nonCachedTokens: 256}}
- {type: decode-filter}
- {type: prefill-filter}
- {type: precise-prefix-cache-scorer}
- {type: prefix-cache-scorer}
- {type: queue-scorer}
- {type: active-request-scorer}
schedulingProfiles:
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: precise-prefix-cache-scorer, weight: 2},
            {pluginRef: prefix-cache-scorer, weight: 1}, {pluginRef: queue-scorer, weight: 2},
            {pluginRef: active-request-scorer, weight: 2}]
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: precise-prefix-cache-scorer, weight: 2},
            {pluginRef: queue-scorer, weight: 2}, {pluginRef: active-request-scorer, weight: 2}]
""",
}


@dataclass(slots=True)
class Profile:
    name: str
    filters: list[Any] = field(default_factory=list)
    scorers: list[tuple[Any, float]] = field(default_factory=list)
    picker: Any = None


class ProfileResult(NamedTuple):
    endpoint: Endpoint | None
    totals: dict[str, float]
    scores: dict[str, dict[str, float]]  # scorer name -> endpoint -> score in [0, 1]


class SchedulingResult(NamedTuple):
    primary: Endpoint | None  # the endpoint that answers (decode, under P/D)
    profiles: dict[str, ProfileResult]
    prefill: Endpoint | None = None  # set when the prompt is prefilled elsewhere first


class SingleProfileHandler:
    """Runs the only profile (or the one named `default`)."""

    def __init__(self, profiles: dict[str, Profile]) -> None:
        self.profile = profiles.get("default") or next(iter(profiles.values()))

    def run(
        self, pipeline: Pipeline, req: SchedulingRequest, endpoints: list[Endpoint]
    ) -> SchedulingResult:
        result = pipeline.run_profile(self.profile, req, endpoints)
        return SchedulingResult(result.endpoint, {self.profile.name: result})


class DisaggProfileHandler:
    """llm-d's decode-first P/D: pick the decode endpoint, then run the prefill profile only
    when the prompt tokens it lacks reach `nonCachedTokens` (0: always)."""

    def __init__(self, profiles: dict[str, Profile], ctx, params: dict) -> None:
        self.decode = profiles[params.get("decodeProfile", "decode")]
        self.prefill = profiles.get(params.get("prefillProfile", "prefill"))
        self.threshold = int(params.get("nonCachedTokens", 0))
        self.ctx = ctx

    def uncached_tokens(self, req: SchedulingRequest, endpoint: Endpoint) -> int:
        if req.precise is None:
            req.precise = self.ctx.precise_index.longest_match(req.block_keys, [endpoint.name])
        if req.approximate is None:
            req.approximate = self.ctx.approximate_index.longest_match(
                req.block_keys, [endpoint.name]
            )
        blocks = max(req.precise.get(endpoint.name, 0), req.approximate.get(endpoint.name, 0))
        return max(0, len(req.token_ids) - int(blocks) * req.block_size)

    def run(
        self, pipeline: Pipeline, req: SchedulingRequest, endpoints: list[Endpoint]
    ) -> SchedulingResult:
        d = pipeline.run_profile(self.decode, req, endpoints)
        results = {self.decode.name: d}
        if d.endpoint is None or self.prefill is None:
            return SchedulingResult(d.endpoint, results)
        if self.uncached_tokens(req, d.endpoint) < max(self.threshold, 1):
            return SchedulingResult(d.endpoint, results)
        p = pipeline.run_profile(self.prefill, req, [e for e in endpoints if e is not d.endpoint])
        results[self.prefill.name] = p
        return SchedulingResult(d.endpoint, results, p.endpoint)


HANDLERS = {"single-profile-handler": None, "disagg-profile-handler": DisaggProfileHandler}


class Pipeline:
    def __init__(self, config: dict, ctx: PluginContext) -> None:
        self.plugins: dict[str, Any] = {}
        handler_spec: tuple[str, dict] | None = None
        for spec in config.get("plugins") or []:
            type_name = spec["type"]
            name = spec.get("name") or type_name
            if type_name in HANDLERS:
                handler_spec = (type_name, spec.get("parameters") or {})
                continue
            self.plugins[name] = build_plugin(type_name, name, spec.get("parameters") or {}, ctx)
        self.profiles: dict[str, Profile] = {}
        for spec in config.get("schedulingProfiles") or [{"name": "default", "plugins": []}]:
            profile = Profile(spec["name"])
            for ref in spec.get("plugins") or []:
                plugin = self.plugins.get(ref["pluginRef"])
                if plugin is None:
                    raise ValueError(
                        f"profile {profile.name!r} references unknown plugin {ref['pluginRef']!r}"
                    )
                if hasattr(plugin, "pick"):
                    profile.picker = plugin
                elif hasattr(plugin, "score"):
                    profile.scorers.append((plugin, float(ref.get("weight", 1.0))))
                else:
                    profile.filters.append(plugin)
            if profile.picker is None:  # injected default, as llm-d's
                profile.picker = build_plugin("max-score-picker", "max-score-picker", {}, ctx)
            self.profiles[profile.name] = profile
        if handler_spec and handler_spec[0] == "disagg-profile-handler":
            try:
                params = ReadParameters(handler_spec[1])
                self.handler = DisaggProfileHandler(self.profiles, ctx, params)
            except KeyError as exc:
                raise ValueError(f"disagg-profile-handler needs a profile named {exc}") from None
            params.refuse_unread("disagg-profile-handler")
        else:
            self.handler = SingleProfileHandler(self.profiles)

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

    def uses(self, type_names: tuple[str, ...]) -> bool:
        return any(type(p).__name__ in type_names for p in self.plugins.values())

    def run_profile(
        self, profile: Profile, req: SchedulingRequest, endpoints: list[Endpoint]
    ) -> ProfileResult:
        for f in profile.filters:
            endpoints = f.filter(req, endpoints)
        if not endpoints:
            return ProfileResult(None, {}, {})
        totals = dict.fromkeys((e.name for e in endpoints), 0.0)
        scores: dict[str, dict[str, float]] = {}
        for scorer, weight in profile.scorers:
            s = scorer.score(req, endpoints)
            scores[scorer.name] = s
            for name, v in s.items():
                totals[name] += weight * v
        chosen = profile.picker.pick(totals, endpoints)
        for scorer, _ in profile.scorers:
            if hasattr(scorer, "chosen"):
                scorer.chosen(req, chosen)
        return ProfileResult(chosen, totals, scores)

    def schedule(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> SchedulingResult:
        return self.handler.run(self, req, endpoints)


def known_plugin_types() -> list[str]:
    return sorted(REGISTRY)
