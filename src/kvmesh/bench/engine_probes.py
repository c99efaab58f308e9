"""What a bench reads of a fleet's servers over HTTP: which engines are kvmesh's, their prefix
caches reset between policies, the peer-pull counters and timing reports they expose, and the
router gauges worth keeping in a fleet result."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from kvmesh.bench.fleet_procs.procs import admin_headers
from kvmesh.protocol.prom import parse_samples

# the engine counters kv_move_counters sums: peer pulls by outcome, tokens pulled, tier hits
KV_MOVES = frozenset(
    (
        "kvmesh:kv_peer_pulls_total",
        "kvmesh:kv_peer_pulled_tokens_total",
        "kvmesh:kv_offload_hits_total",
    )
)


def kvmesh_models(doc: object) -> bool:
    """Whether a GET /v1/models answer is a kvmesh engine's (its cards are owned_by "kvmesh",
    as vLLM's are by "vllm"): only those are asked kvmesh's own routes (/admin/timing)."""
    cards = doc.get("data") if isinstance(doc, dict) else None
    return bool(cards) and all(isinstance(c, dict) and c.get("owned_by") == "kvmesh" for c in cards)


def kvmesh_engines(urls: list[str]) -> list[str]:
    """The engines among `urls` whose /v1/models says they are kvmesh engines."""
    out = []
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
                doc = json.loads(resp.read())
        except (OSError, ValueError):
            continue
        if kvmesh_models(doc):
            out.append(url)
    return out


def reset_caches(urls: list[str]) -> list[str]:
    """POST /reset_prefix_cache on every engine (retried while busy); the ones that refused."""
    failed = []
    for url in urls:
        for _ in range(40):
            req = urllib.request.Request(
                f"{url}/reset_prefix_cache", b"", admin_headers(), method="POST"
            )
            try:
                with urllib.request.urlopen(req, timeout=10):
                    break
            except urllib.error.HTTPError as exc:
                if exc.code != 503:
                    failed.append(f"{url}: HTTP {exc.code}")
                    break
            except OSError as exc:
                failed.append(f"{url}: {exc}")
                break
            time.sleep(0.25)
        else:
            failed.append(f"{url}: busy")
    return failed


def router_metrics(url: str) -> dict[str, float]:
    """kvmesh router gauges and counters worth keeping (index sizes, predicted hits)."""
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return out
    for s in parse_samples(text, _kept_router_metric):
        out[s.series()] = s.value
    return out


def _kept_router_metric(name: str) -> bool:
    return (
        name.startswith("kvmesh_router_")
        and not name.startswith("kvmesh_router_sched")
        and not any(part in name for part in ("_created", "in_flight", "healthy"))
    )


def kv_move_counters(urls: list[str]) -> dict[str, float]:
    """Peer pulls by outcome, pulled tokens and prompt tokens served from each offload tier,
    summed over the engines (cumulative)."""
    out: dict[str, float] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for s in parse_samples(text, KV_MOVES.__contains__):
            if s.name == "kvmesh:kv_peer_pulls_total":
                name = "pulls_" + s.labels.get("outcome", "")
            elif s.name == "kvmesh:kv_peer_pulled_tokens_total":
                name = "pulled_tokens"
            else:
                name = "tier_hit_tokens_" + s.labels.get("medium", "")
            out[name] = out.get(name, 0.0) + s.value
    return out


def engine_timing(urls: list[str]) -> dict[str, float]:
    """Emulated steps and how often an engine fell behind its own step timeline (a host too
    busy for the fleet's pace), summed over the engines; empty for real engines. Give it only
    kvmesh engines (kvmesh_engines): the route is kvmesh's own."""
    out: dict[str, float] = {}
    for url in urls:
        try:
            req = urllib.request.Request(f"{url}/admin/timing", headers=admin_headers())
            with urllib.request.urlopen(req, timeout=10) as resp:
                doc = json.loads(resp.read())
        except (OSError, ValueError):
            continue
        for key in ("steps", "timeline_restarts"):
            if isinstance(doc.get(key), (int, float)):
                out[key] = out.get(key, 0) + doc[key]
    return out
