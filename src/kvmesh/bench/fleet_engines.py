"""The processes and counters of one emulated fleet: its engines (started once per engine
variant), their prefix caches reset between policies, the peer-pull counters and timing reports
they expose, and the router gauges worth keeping in a fleet result."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvmesh.bench.router_procs import URL_RE, Proc
from kvmesh.protocol.prom import parse_samples

# the admin key (/admin/*, /reset_prefix_cache) of the engines this bench process starts:
# the caller's KVMESH_ADMIN_API_KEY, else a fresh one; it goes to the engines in their
# environment, never on a command line or in a log
ADMIN_KEY = os.environ.get("KVMESH_ADMIN_API_KEY") or secrets.token_urlsafe(16)
# the engine counters kv_move_counters sums: peer pulls by outcome, tokens pulled, tier hits
KV_MOVES = frozenset(
    (
        "kvmesh:kv_peer_pulls_total",
        "kvmesh:kv_peer_pulled_tokens_total",
        "kvmesh:kv_offload_hits_total",
    )
)


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


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


def _event_base(n: int, per_engine: int = 2) -> int:
    """A port P with P..P+per_engine*n-1 free (engine i publishes on P+2i, replays on P+2i+1;
    a third port each, from P+2n, for its HTTP server when the engines' ports are fixed)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + per_engine * n > 65535:
            continue
        try:
            for p in range(base, base + per_engine * n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range for KV events")


def start_engines(
    args: argparse.Namespace, n: int, out: Path, extra: str = "", log: str = "engines.log"
) -> tuple[Proc, list[str]]:
    """`kvmesh serve --emulate n` with the bench's --serve-args and then `extra` (an engine
    variant's flags, which win where both set one); the process and the engines' URLs."""
    serve_args = f"{args.serve_args} {extra}".strip()
    fixed = "{engines}" in serve_args  # the engines name each other: fix their ports
    base = _event_base(n, 3 if fixed else 2)
    http_base = base + 2 * n if fixed else 0
    engines = ",".join(f"127.0.0.1:{http_base + i}" for i in range(n))
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{base}",
        "replay_endpoint": f"tcp://*:{base + 1}",
    }
    cmd = [
        "env",
        "KVMESH_DEV_MODE=1",
        f"KVMESH_ADMIN_API_KEY={ADMIN_KEY}",
        sys.executable,
        "-m",
        "kvmesh.cli",
        "--log-level",
        "WARNING",
        "serve",
        "--emulate",
        str(n),
        "--host",
        "127.0.0.1",
        "--port",
        str(http_base),
        "--emulate-gpu",
        args.emulate_gpu,
        "--emulate-model",
        args.emulate_model,
        "--kv-events-config",
        json.dumps(events),
        "--emulate-time-scale",
        str(args.emulate_time_scale),
        *serve_args.replace("{engines}", engines).split(),
    ]
    proc = Proc(cmd, out / log)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.popen.poll() is None:
        urls = URL_RE.findall(proc.tail(100_000))
        if len(urls) >= n:
            return proc, urls[:n]
        time.sleep(0.3)
    proc.stop()
    raise RuntimeError(f"emulated engines did not start:\n{proc.tail()}")


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
