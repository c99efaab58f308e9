"""Every plugin type the scheduler knows, in one table, llm-d style: its type name, its kind, the
parameters it takes (with their defaults; any other is refused) and the factory that builds
one from an EndpointPickerConfig entry."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from kvmesh.router.plugin_params import with_defaults
from kvmesh.router.plugins.filters import LabelSelectorFilter, ModelFilter, RoleFilter
from kvmesh.router.plugins.latency import PredictedLatencyScorer, TTFTModel
from kvmesh.router.plugins.pickers import (
    MaxScorePicker,
    RandomPicker,
    RoundRobinPicker,
    WeightedRandomPicker,
)
from kvmesh.router.plugins.placement import PlacementCostScorer, PrefillBacklogScorer
from kvmesh.router.plugins.prefix import ApproxPrefixScorer, NoHitLRUScorer, PrecisePrefixScorer
from kvmesh.router.plugins.profile_handlers import DisaggProfileHandler, SingleProfileHandler
from kvmesh.router.plugins.scorers import (
    ActiveRequestScorer,
    KVCacheUtilizationScorer,
    LoadAwareScorer,
    QueueScorer,
    SessionAffinityScorer,
    TokenLoadScorer,
)

FILTER, SCORER, PICKER, HANDLER = "filter", "scorer", "picker", "profile-handler"


class PluginType(NamedTuple):
    type_name: str
    kind: str  # FILTER, SCORER, PICKER or HANDLER
    # (name, parameters, ctx) -> plugin; a profile handler's third argument is the profiles
    factory: Callable[[str, dict[str, Any], Any], Any]
    parameters: Mapping[str, Any]  # name -> default


def _disagg(name: str, p: dict[str, Any], profiles: dict[str, Any]) -> DisaggProfileHandler:
    decode = profiles.get(p["decodeProfile"])
    if decode is None:
        raise ValueError(f"{name} needs a profile named {p['decodeProfile']!r}")
    prefill = profiles.get(p["prefillProfile"])
    return DisaggProfileHandler(name, decode, prefill, int(p["nonCachedTokens"]))


_THRESHOLD = {"matchThreshold": 0.0}
_SEED = {"seed": None}

_TYPES = (
    PluginType("decode-filter", FILTER, lambda n, p, c: RoleFilter(n, ("decode",)), {}),
    PluginType("prefill-filter", FILTER, lambda n, p, c: RoleFilter(n, ("prefill",)), {}),
    PluginType(
        "label-selector-filter",
        FILTER,
        lambda n, p, c: LabelSelectorFilter(n, dict(p["matchLabels"] or {})),
        {"matchLabels": None},
    ),
    PluginType("model-filter", FILTER, lambda n, p, c: ModelFilter(n), {}),
    PluginType(
        "precise-prefix-cache-scorer",
        SCORER,
        lambda n, p, c: PrecisePrefixScorer(n, float(p["matchThreshold"])),
        _THRESHOLD,
    ),
    PluginType(
        "prefix-cache-scorer",
        SCORER,
        lambda n, p, c: ApproxPrefixScorer(n, float(p["matchThreshold"])),
        _THRESHOLD,
    ),
    PluginType(
        "no-hit-lru-scorer",
        SCORER,
        lambda n, p, c: NoHitLRUScorer(n, float(p["matchThreshold"])),
        _THRESHOLD,
    ),
    PluginType(
        "prefill-backlog-scorer",
        SCORER,
        lambda n, p, c: PrefillBacklogScorer(n, int(p["scaleTokens"])),
        {"scaleTokens": 4096},
    ),
    PluginType(
        "placement-cost-scorer",
        SCORER,
        lambda n, p, c: PlacementCostScorer(n, float(p["decodeWeight"]), float(p["waitingWeight"])),
        {"decodeWeight": 1.0, "waitingWeight": 1.0},
    ),
    PluginType(
        "predicted-latency-scorer",
        SCORER,
        lambda n, p, c: PredictedLatencyScorer(
            n,
            TTFTModel(
                int(p["windowSamples"]),
                int(p["refitEvery"]),
                int(p["minSamples"]),
                float(p["refitIntervalSeconds"]),
            ),
            bool(p["includeTokens"]),
        ),
        {
            "windowSamples": 512,
            "refitEvery": 32,
            "minSamples": 32,
            "refitIntervalSeconds": 0.1,
            "includeTokens": False,
        },
    ),
    PluginType("queue-scorer", SCORER, lambda n, p, c: QueueScorer(n), {}),
    PluginType(
        "kv-cache-utilization-scorer", SCORER, lambda n, p, c: KVCacheUtilizationScorer(n), {}
    ),
    PluginType("active-request-scorer", SCORER, lambda n, p, c: ActiveRequestScorer(n), {}),
    PluginType(
        "token-load-scorer",
        SCORER,
        lambda n, p, c: TokenLoadScorer(n, int(p["queueThresholdTokens"])),
        {"queueThresholdTokens": 32768},
    ),
    PluginType(
        "load-aware-scorer",
        SCORER,
        lambda n, p, c: LoadAwareScorer(n, int(p["threshold"])),
        {"threshold": 128},
    ),
    PluginType(
        "session-affinity-scorer",
        SCORER,
        lambda n, p, c: SessionAffinityScorer(n, str(p["header"]).lower(), float(p["ttlSeconds"])),
        {"header": "x-session-id", "ttlSeconds": 300.0},
    ),
    PluginType(
        "max-score-picker",
        PICKER,
        lambda n, p, c: MaxScorePicker(n, random.Random(p["seed"])),
        _SEED,
    ),
    PluginType(
        "weighted-random-picker",
        PICKER,
        lambda n, p, c: WeightedRandomPicker(n, random.Random(p["seed"])),
        _SEED,
    ),
    PluginType(
        "random-picker", PICKER, lambda n, p, c: RandomPicker(n, random.Random(p["seed"])), _SEED
    ),
    PluginType("round-robin-picker", PICKER, lambda n, p, c: RoundRobinPicker(n), {}),
    PluginType("single-profile-handler", HANDLER, lambda n, p, c: SingleProfileHandler(n, c), {}),
    PluginType(
        "disagg-profile-handler",
        HANDLER,
        _disagg,
        {"decodeProfile": "decode", "prefillProfile": "prefill", "nonCachedTokens": 0},
    ),
)
REGISTRY: dict[str, PluginType] = {t.type_name: t for t in _TYPES}


def plugin_type(type_name: str) -> PluginType:
    t = REGISTRY.get(type_name)
    if t is None:
        raise ValueError(f"unknown plugin type {type_name!r}; known: {sorted(REGISTRY)}")
    return t


def build_plugin(type_name: str, name: str, params: Any, ctx: Any) -> Any:
    """One plugin of `type_name` (`ctx`: the router's PluginContext; for a profile handler,
    the profiles by name)."""
    t = plugin_type(type_name)
    what = type_name if name == type_name else f"{type_name} {name!r}"
    return t.factory(name, with_defaults(what, params, t.parameters), ctx)
