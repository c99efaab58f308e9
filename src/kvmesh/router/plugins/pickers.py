"""Pickers: each chooses one endpoint among a profile's candidates from their weighted totals."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.router.plugins.base import Plugin

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint


@dataclass(slots=True)
class MaxScorePicker(Plugin):
    """The best total; ties broken at random, as llm-d's."""

    name: str
    rng: random.Random = field(default_factory=random.Random)

    def pick(self, totals: dict[str, float], endpoints: list[Endpoint]) -> Endpoint:
        best = -1e300
        for t in totals.values():
            if t > best:
                best = t
        best -= 1e-9
        top = []
        for e in endpoints:
            if totals[e.name] >= best:
                top.append(e)
        return top[0] if len(top) == 1 else self.rng.choice(top)


@dataclass(slots=True)
class WeightedRandomPicker(Plugin):
    name: str
    rng: random.Random = field(default_factory=random.Random)

    def pick(self, totals: dict[str, float], endpoints: list[Endpoint]) -> Endpoint:
        weights = [max(totals[e.name], 0.0) for e in endpoints]
        if sum(weights) <= 0:
            return self.rng.choice(endpoints)
        return self.rng.choices(endpoints, weights=weights)[0]


@dataclass(slots=True)
class RandomPicker(Plugin):
    name: str
    rng: random.Random = field(default_factory=random.Random)

    def pick(self, totals: dict[str, float], endpoints: list[Endpoint]) -> Endpoint:
        return self.rng.choice(endpoints)


@dataclass(slots=True)
class RoundRobinPicker(Plugin):
    name: str
    counter: int = 0

    def pick(self, totals: dict[str, float], endpoints: list[Endpoint]) -> Endpoint:
        self.counter += 1
        return sorted(endpoints, key=lambda e: e.name)[self.counter % len(endpoints)]
