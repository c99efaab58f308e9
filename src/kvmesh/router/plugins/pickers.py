"""Pickers: each chooses one endpoint among a profile's candidates from their weighted totals
(a list aligned with the candidates)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from itertools import compress
from typing import TYPE_CHECKING

from kvmesh.router.plugins.base import Plugin

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint


@dataclass(slots=True)
class MaxScorePicker(Plugin):
    """The best total; ties broken at random, as llm-d's."""

    name: str
    rng: random.Random = field(default_factory=random.Random)

    def pick(self, totals: list[float], endpoints: list[Endpoint]) -> Endpoint:
        if len(totals) <= 8:  # plain loops: over a few endpoints they cost least
            best = -1e300
            for t in totals:
                if t > best:
                    best = t
            best -= 1e-9
            top = []
            for e, t in zip(endpoints, totals, strict=True):
                if t >= best:
                    top.append(e)
            return top[0] if len(top) == 1 else self.rng.choice(top)
        best = max(totals)  # the same, C-level (totals are floats)
        if not best > -1e300:  # a NaN first, or nothing above the floor: as the loop
            best = -1e300
            for t in totals:
                if t > best:
                    best = t
        top = list(compress(endpoints, map((best - 1e-9).__le__, totals)))
        return top[0] if len(top) == 1 else self.rng.choice(top)


@dataclass(slots=True)
class WeightedRandomPicker(Plugin):
    name: str
    rng: random.Random = field(default_factory=random.Random)

    def pick(self, totals: list[float], endpoints: list[Endpoint]) -> Endpoint:
        weights = [max(t, 0.0) for t in totals]
        if sum(weights) <= 0:
            return self.rng.choice(endpoints)
        return self.rng.choices(endpoints, weights=weights)[0]


@dataclass(slots=True)
class RandomPicker(Plugin):
    name: str
    rng: random.Random = field(default_factory=random.Random)

    def pick(self, totals: list[float], endpoints: list[Endpoint]) -> Endpoint:
        return self.rng.choice(endpoints)


@dataclass(slots=True)
class RoundRobinPicker(Plugin):
    name: str
    counter: int = 0

    def pick(self, totals: list[float], endpoints: list[Endpoint]) -> Endpoint:
        self.counter += 1
        return sorted(endpoints, key=lambda e: e.name)[self.counter % len(endpoints)]
