"""Pure summaries of `kvmesh bench chaos`: request outcomes, per-phase counts, hit rate and
TTFT, hit rate over time, the router restart (downtime, index warm-up, hit rate before and
after), eject / re-admit times per phase (from chaos_metrics' reading of the router's /metrics
samples) and the targets. No processes, no sockets: tested on synthetic data.

Times are wall seconds since the run began, except TTFT (ms, divided by the engines' time
scale, as the load client measures it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvmesh.bench.chaos_metrics import (
    Sample,
    counter_increase,
    eject_readmit,
    feeds_warm,
    last_precise,
    warm_time,
)
from kvmesh.protocol.stats import percentile

OUTCOMES = ("ok", "lost", "broken")
PHASE_KEYS = ("eject_s", "readmit_s", "ejections", "ejections_counted", "readmissions_counted")
PHASE_KEYS += ("readmit_counted_s",)


@dataclass(slots=True)
class Result:
    """One request as the client saw it, after any retries of a refused connection."""

    start: float
    end: float
    ttft_ms: float | None  # None: no token arrived
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    endpoint: str = ""
    retries: int = 0  # connections repeated because the router process was down or killed
    sent: float | None = None  # start of the last attempt, the one a router routed (None: start)

    @property
    def routed(self) -> float:
        return self.start if self.sent is None else self.sent

    @property
    def outcome(self) -> str:
        """ok; lost: failed before its first token (error status, connection failure,
        timeout); broken: failed after its first token."""
        if not self.error:
            return "ok"
        return "broken" if self.ttft_ms is not None else "lost"

    @property
    def outcome_without_retries(self) -> str:
        """The outcome a client that never retries would have seen: a retried request's first
        attempt had failed before any token, so lost."""
        return "lost" if self.retries else self.outcome


@dataclass(slots=True)
class Phase:
    name: str
    start: float
    end: float
    target: str = ""  # the engine URL a fault or a kill was aimed at ("" for none / all)
    note: str = ""


def phase_of(t: float, phases: list[Phase]) -> int:
    """Index of the phase running at t (the last one started at or before t; 0 before all)."""
    idx = 0
    for i, p in enumerate(phases):
        if p.start <= t:
            idx = i
    return idx


def hit_rate(results: list[Result]) -> float | None:
    """Cached / prompt tokens over the requests that finished (usage comes at a stream's end)."""
    ok = [r for r in results if r.outcome == "ok"]
    prompt = sum(r.prompt_tokens for r in ok)
    return sum(r.cached_tokens for r in ok) / prompt if prompt else None


def summarize(results: list[Result]) -> dict:
    """Counts by outcome, retried connections, hit rate and TTFT p50 / p90 of a set of requests."""
    ttft = [r.ttft_ms for r in results if r.ttft_ms is not None]
    out: dict = {"requests": len(results)}
    for o in OUTCOMES:
        out[o] = sum(r.outcome == o for r in results)
    hit = hit_rate(results)
    out["retried"] = sum(r.retries > 0 for r in results)
    for o in OUTCOMES:  # the same requests as a client without retries would have seen them
        out[f"{o}_without_retries"] = sum(r.outcome_without_retries == o for r in results)
    out["hit_rate"] = round(hit, 4) if hit is not None else None
    out["ttft_ms_p50"] = round(percentile(ttft, 50), 1) if ttft else None
    out["ttft_ms_p90"] = round(percentile(ttft, 90), 1) if ttft else None
    out["errors"] = sorted({r.error[:120] for r in results if r.error})[:4]
    return out


def by_phase(results: list[Result], phases: list[Phase]) -> list[dict]:
    """One summary per phase; a request belongs to the phase in which it ended (a failure is
    charged to the fault that caused it, not to the phase it started in)."""
    groups: list[list[Result]] = [[] for _ in phases]
    for r in results:
        groups[phase_of(r.end, phases)].append(r)
    return [{**asdict(p), **summarize(g)} for p, g in zip(phases, groups, strict=True)]


def hit_series(results: list[Result], bin_s: float = 1.0) -> list[tuple[float, float, int]]:
    """(bin start, hit rate, finished requests) per bin of the time each request was routed;
    bins without a finished request are left out."""
    bins: dict[int, list[Result]] = {}
    for r in results:
        if r.outcome == "ok":
            bins.setdefault(int(r.routed // bin_s), []).append(r)
    return [(k * bin_s, hit_rate(v) or 0.0, len(v)) for k, v in sorted(bins.items())]


def window_hit(results: list[Result], t0: float, t1: float) -> tuple[float | None, int]:
    """Hit rate and count of the finished requests routed in [t0, t1)."""
    inside = [r for r in results if t0 <= r.routed < t1 and r.outcome == "ok"]
    return hit_rate(inside), len(inside)


def hit_recovery(
    results: list[Result], before: float | None, t0: float, t1: float, tol: float = 0.02
) -> float | None:
    """Seconds from t0 to the start of the first 1 s window (stepped by 0.25 s, ending before
    t1) whose finished requests' hit rate is within tol of `before`."""
    if before is None:
        return None
    t = t0
    while t + 1.0 <= t1:
        hit, n = window_hit(results, t, t + 1.0)
        if n and hit is not None and hit >= before - tol:
            return round(t - t0, 3)
        t += 0.25
    return None


def targets(phases: list[dict], warm: dict) -> dict:
    """The issue's targets: no request lost before its first token, by a client that retries
    a refused connection while the router is down (as the OpenAI SDK does) and, reported
    beside it, by one that never retries; after the router restart the index warm within 1 s
    (by its entries, and by the router's own feed gauges) and the hit rate in the first
    second within 0.02 of before."""
    lost = sum(p["lost"] for p in phases)
    unretried = sum(p["lost_without_retries"] for p in phases)
    out: dict = {"lost_before_first_token": lost, "lost_ok": lost == 0}
    out |= {"lost_without_retries": unretried, "lost_without_retries_ok": unretried == 0}
    if warm:
        w = warm.get("index_warm_s")
        out["index_warm_s"] = w
        out["index_warm_ok"] = w is not None and w <= 1.0
        if "index_warm_router_s" in warm:
            g = out["index_warm_router_s"] = warm["index_warm_router_s"]
            out["index_warm_router_ok"] = g is not None and g <= 1.0
        before, first = warm.get("hit_before"), warm.get("hit_first_s")
        out["hit_first_s_ok"] = before is not None and first is not None and first >= before - 0.02
    return out


def _event(events: list[dict], kind: str, target: str | None = None) -> float | None:
    return next(
        (e["t"] for e in events if e["kind"] == kind and target in (None, e["target"])), None
    )


def router_restart(
    results: list[Result], samples: list[Sample], events: list[dict], end: float, look_s: float
) -> dict:
    """The router restart, counted from the moment the new router was up (the earlier of its
    /health answering and a retried request reaching it): its downtime, the precise index's
    warm-up to 98% of its size just before the kill and the router's own warm-up time of its
    KV-event feeds (kv_index_warm_seconds, where it exports it), the hit rate of the requests
    routed in the look_s before the kill and in the first second after, and the time until a
    1 s window is back within 0.02 of before."""
    kill, ready = _event(events, "router_kill"), _event(events, "router_ready")
    if kill is None:
        return {}
    early = [r.routed for r in results if r.retries and r.routed > kill and not r.error]
    up = min([t for t in [ready, *early] if t is not None], default=None)
    before = last_precise(samples, kill)
    hit_before, n_before = window_hit(results, kill - look_s, kill)
    out: dict = {"router_down_s": None if up is None else round(up - kill, 3)}
    out |= {"index_before": before, "hit_before": hit_before, "n_before": n_before}
    out |= {"index_warm_s": None, "hit_first_s": None, "n_first_s": 0, "hit_recovered_s": None}
    if up is not None:
        if before:
            out["index_warm_s"] = warm_time(samples, before, up)
        if any(s.warm for s in samples):
            out |= feeds_warm(samples, kill, up)
        out["hit_first_s"], out["n_first_s"] = window_hit(results, up, up + 1.0)
        out["hit_recovered_s"] = hit_recovery(results, hit_before, up, end)
    return out


def assemble(
    results: list[Result],
    samples: list[Sample],
    events: list[dict],
    phases: list[Phase],
    look_s: float = 5.0,
    grace: float = 0.0,
) -> dict:
    """Phases (with counters grown and, where a phase aims at one engine, eject / re-admit
    times: from the kill and the restart for engine-restart, from the fault's start and end
    otherwise), the router restart, targets and the events with eject / re-admit marks added."""
    rows = by_phase(results, phases)
    marks: list[dict] = []
    warm: dict = {}
    for p, row in zip(phases, rows, strict=True):
        row["counters"] = counter_increase(samples, p.start, p.end)
        if p.name == "router-restart":
            warm = router_restart(results, samples, events, phases[-1].end, look_s)
        if not p.target:
            continue
        fault_at, back_at = p.start, p.end
        if p.name == "engine-restart":
            fault_at = _event(events, "engine_kill", p.target) or p.start
            back_at = _event(events, "engine_start", p.target) or p.end
        er = eject_readmit(samples, p.target, fault_at, back_at, grace)
        row |= {k: er[k] for k in PHASE_KEYS}
        ready = _event(events, "engine_ready", p.target)
        if p.name == "engine-restart" and ready is not None and row["readmit_s"] is not None:
            row["readmit_after_ready_s"] = round(row["readmit_s"] + back_at - ready, 3)
        marks += [{"t": round(t, 3), "kind": k, "target": p.target} for t, k in er["marks"]]
    return {
        "phases": rows,
        "router_restart": warm,
        "targets": targets(rows, warm),
        "totals": summarize(results),
        "events": sorted(events + marks, key=lambda e: e["t"]),
    }
