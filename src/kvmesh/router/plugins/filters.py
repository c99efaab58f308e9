"""Filters: each narrows a profile's candidate endpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.router.plugins.base import ROLE_LABEL, Plugin, SchedulingRequest

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint


@dataclass(slots=True)
class RoleFilter(Plugin):
    name: str
    roles: tuple[str, ...]  # endpoints without the label count as "both"

    def filter(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        accepted = (*self.roles, "both")
        return [e for e in endpoints if e.labels.get(ROLE_LABEL, "both") in accepted]


@dataclass(slots=True)
class LabelSelectorFilter(Plugin):
    name: str
    match_labels: dict[str, str]

    def filter(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        wanted = self.match_labels.items()
        return [e for e in endpoints if all(e.labels.get(k) == v for k, v in wanted)]


@dataclass(slots=True)
class ModelFilter(Plugin):
    name: str

    def filter(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        if req.model is None:
            return endpoints
        return [e for e in endpoints if not e.models or req.model in e.models]
