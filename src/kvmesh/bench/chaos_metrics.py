"""The router's /metrics as `kvmesh bench chaos` polls it, and what the polls tell: when an
endpoint left the rotation and came back (from its gauges and from its ejection / re-admission
counters), how the precise index and the KV-event feeds warmed up after a router restart, and
how much each counter grew in a phase. Pure functions of the samples: no sockets.

Times are wall seconds since the run began."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.protocol.prom import parse_samples

PREFIX = "kvmesh_router_"
COUNTED = ("eject", "readmi", "replay", "gap")  # counters kept in Sample.extras


@dataclass(slots=True)
class Sample:
    """One poll of the router's /metrics; healthy is None while the router did not answer."""

    t: float
    healthy: dict[str, float] | None = None  # in rotation by endpoint: 1, else 0
    precise: float | None = None  # entries of the precise index
    extras: dict[str, float] = field(default_factory=dict)  # counters: `name{k=v,...}` -> value
    warm: dict[str, float] = field(default_factory=dict)  # kv_index_warm by endpoint
    warm_s: dict[str, float] = field(default_factory=dict)  # kv_index_warm_seconds by endpoint
    gen: int = 0  # which router process answered: its counters start from zero


def _key(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


def parse_router_metrics(text: str, t: float = 0.0) -> Sample:
    """A sample at t of a router's /metrics page: in rotation by endpoint (endpoint_healthy, 0
    while endpoint_ejected is 1), the precise index's entries, the KV-event feeds' warm gauges,
    and in extras the ejection, re-admission, KV-event replay and gap counters (`_total`
    samples) that a router may or may not export."""
    s = Sample(t, {})
    ejected: dict[str, float] = {}
    for name, labels, value in parse_samples(text):
        short, ep = name.removeprefix(PREFIX), labels.get("endpoint")
        if short == "endpoint_healthy" and ep:
            s.healthy[ep] = value
        elif short == "endpoint_ejected" and ep:
            ejected[ep] = value
        elif short == "kv_index_warm" and ep:
            s.warm[ep] = value
        elif short == "kv_index_warm_seconds" and ep:
            s.warm_s[ep] = value
        elif short == "index_entries" and labels.get("index") == "precise":
            s.precise = value
        elif name.endswith("_total") and any(k in name for k in COUNTED):
            s.extras[_key(name, labels)] = value
    for ep, v in ejected.items():
        if v and ep in s.healthy:
            s.healthy[ep] = 0.0
    return s


def out_periods(
    samples: list[Sample], endpoint: str, t0: float, t1: float
) -> list[list[float | None]]:
    """[out, back] per stretch in which the router kept the endpoint out of rotation (unhealthy
    or ejected), for stretches starting in [t0, t1); back is None when it never came back.
    Samples without an answer from the router (it was down) change nothing."""
    periods: list[list[float | None]] = []
    for s in samples:
        if s.t < t0 or s.healthy is None or endpoint not in s.healthy:
            continue
        out = s.healthy[endpoint] == 0.0
        if out and (not periods or periods[-1][1] is not None) and s.t < t1:
            periods.append([s.t, None])
        elif not out and periods and periods[-1][1] is None:
            periods[-1][1] = s.t
    return periods


def _growth(samples: list[Sample]):
    """(sample, key, increase) for each counter that grew since the previous answered sample.
    A counter is zero before it first shows (a labelled one shows at its first increment) and
    in a new router process (gen); a drop within one is taken as a restart too."""
    prev: dict[str, float] = {}
    gen = None
    for s in samples:
        if s.healthy is None:
            continue
        if s.gen != gen:
            prev, gen = {}, s.gen
        for key, v in s.extras.items():
            was = prev.get(key, 0.0)
            d = v - was if v >= was else v
            if d > 0:
                yield s, key, d
            prev[key] = v


def counter_steps(samples: list[Sample], match: str) -> list[tuple[float, float]]:
    """(time, increase) at each sample where the counters whose key contains `match` grew."""
    steps: list[tuple[float, float]] = []
    for s, key, d in _growth(samples):
        if match not in key:
            continue
        if steps and steps[-1][0] == s.t:
            steps[-1] = (s.t, steps[-1][1] + d)
        else:
            steps.append((s.t, d))
    return steps


def eject_readmit(
    samples: list[Sample], endpoint: str, fault_at: float, back_at: float, grace: float = 0.0
) -> dict:
    """eject_s: from the fault to the first sample with the endpoint out of rotation;
    readmit_s: from its return (restart, or the fault's end) to the end of the last stretch
    out of rotation that began before it (negative: the router took it back while the fault
    lasted); ejections: stretches out of rotation that began while the fault lasted or within
    `grace` after (a hung request is given up only at the router's first-byte timeout).
    From the router's counters, which see a stretch too short for the 50 ms polls:
    ejections_counted and readmissions_counted in that window, and readmit_counted_s, from
    the return to the first re-admission counted at or after the last ejection counted in it
    (None where the router does not export them or counted none)."""
    periods = out_periods(samples, endpoint, fault_at, back_at + grace)
    last = [p for p in periods if p[0] <= back_at + grace]
    back = last[-1][1] if last else None
    ep = f"{{endpoint={endpoint},"
    ejects = counter_steps(samples, "_ejections_total" + ep)
    readmits = counter_steps(samples, "_readmissions_total" + ep)
    window = [(t, d) for t, d in ejects if fault_at <= t <= back_at + grace]
    again = next((t for t, _ in readmits if window and t >= window[-1][0]), None)
    until = back_at + grace if again is None else again
    return {
        "eject_s": round(periods[0][0] - fault_at, 3) if periods else None,
        "readmit_s": round(back - back_at, 3) if back is not None else None,
        "ejections": len(periods),
        "ejections_counted": int(sum(d for _, d in window)),
        "readmissions_counted": int(sum(d for t, d in readmits if fault_at <= t <= until)),
        "readmit_counted_s": round(again - back_at, 3) if again is not None else None,
        "marks": [(t, k) for a, b in periods for t, k in ((a, "ejected"), (b, "readmitted")) if t],
    }


def warm_time(
    samples: list[Sample], before: float, after: float, frac: float = 0.98
) -> float | None:
    """Seconds from `after` until the precise index holds frac x `before` entries (None: never)."""
    for s in samples:
        if s.t >= after and s.precise is not None and s.precise >= frac * before:
            return round(s.t - after, 3)
    return None


def feeds_warm(samples: list[Sample], since: float, up: float) -> dict:
    """The router's own account of its KV-event feeds after a restart at `since` (up: when it
    answered): index_warm_router_s, the largest kv_index_warm_seconds (subscription to replay
    applied) over the endpoints in the first answered sample after `since` with every feed
    warm, and index_warm_seen_s, that sample's time after `up`. None where never seen."""
    for s in samples:
        if s.t > since and s.healthy is not None and s.warm and all(s.warm.values()):
            secs = [s.warm_s[e] for e in s.warm if e in s.warm_s]
            return {
                "index_warm_router_s": round(max(secs), 3) if secs else None,
                "index_warm_seen_s": round(s.t - up, 3),
            }
    return {"index_warm_router_s": None, "index_warm_seen_s": None}


def last_precise(samples: list[Sample], before: float) -> float | None:
    """The precise index's size in the last answered sample before t."""
    got = [s.precise for s in samples if s.t < before and s.precise is not None]
    return got[-1] if got else None


def counter_increase(samples: list[Sample], t0: float, t1: float) -> dict[str, float]:
    """How much each extra counter grew in [t0, t1), across router restarts (a new router's
    counters count from zero)."""
    grown: dict[str, float] = {}
    for s, key, d in _growth(samples):
        if t0 <= s.t < t1:
            grown[key] = grown.get(key, 0.0) + d
    return grown
