"""TTFT of one long prompt on the real engine (SmolLM2 on this CPU) with its prefix in each place
it can be: the device cache, the host-DRAM tier, the disk tier, a peer engine, or nowhere
(recomputed), side by side in one run.

Four `kvmesh serve` engines, one request at a time, max_tokens 1 (the latency is the TTFT):
  tiered   a device cache just over one prompt, a host tier of several prompts;
  spilling the same device cache, a host tier of a few blocks and a disk tier: what the host
           tier evicts spills to disk (written, flushed and dropped from the page cache);
  pullers  no tiers, allowed to pull from `tiered`: one over HTTP (--kv-peer-transport tcp),
           one over shared memory (shm).
The prompt is computed once (recomputed), sent again (device), pushed out of the device by two
other prompts of the same length and sent again (host tier on `tiered`, disk on `spilling`), and
sent to each puller naming `tiered` as its source (peer, HTTP; peer, shared memory). Each row
also reports the cached tokens and the tier counters that moved, so a row's source is checked,
not assumed."""

from __future__ import annotations

import argparse
import json
import os
import re
import time
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmesh.bench import http_load
from kvmesh.bench.fleet_procs.ports import free_port
from kvmesh.bench.fleet_procs.procs import ADMIN_KEY, admin_headers
from kvmesh.bench.fleet_procs.serve import EngineProcess, engine_processes
from kvmesh.bench.progress import BenchRun
from kvmesh.protocol.prom import parse_samples

PEER_HEADER = "x-kv-cache-source-host-port"
# the tier and peer counters a row reports (offload hits, peer transfers, pulled tokens; not pulls)
_TIER_COUNTER = re.compile(r"kvmesh:kv_(?:offload_hits|peer_(?!pulls_)\w+)_total")
ROWS = (  # (key in tiers.json, label in the table)
    ("device", "device"),
    ("host", "host"),
    ("disk", "disk"),
    ("peer", "peer, HTTP"),
    ("peer_shm", "peer, shared memory"),
    ("recomputed", "recomputed"),
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-tokens", type=int, default=4000, help="Tokens in the prompt.")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--host-tier-gib", type=float, default=1.0, help="Host tier of `tiered`.")
    p.add_argument("--disk-tier-gib", type=float, default=1.0, help="Disk tier of `spilling`.")
    p.add_argument("--threads", type=int, default=0, help="Torch threads per engine (0: all).")
    p.add_argument(
        "--repeats", type=int, default=3, help="Samples of the cheap rows (device, peer)."
    )
    p.add_argument("--quick", action="store_true", help="CI-sized: a 400-token prompt.")
    p.add_argument("--out", default="bench-results/tiers", help="Folder for the JSON.")


def _post(url: str, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(req, timeout=900) as resp:
        return json.loads(resp.read())


def _tier_counters(url: str) -> dict[str, float]:
    """kvmesh tier and peer counters from /metrics, by name and medium or transport/outcome."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for s in parse_samples(text, _TIER_COUNTER.fullmatch):
        named = [s.labels[k] for k in ("medium", "transport", "outcome") if k in s.labels]
        out[s.name + (f"[{'/'.join(named)}]" if named else "")] = s.value
    return out


def _ttft(url: str, ids: list[int], headers: dict | None = None) -> tuple[float, int, dict]:
    """(seconds to the first token, cached tokens, tier counters that moved)."""
    before = _tier_counters(url)
    t0 = time.perf_counter()
    out = _post(
        url + "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0}, headers
    )
    seconds = time.perf_counter() - t0
    after = _tier_counters(url)
    moved = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    return seconds, out["usage"]["prompt_tokens_details"]["cached_tokens"], moved


def _prompt_ids(url: str, seed: int, n: int) -> list[int]:
    text = http_load.random_words(seed, n)  # words tokenize to at least one token each
    ids = _post(url + "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
    assert len(ids) >= n, "the prompt came out shorter than asked"
    return ids[:n]


def main(args: argparse.Namespace) -> int:
    return BenchRun("tiers", args.out, total=len(ROWS)).call(_main, args)


def _main(args: argparse.Namespace, bench: BenchRun) -> int:
    if args.quick:
        args.prompt_tokens, args.host_tier_gib, args.disk_tier_gib = 400, 0.1, 0.1
    out = Path(args.out)
    (out / "disk").mkdir(parents=True, exist_ok=True)
    blocks = args.prompt_tokens // args.block_size + 8  # one prompt fits, two do not
    common = ["--num-gpu-blocks", str(blocks), "--block-size", str(args.block_size)]
    if args.threads:
        common += ["--num-threads", str(args.threads)]
    ports = [free_port() for _ in range(4)]
    tiered = [*common, "--kv-offloading-size", str(args.host_tier_gib)]
    spilling = [*common, "--kv-offloading-size", "0.003"]  # a few blocks: nearly all spill
    spilling += ["--kv-offloading-disk-path", str(out / "disk")]
    spilling += ["--kv-offloading-disk-size", str(args.disk_tier_gib)]
    puller = [*common, "--kv-peer-allowlist", f"127.0.0.1:{ports[0]}", "--kv-peer-transport"]
    console = Console()
    rows: dict[str, dict] = {}
    os.environ["KVMESH_DEV_MODE"] = "1"  # /reset_prefix_cache, to repeat the peer pull
    os.environ["KVMESH_ADMIN_API_KEY"] = ADMIN_KEY  # which it needs (the engines inherit it)

    def record(name: str, result: tuple[float, int, dict], samples=None) -> None:
        seconds, cached, moved = result
        rows[name] = {"ttft_s": round(seconds, 4), "cached_tokens": cached, "moved": moved}
        if samples:
            rows[name]["samples_s"] = [round(x, 4) for x in samples]
        line = f"{name:>10}: TTFT {seconds * 1000:9.1f} ms, {cached} tokens cached {moved}"
        console.print(line, markup=False)  # counter keys carry [labels], not rich markup
        bench.add({"row": name, **rows[name]}, name)

    def median(runs: list) -> tuple[tuple[float, int, dict], list[float]]:
        """The median sample, and every sample's TTFT."""
        runs = sorted(runs, key=lambda r: r[0])
        return runs[len(runs) // 2], [r[0] for r in runs]

    def repeated(fn) -> tuple[tuple[float, int, dict], list[float]]:
        return median([fn() for _ in range(max(1, args.repeats))])

    def pull_once(p_url: str, peer: str):
        reset = urllib.request.Request(
            p_url + "/reset_prefix_cache", b"", admin_headers(), method="POST"
        )
        urllib.request.urlopen(reset, timeout=60).close()  # the puller forgets the last pull
        return _ttft(p_url, prompt, {PEER_HEADER: peer})

    bench.note("starting 4 engines (tiered, spilling, two pullers)")
    with engine_processes(
        EngineProcess(ports[0], tiered, out / "tiered.log"),
        EngineProcess(ports[1], spilling, out / "spilling.log"),
        EngineProcess(ports[2], [*puller, "tcp"], out / "puller.log"),
        EngineProcess(ports[3], [*puller, "shm"], out / "shm-puller.log"),
    ) as (t_url, s_url, p_url, m_url):
        bench.note(f"engines up; {args.prompt_tokens}-token prompts, one request at a time")
        prompt = _prompt_ids(t_url, 1, args.prompt_tokens)
        fillers = [_prompt_ids(t_url, seed, args.prompt_tokens) for seed in (2, 3)]
        warm_up = _prompt_ids(t_url, 99, 32)  # first-request costs stay out of the figures
        _ttft(t_url, warm_up)
        record("recomputed", _ttft(t_url, prompt))
        record("device", *repeated(lambda: _ttft(t_url, prompt)))
        for filler in fillers:
            _ttft(t_url, filler)
        record("host", _ttft(t_url, prompt))
        for ids in (prompt, *fillers):
            _ttft(s_url, ids)
        record("disk", _ttft(s_url, prompt))
        source = f"127.0.0.1:{ports[0]}"
        for url in (p_url, m_url):
            _ttft(url, warm_up)
        pulls: dict[str, list] = {"peer": [], "peer_shm": []}
        for i in range(max(1, args.repeats)):  # interleaved, each first in turn: same conditions
            order = [("peer", p_url), ("peer_shm", m_url)]
            for name, url in order[:: 1 if i % 2 == 0 else -1]:
                pulls[name].append(pull_once(url, source))
        for name, runs in pulls.items():
            record(name, *median(runs))

    table = Table(title=f"TTFT of a {args.prompt_tokens}-token prompt, SmolLM2-135M on this CPU")
    for col in ("prefix from", "TTFT", "vs recomputed", "cached tokens"):
        table.add_column(col, justify="left" if col == "prefix from" else "right")
    base = rows["recomputed"]["ttft_s"]
    for name, label in ROWS:
        r = rows[name]
        speedup = base / r["ttft_s"] if r["ttft_s"] else 0.0
        table.add_row(
            label, f"{r['ttft_s'] * 1000:.1f} ms", f"{speedup:.1f}x", str(r["cached_tokens"])
        )
    console.print(table)
    results = {"settings": {k: v for k, v in vars(args).items() if not callable(v)}, **rows}
    (out / "tiers.json").write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"results: {out / 'tiers.json'}")
    return 0
