"""Router replicas, active-active: N `kvmesh router --preset kvmesh` processes over the same
engines, sharing nothing. Each subscribes to every engine's KV events itself
(`--kv-events-config auto`: the sources each engine's /kv_event_sources lists) and scrapes every
engine's /metrics itself.
A round-robin front spreads the requests over them, one request each in turn: by default a tiny
HTTP balancer (bench.rr_front) that passes every header on, as a Kubernetes Service or Envoy's
ROUND_ROBIN would; or (`--replica-front router`) another `kvmesh router --preset round-robin`
whose endpoints are the replicas, which works but sends its endpoints only the body and its own
headers, so the replicas never see the client's x-session-id (no session affinity behind it).

`kvmesh bench fleet --router-replicas 1,2,4` runs one row per count ("kvmesh xN"), every row on
the same engines with their prefix caches reset, and reads back from each replica what it did:
requests it answered, the prefix hits it predicted, its precise index (fed by the same events in
every replica, so the sizes agree once the events are in) and its approximate index (its own
decisions only, so the sizes differ)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.table import Table

from kvmesh.bench.engine_probes import kvmesh_engines, reset_caches
from kvmesh.bench.fleet_procs.procs import Proc, start_healthy, stop_all
from kvmesh.bench.fleet_procs.routers import Target, start_router
from kvmesh.bench.progress import BenchRun
from kvmesh.protocol.prom import parse_samples

MAX_REPLICAS = 16
REPLICA_FLAGS = ("--kv-events-config", "auto")
# the front only spreads requests: no KV events, no model probe of routers (a router's
# /tokenize is not an engine's), block size never asked of routers
FRONT_FLAGS = ("--kv-events-config", "none", "--no-engine-model-check")
FRONTS = {
    "balancer": "round-robin HTTP balancer (kvmesh.bench.rr_front)",
    "router": "kvmesh router --preset round-robin",
}
HIT_RATE_OF_ONE = 0.98  # the target: within 2% of one replica's hit rate


def parse_counts(spec: str) -> list[int]:
    """`--router-replicas` '1,2,4' -> [1, 2, 4]; '' -> [] (off). ValueError with the reason."""
    if not spec.strip():
        return []
    counts = []
    for item in (s.strip() for s in spec.split(",")):
        if not item.isdecimal() or not 1 <= int(item) <= MAX_REPLICAS:
            raise ValueError(
                f"--router-replicas takes comma-separated replica counts from 1 to "
                f"{MAX_REPLICAS}, e.g. 1,2,4; got {spec!r}"
            )
        if int(item) in counts:
            raise ValueError(f"--router-replicas names {item} twice: {spec!r}")
        counts.append(int(item))
    return counts


def label(n: int, suffix: str = "") -> str:
    return f"kvmesh x{n}{suffix}"


def replica_view(url: str) -> dict:
    """What one replica's /metrics says it did: requests answered (outcome ok) and other
    forward outcomes, prompt tokens routed and predicted cached, index sizes, event lag."""
    view = {"ok": 0, "failed": 0, "prompt_tokens": 0, "predicted_cached": 0}
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError as exc:
        return {**view, "error": str(exc)[:200]}
    for s in parse_samples(text, lambda name: name.startswith("kvmesh_router_")):
        if s.name == "kvmesh_router_requests_total":
            view["ok" if s.labels.get("outcome") == "ok" else "failed"] += int(s.value)
        elif s.name == "kvmesh_router_prompt_tokens_total":
            view["prompt_tokens"] = int(s.value)
        elif s.name == "kvmesh_router_predicted_cached_tokens_total":
            view["predicted_cached"] = int(s.value)
        elif s.name == "kvmesh_router_index_entries":
            view[f"{s.labels.get('index', '')}_entries"] = int(s.value)
        elif s.name == "kvmesh_router_kv_event_lag_seconds":
            view["event_lag_s"] = round(s.value, 4)
    return view


def replica_views(urls: list[str], settle_s: float = 2.0) -> list[dict]:
    """Every replica's view after a run; read again (within `settle_s`) while their precise
    indexes differ in size, as the last KV events may still be on their way."""
    deadline = time.monotonic() + settle_s
    while True:
        views = [replica_view(u) for u in urls]
        sizes = {v.get("precise_entries") for v in views}
        if len(sizes) <= 1 or time.monotonic() > deadline:
            return views
        time.sleep(0.2)


def front_counts(url: str, replicas: list[str]) -> list[int]:
    """Requests the front answered through each replica (its kvmesh_router_requests_total)."""
    counts = dict.fromkeys(replicas, 0)
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return [0] * len(replicas)
    for s in parse_samples(text, "kvmesh_router_requests_total".__eq__):
        e = s.labels.get("endpoint", "")
        if e in counts and s.labels.get("outcome") == "ok":
            counts[e] += int(s.value)
    return [counts[r] for r in replicas]


def start_replicas(urls: list[str], n: int, out: Path) -> tuple[list[Proc], list[str]]:
    """n kvmesh routers over `urls`, started side by side; all of them or none (RuntimeError)."""
    targets = [Target("kvmesh", "kvmesh", REPLICA_FLAGS, f"replica{i}of{n}") for i in range(n)]
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(start_router, t, urls, [], {}, out) for t in targets]
    started, errors = [], []
    for f in futures:
        try:
            started.append(f.result())
        except RuntimeError as exc:
            errors.append(str(exc))
    if errors:
        stop_all(proc for proc, _ in started)
        raise RuntimeError(errors[0])
    return [p for p, _ in started], [u for _, u in started]


def start_front(kind: str, replicas: list[str], out: Path) -> tuple[Proc, str]:
    """The round-robin front over the replicas' URLs, once healthy."""
    n = len(replicas)
    if kind == "router":
        return start_router(
            Target("kvmesh", "round-robin", FRONT_FLAGS, f"front-of-{n}"), replicas, [], {}, out
        )
    cmd = [sys.executable, "-m", "kvmesh.bench.rr_front"]
    return start_healthy(
        lambda port: [*cmd, "--port", str(port), *replicas], out / f"front-of-{n}.log", FRONTS[kind]
    )


def run_replicas(
    args: argparse.Namespace,
    wl,
    urls: list[str],
    counts: list[int],
    out: Path,
    bench: BenchRun | None,
    measure: Callable[..., dict],
    suffix: str = "",
    seed_offset: int = 0,
    front_kind: str = "balancer",
) -> tuple[dict[str, dict], list[str]]:
    """A row per replica count: the engines' caches reset, n replicas and their front started,
    the workload sent to the front by `measure` (fleet.run_row), everything stopped; each row
    saved by `bench` as it finishes."""
    progress = bench.progress if bench is not None else None
    rows: dict[str, dict] = {}
    notes: list[str] = []
    timed = kvmesh_engines(urls)
    for k, n in enumerate(counts):
        name = label(n, suffix)
        reset = reset_caches(urls)
        notes += [f"prefix cache not reset before {name}: {note}" for note in reset]
        row_wl = dataclasses.replace(wl, seed=wl.seed + seed_offset + k) if reset else wl
        if reset:
            notes.append(f"{name}: ran on its own prompts (workload seed {row_wl.seed})")
        procs: list[Proc] = []
        try:
            procs, replicas = start_replicas(urls, n, out)
            front, front_url = start_front(front_kind, replicas, out)
            procs.append(front)
        except RuntimeError as exc:
            stop_all(procs)
            notes.append(f"{name}: did not start ({str(exc)[:200]})")
            continue
        try:
            row = measure(args, row_wl, front_url, urls, timed, name, progress)
            views = replica_views(replicas)
            row.update(summarize(n, views, front_counts(front_url, replicas)))
            row["front"] = FRONTS[front_kind]
            rows[name] = row
            if bench is not None:
                bench.add({"name": name, **row}, name)
            if not all(v.get("precise_entries") for v in views):
                notes.append(f"{name}: a replica's precise index stayed empty (no KV events)")
        except Exception as exc:  # a failing row must not lose the others
            notes.append(f"{name}: failed ({type(exc).__name__}: {str(exc)[:200]})")
        finally:
            stop_all(reversed(procs))
    return rows, notes


def summarize(n: int, views: list[dict], front: list[int]) -> dict:
    """The replica fields of a row, from each replica's view and the front's counts."""
    precise = [v.get("precise_entries", 0) for v in views]
    return {
        "replicas": n,
        "replica_requests": [v["ok"] for v in views],
        "replica_failed_forwards": [v["failed"] for v in views],
        "front_requests": front,
        "replica_predicted_hit_rate": [
            round(v["predicted_cached"] / v["prompt_tokens"], 4) if v["prompt_tokens"] else None
            for v in views
        ],
        "replica_precise_entries": precise,
        "replica_approximate_entries": [v.get("approximate_entries", 0) for v in views],
        "replica_event_lag_s": [v.get("event_lag_s") for v in views],
        "precise_index_agree": len(set(precise)) == 1,
    }


def targets(rows: dict[str, dict], suffix: str = "") -> dict:
    """Each count's hit rate over one replica's (same engines), and whether all are within 2%."""
    one = rows.get(label(1, suffix))
    if not one or not one["hit_rate"]:
        return {}
    of_one = {
        f"x{s['replicas']}": round(s["hit_rate"] / one["hit_rate"], 4)
        for s in rows.values()
        if "replicas" in s and s["replicas"] > 1
    }
    if not of_one:
        return {}
    return {
        "replicas_hit_rate_of_one": of_one,
        "replicas_hit_rate_ok": all(r >= HIT_RATE_OF_ONE for r in of_one.values()),
    }


def table(rows: dict[str, dict]) -> Table:
    """Per replica count: hit rate (and over one replica's), TTFT, what each replica did."""
    fronts = sorted({s["front"] for s in rows.values() if "front" in s})
    t = Table(title=f"router replicas behind a front: {', '.join(fronts)}")
    cols = "replicas|hit rate|of x1|TTFT p50|p90|requests per replica|predicted hit per replica"
    for col in (cols + "|precise entries|approx entries").split("|"):
        t.add_column(col, justify="left" if col == "replicas" else "right")
    for name, s in rows.items():
        if "replicas" not in s:
            continue
        base = rows.get(label(1, name[len(label(s["replicas"])) :]))  # same engine variant
        of_one = s["hit_rate"] / base["hit_rate"] if base and base["hit_rate"] else None
        pred = s["replica_predicted_hit_rate"]
        t.add_row(
            name,
            f"{s['hit_rate']:.3f}",
            f"{of_one:.3f}" if of_one is not None else "-",
            f"{s['ttft_ms_p50']:.0f} ms",
            f"{s['ttft_ms_p90']:.0f} ms",
            " / ".join(map(str, s["replica_requests"])),
            " / ".join(f"{p:.3f}" if p is not None else "-" for p in pred),
            " / ".join(map(str, s["replica_precise_entries"])),
            " / ".join(map(str, s["replica_approximate_entries"])),
        )
    return t
