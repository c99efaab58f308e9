"""Scheduling plugins, llm-d style: filters narrow the candidate endpoints, scorers map each to
[0, 1] (a list aligned with the endpoints given) and do nothing else, pickers choose among
weighted totals (aligned likewise), profile handlers say which
profiles run. Every type is registered in one table (registry) by name, with its parameters and
factory; each declares what it reads (base.Plugin). Prefix matches are looked up once per
request by the pipeline into the SchedulingState (state), which every plugin reads."""

from __future__ import annotations

from kvmesh.router.plugins.base import (
    ROLE_LABEL,
    Filter,
    Picker,
    Plugin,
    PluginContext,
    PrefixReader,
    SchedulingRequest,
    Scorer,
)
from kvmesh.router.plugins.filters import LabelSelectorFilter, ModelFilter, RoleFilter
from kvmesh.router.plugins.pickers import (
    MaxScorePicker,
    RandomPicker,
    RoundRobinPicker,
    WeightedRandomPicker,
)
from kvmesh.router.plugins.placement import PlacementCostScorer, PrefillBacklogScorer
from kvmesh.router.plugins.prefix import ApproxPrefixScorer, NoHitLRUScorer, PrecisePrefixScorer
from kvmesh.router.plugins.profile_handlers import DisaggProfileHandler, SingleProfileHandler
from kvmesh.router.plugins.registry import (
    FILTER,
    HANDLER,
    PICKER,
    REGISTRY,
    SCORER,
    PluginType,
    build_plugin,
    plugin_type,
)
from kvmesh.router.plugins.scorers import (
    ActiveRequestScorer,
    KVCacheUtilizationScorer,
    LoadAwareScorer,
    QueueScorer,
    SessionAffinityScorer,
    TokenLoadScorer,
)
from kvmesh.router.plugins.state import (
    NO_MATCH,
    ProfileResult,
    SchedulingResult,
    SchedulingState,
)

__all__ = [
    "FILTER",
    "HANDLER",
    "NO_MATCH",
    "PICKER",
    "REGISTRY",
    "ROLE_LABEL",
    "SCORER",
    "ActiveRequestScorer",
    "ApproxPrefixScorer",
    "DisaggProfileHandler",
    "Filter",
    "KVCacheUtilizationScorer",
    "LabelSelectorFilter",
    "LoadAwareScorer",
    "MaxScorePicker",
    "ModelFilter",
    "NoHitLRUScorer",
    "Picker",
    "PlacementCostScorer",
    "Plugin",
    "PluginContext",
    "PluginType",
    "PrecisePrefixScorer",
    "PrefillBacklogScorer",
    "PrefixReader",
    "ProfileResult",
    "QueueScorer",
    "RandomPicker",
    "RoleFilter",
    "RoundRobinPicker",
    "SchedulingRequest",
    "SchedulingResult",
    "SchedulingState",
    "Scorer",
    "SessionAffinityScorer",
    "SingleProfileHandler",
    "TokenLoadScorer",
    "WeightedRandomPicker",
    "build_plugin",
    "plugin_type",
]
