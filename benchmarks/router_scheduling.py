"""In-process micro-benchmark of the router's scheduling path: a long prompt over many endpoints
with the `kvmesh` preset, through the router's own tokenizer cache, block hashing and pipeline.

    .venv/bin/python benchmarks/router_scheduling.py [--tokens 16384] [--endpoints 64]
        [--repeats 200] [--json]

warm: the prompt was seen before (text and block-hash caches hit); cold: a fresh tokenizer
cache, so the prompt is tokenized and hashed from scratch. The precise index holds the prompt's
leading blocks on several endpoints (different lengths, some on CPU) plus unrelated blocks on
every endpoint; the approximate index holds a shorter prefix on a few.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from types import SimpleNamespace

from kvmesh.bench.http_load import WORDS
from kvmesh.protocol.stats import percentile


def summarize(ms: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(ms, 50), 4),
        "p99": round(percentile(ms, 99), 4),
        "mean": round(statistics.fmean(ms), 4),
    }


def _text_of(tokenizer, tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(int(tokens * 1.2) + 64))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    return text if len(offsets) <= tokens else text[: offsets[tokens][0]]


def _populate(precise, approx, endpoints, keys: list[int], noise: int, seed: int) -> None:
    from kvmesh.protocol.kv_events import BlockStored, KVEventBatch

    rng = random.Random(seed)
    n = len(keys)

    def store(name: str, hashes: list[int], medium: str = "GPU") -> None:
        ev = BlockStored(hashes, None, [], 16, None, medium, None)
        precise.apply(name, KVEventBatch(time.time(), [ev]))

    for e in endpoints:  # unrelated contexts everywhere
        store(e.name, [rng.getrandbits(64) for _ in range(noise)])
    for j in range(8):  # several endpoints hold parts of this prefix, of different lengths
        store(endpoints[j].name, keys[: n * (j + 1) // 8])
    for j in range(8, 12):  # some hold half of it offloaded to CPU
        store(endpoints[j].name, keys[: n // 2], "CPU")
    for j in range(12, 16):  # the router sent a shorter prefix to a few
        approx.record(endpoints[j].name, keys[: n // 4])


def run_micro(
    tokens: int = 16384,
    n_endpoints: int = 64,
    repeats: int = 200,
    cold_repeats: int = 20,
    noise_blocks: int = 5000,
    seed: int = 0,
) -> dict:
    from kvmesh.protocol.tokenizer import load_tokenizer
    from kvmesh.router.approx_index import ApproximateIndex
    from kvmesh.router.endpoints import Endpoint
    from kvmesh.router.index import PreciseIndex
    from kvmesh.router.pipeline import Pipeline
    from kvmesh.router.plugins import SchedulingRequest
    from kvmesh.router.tokens import PromptTokenizer

    tokenizer, _ = load_tokenizer(None)
    text = _text_of(tokenizer, tokens, seed)
    rng = random.Random(seed)
    endpoints = []
    for i in range(n_endpoints):
        e = Endpoint(f"http://127.0.0.1:{9000 + i}")
        e.waiting, e.running = float(rng.randint(0, 4)), float(rng.randint(0, 16))
        e.kv_usage, e.in_flight = rng.random() * 0.8, rng.randint(0, 8)
        endpoints.append(e)
    precise, approx = PreciseIndex(), ApproximateIndex()
    pipeline = Pipeline.preset(
        "kvmesh", SimpleNamespace(precise_index=precise, approximate_index=approx)
    )
    pt = PromptTokenizer(tokenizer, 16, "sha256")
    ids = pt.encode_completion(text)
    keys = pt.block_keys(ids)
    _populate(precise, approx, endpoints, keys, noise_blocks, seed)

    def once(tok: PromptTokenizer, k: int) -> tuple[float, float, float, str]:
        t0 = time.perf_counter()
        got = tok.encode_completion(text)
        t1 = time.perf_counter()
        bkeys = tok.block_keys(got)
        t2 = time.perf_counter()
        req = SchedulingRequest(f"r{k}", None, got, bkeys, {}, 16)
        chosen = pipeline.schedule(req, endpoints).primary
        t3 = time.perf_counter()
        assert chosen is not None
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, chosen.name

    result: dict = {
        "prompt_tokens": len(ids),
        "prompt_chars": len(text),
        "blocks": len(keys),
        "endpoints": n_endpoints,
        "index_entries": precise.num_entries(),
        "preset": "kvmesh",
    }
    for phase, count in (("warm", repeats), ("cold", cold_repeats)):
        parts: list[list[float]] = [[], [], []]
        chosen: dict[str, int] = {}
        for k in range(max(1, count)):
            tok = pt if phase == "warm" else PromptTokenizer(tokenizer, 16, "sha256")
            *times, name = once(tok, k)
            for bucket, v in zip(parts, times, strict=True):
                bucket.append(v)
            chosen[name] = chosen.get(name, 0) + 1
        totals = [a + b + c for a, b, c in zip(*parts, strict=True)]
        result[phase] = {
            "repeats": len(totals),
            "total_ms": summarize(totals),
            "tokenize_ms": summarize(parts[0]),
            "hash_ms": summarize(parts[1]),
            "schedule_ms": summarize(parts[2]),
            "chosen": chosen,
        }
    return result


TARGET_MS = 2.0  # scheduling p50, warm and cold


def print_table(micro: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=(
            f"in-process scheduling: {micro['prompt_tokens']} tokens ({micro['blocks']} blocks), "
            f"{micro['endpoints']} endpoints, preset kvmesh, {micro['index_entries']} index "
            f"entries; ms p50 / p99 (target: total p50 <= {TARGET_MS})"
        )
    )
    for col in ("case", "total", "tokenize", "hash", "schedule", "repeats"):
        t.add_column(col, justify="left" if col == "case" else "right")
    for phase in ("warm", "cold"):
        m = micro[phase]
        parts = ("total_ms", "tokenize_ms", "hash_ms", "schedule_ms")
        cells = (f"{m[k]['p50']:.3f} / {m[k]['p99']:.3f}" for k in parts)
        t.add_row(phase, *cells, str(m["repeats"]))
    Console().print(t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="prompt tokens")
    p.add_argument("--endpoints", type=int, default=64, help="endpoints to pick from")
    p.add_argument("--repeats", type=int, default=200, help="warm repeats (cold: a tenth, >= 5)")
    p.add_argument("--noise-blocks", type=int, default=5000, help="unrelated blocks per endpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args()
    cold = max(5, args.repeats // 10)
    micro = run_micro(args.tokens, args.endpoints, args.repeats, cold, args.noise_blocks, args.seed)
    if args.json:
        print(json.dumps(micro, indent=2))
    else:
        print_table(micro)


if __name__ == "__main__":
    main()
