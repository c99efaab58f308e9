"""Outlier detection, as Envoy's consecutive-5xx: an endpoint whose requests keep failing leaves
rotation for a while; and Envoy's panic threshold: when too few endpoints are left in rotation,
requests go to every endpoint still answering, ejected or not. Its state lives on the Endpoint
(errors, ejected_until, ejected, times_ejected, timed_out); EndpointPool (router.endpoints)
counts and logs what happens here."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar


class Ejectable(Protocol):
    """What outlier detection reads and writes on an endpoint (router.endpoints.Endpoint)."""

    healthy: bool
    timed_out: bool
    block_size_mismatch: bool
    model_mismatch: bool
    errors: int
    ejected: bool
    ejected_until: float
    times_ejected: int


EndpointT = TypeVar("EndpointT", bound=Ejectable)


@dataclass(slots=True)
class OutlierDetection:
    """Envoy's consecutive-5xx outlier detection: an endpoint whose requests fail this many
    times in a row (a 5xx answer, a timeout before the first byte or mid-stream; a broken
    connection is the reachability check's business) leaves rotation for the base time
    multiplied by its ejections so far, at most max_ejection_time; at most max_ejection_percent
    of the fleet (but always one endpoint) is out at once, and never the last in rotation.

    healthy_panic_threshold (percent, Envoy's healthy_panic_threshold): while fewer endpoints
    than this share of the fleet are in rotation, the fleet is in panic and requests go to
    all of it but the refused (rotation() below): timeouts and 5xx of a loaded host then never
    leave clients without an endpoint; 0: never panic."""

    consecutive_errors: int = 5  # 0: never eject
    base_ejection_time: float = 30.0
    max_ejection_time: float = 300.0
    max_ejection_percent: float = 50.0
    healthy_panic_threshold: float = 50.0

    def __post_init__(self) -> None:
        if self.consecutive_errors < 0:
            raise ValueError("--outlier-consecutive-errors must be 0 (off) or positive")
        if not 0 < self.base_ejection_time <= self.max_ejection_time:
            raise ValueError("outlier ejection times: 0 < base <= max")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ValueError("--outlier-max-ejection-percent must be in [0, 100]")
        if not 0 <= self.healthy_panic_threshold <= 100:
            raise ValueError("--healthy-panic-threshold must be in [0, 100]")

    def rotation(self, endpoints: Iterable[EndpointT], now: float) -> tuple[list[EndpointT], bool]:
        """(the endpoints requests may go to, whether the fleet is in panic). The fleet: the
        endpoints of the router's block size and model. In rotation: the healthy and not
        ejected. In panic (fewer of those than healthy_panic_threshold percent of the fleet):
        also the ejected and those whose checks timed out (no panic when that adds none);
        never one that refused connections, whose requests could only fail."""
        fleet: list[EndpointT] = []
        routable: list[EndpointT] = []
        for e in endpoints:
            if not (e.block_size_mismatch or e.model_mismatch):
                fleet.append(e)
                if e.healthy and e.ejected_until <= now:
                    routable.append(e)
        if len(routable) * 100 >= self.healthy_panic_threshold * len(fleet):
            return routable, False
        spread = [e for e in fleet if e.healthy or e.timed_out]
        return (spread, True) if len(spread) > len(routable) else (routable, False)

    def request_failed(self, e: Ejectable, fleet: Collection[Ejectable], now: float) -> float:
        """Count a failed request at e (one of fleet); eject e when that made consecutive_errors
        in a row and the fleet can spare it. The ejection's length in seconds; 0: not ejected."""
        e.errors += 1
        if not self.consecutive_errors or e.errors < self.consecutive_errors:
            return 0.0
        if e.ejected_until > now:
            return 0.0
        others = [x for x in fleet if x is not e]
        out = sum(1 for x in others if x.ejected_until > now)
        if out + 1 > max(1, int(len(fleet) * self.max_ejection_percent / 100)):
            return 0.0  # the count stands: e goes once another comes back
        if not any(x.healthy and x.ejected_until <= now for x in others):
            return 0.0  # the last in rotation: without it requests would try all anyway
        if e.ejected_until:  # one ejection forgiven per base time spent in service since
            served = (now - e.ejected_until) / self.base_ejection_time
            e.times_ejected = max(0, e.times_ejected - int(served))
        e.times_ejected += 1
        span = min(self.max_ejection_time, self.base_ejection_time * e.times_ejected)
        e.ejected_until, e.ejected, e.errors = now + span, True, 0
        return span


def ejection_ended(e: Ejectable, now: float) -> bool:
    """True once per ejection: the first time it is asked after the ejection's end."""
    if e.ejected and e.ejected_until <= now:
        e.ejected = False
        return True
    return False


def forget_ejections(e: Ejectable) -> None:
    """A restarted engine starts afresh: no ejection, none counted, no failed requests."""
    e.ejected_until, e.ejected, e.times_ejected, e.errors = 0.0, False, 0, 0
