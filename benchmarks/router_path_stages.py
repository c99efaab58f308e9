"""Where the router's CPU goes for one request, stage by stage, in process and without sockets
(benchmarks/router_path.py's harness: a client's bytes into the front door, a canned engine answer
back). Each stage is a method of the request path timed by a wrapper (the process's CPU time around
the call, so a busy host's waits do not count; the wrapper's own ~1 us a call lands in the
stages around it); nested stages are inclusive, so a parent's own time is its figure minus its
children's. The recording of what was sent (the indexes' and caches' deferred bookkeeping) runs
where the next reader settles it, inside another stage: it is shown apart as well. `whole` is
the same requests untimed (process_time), the least of the rounds; the stages are the least per
stage over the rounds.

    .venv/bin/python benchmarks/router_path_stages.py [--kind extended|new|repeated] [-n 3000]
        [--pure-python-too]

``--pure-python-too`` runs the same measurement again in a child process with
KVMESH_PURE_PYTHON=1 (the byte-level scan, router/_bytelevel.pyx, replaced by its Python twin in
router.fastbpe) and prints both side by side: what the compiled scan saves, stage by stage.

kinds: `extended` an ~8,000-character prompt with a new tail each time (an agent's next turn),
`new` a small prompt never seen before, `repeated` one small prompt again and again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager

import router_path  # benchmarks/router_path.py, beside this script

from kvmesh.bench.router_client import prompt_text
from kvmesh.router import (
    approx_index,
    handlers,
    index,
    pipeline,
    proxy,
    request_parser,
    request_reader,
    text_runs,
    tokens,
)
from kvmesh.router.app import Router

# (label, owner, method, parent label): the stages of one request, in the order they run
STAGES = [
    ("HTTP head and body read", request_reader.RequestReader, "feed", ""),
    ("handle_inference", handlers, "handle_inference", ""),
    ("parse: JSON fields", request_parser.RequestParser, "fields", "handle_inference"),
    ("parse: ids and keys", tokens.PromptTokenizer, "ids_and_keys", "handle_inference"),
    ("text cache lookup", text_runs.RunStore, "find", "parse: ids and keys"),
    ("encode new text", tokens.PromptTokenizer, "_extend", "parse: ids and keys"),
    ("pick", Router, "pick", "handle_inference"),
    ("precise index lookup", index.PreciseIndex, "longest_match", "pick"),
    ("approximate index lookup", approx_index.ApproximateIndex, "longest_match", "pick"),
    ("scorers and picker", pipeline.Pipeline, "run_profile", "pick"),
    ("request head to engine", handlers, "_request_head", "handle_inference"),
    ("record: approximate index", approx_index.ApproximateIndex, "settle", ""),
    ("record: tokenizer caches", tokens.PromptTokenizer, "settle", ""),
    ("answer back to client", proxy.Upstream, "data_received", ""),
]


clock = time.process_time


@contextmanager
def timed(owner, name: str, into: dict[str, float], label: str):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = clock()
        try:
            return original(*args, **kwargs)
        finally:
            into[label] += clock() - t0

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def requests_of(kind: str, n: int) -> list[bytes]:
    if kind == "extended":
        long = prompt_text("long")
        return [router_path.request_bytes(f"{long} #{i}") for i in range(n)]
    if kind == "new":
        return [router_path.request_bytes(f"{router_path.PROMPT} {i}") for i in range(n)]
    return [router_path.request_bytes(router_path.PROMPT)] * n


def measure(preset: str, kind: str, n: int, rounds: int, tokenizer) -> dict:
    warmup = max(50, n // 10)
    requests = requests_of(kind, warmup + n)
    whole, stages = [], defaultdict(list)
    for _ in range(rounds):
        whole.append(asyncio.run(router_path._time_path(preset, tokenizer, requests, warmup)))
        spent: dict[str, float] = defaultdict(float)
        with ExitStack() as stack:
            for label, owner, name, _ in STAGES:
                if hasattr(owner, name):
                    stack.enter_context(timed(owner, name, spent, label))
            # the harness times the warm-up too: scale to the measured requests
            asyncio.run(router_path._time_path(preset, tokenizer, requests, warmup))
        for label, seconds in spent.items():
            stages[label].append(seconds / (warmup + n) * 1e6)
    return {"whole": min(whole), "stages": {k: min(v) for k, v in stages.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kind", choices=("extended", "new", "repeated"), default="extended")
    p.add_argument("--presets", default="kvmesh,round-robin")
    p.add_argument("-n", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pure-python-too", action="store_true")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # (the child's output)
    args = p.parse_args()
    from kvmesh.engine.tokenizer import load_tokenizer

    tokenizer, _ = load_tokenizer(None)
    presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    got = {preset: measure(preset, args.kind, args.n, args.rounds, tokenizer) for preset in presets}
    if args.json:
        print(json.dumps(got))
        return
    columns = {p: got[p] for p in presets}
    if args.pure_python_too:
        env = {**os.environ, "KVMESH_PURE_PYTHON": "1"}
        child = [sys.executable, __file__, "--json", "--kind", args.kind, "--presets"]
        child += [args.presets, "-n", str(args.n), "--rounds", str(args.rounds)]
        pure = json.loads(subprocess.run(child, env=env, capture_output=True, text=True,
                                         check=True).stdout.splitlines()[-1])  # fmt: skip
        columns = {f"{p} (compiled scan)": got[p] for p in presets}
        columns.update({f"{p} (Python twin)": pure[p] for p in presets})
    print(f"router CPU per request, us, {args.kind} prompt ({args.n} requests, least of "
          f"{args.rounds} rounds; stages inclusive, indented under their parent)")  # fmt: skip
    print(f"| stage | {' | '.join(columns)} |")
    print("|---" * (len(columns) + 1) + "|")
    whole = " | ".join(f"{c['whole']:.1f}" for c in columns.values())
    print(f"| whole request (untimed run) | {whole} |")
    depth = {"": -1}
    for label, _, _, parent in STAGES:
        depth[label] = depth[parent] + 1
        cells = [f"{c['stages'][label]:.1f}" if label in c["stages"] else "-"
                 for c in columns.values()]  # fmt: skip
        print(f"| {'  ' * depth[label]}{label} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
