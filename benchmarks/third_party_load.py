"""kvmesh's cache-aware routing measured by a third-party load generator, GuideLLM: its
synthetic shared-prefix workload (prompts behind one of a few long system prompts, each prompt
distinct), Poisson arrivals, streamed to the router's /v1/completions. Per stack (`up`: `kvmesh
up`; `separate`: `kvmesh serve` + `kvmesh router`, KV events over tcp://) and preset: fresh
processes on free ports, the hit rate from the engines' prefix-cache counters before and after,
TTFT and failures from GuideLLM's JSON report. Failures come first; a run with any gives no ratio.
Emulated engines run in slow motion (--emulate-time-scale K) so the host is not the bottleneck:
GuideLLM measures wall time, K times the emulated one; ratios are unaffected (--rate is per
wall second: K times it per emulated second).

The report states the engines' KV cache (from their /metrics) against the groups' prefixes.
Cache-aware routing is for groups whose prefixes together exceed one engine's cache but fit the
fleet's; with the emulated H100's default cache one engine holds all 8 default groups, so give
the engines a smaller one through --serve-args, e.g. 16 groups of 3,000 tokens on caches of
16,384 tokens (one engine holds 5 groups, the fleet of 4 holds 21):

  python3 -m venv .venv-loadgen && .venv-loadgen/bin/pip install guidellm==0.8.1
  .venv/bin/python benchmarks/third_party_load.py --rounds 2
  .venv/bin/python benchmarks/third_party_load.py --prefix-groups 16 --requests 256 \
      --serve-args "--num-gpu-blocks 1024"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from itertools import chain
from pathlib import Path

from kvmesh.bench.fleet_procs.ports import port_block
from kvmesh.bench.guidellm_report import failures, parse_report, summarize, table
from kvmesh.bench.kv_regime import cache_tokens, regime, regime_line

ROOT = Path(__file__).resolve().parents[1]
TOOL_BIN = ROOT / ".venv-loadgen" / "bin" / "guidellm"
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--presets", default="kvmesh,round-robin")
    p.add_argument("--stacks", default="up,separate", help="up, separate or both")
    p.add_argument("--rounds", type=int, default=1, help="runs of each, alternated; medians")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--emulate-time-scale", type=float, default=5.0)
    p.add_argument("--rate", type=float, default=3.0, help="Poisson arrivals per wall second")
    # 16 prompts a group on average: with 8, a group's unavoidable first miss (1 in 8) would
    # put every router's p90 on a cold prefill
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prefix-groups", type=int, default=8, help="distinct system prompts")
    p.add_argument("--prefix-tokens", type=int, default=3000)
    p.add_argument("--prompt-tokens", type=int, default=128, help="question after the prefix")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--serve-args", default="", help="more flags for the engines, e.g. --num-gpu-blocks N"
    )
    p.add_argument("--tool", default=str(TOOL_BIN), help="the guidellm executable")
    p.add_argument("--out", default="bench-results/third_party_load")
    return p.parse_args(argv)


def stack_commands(args: argparse.Namespace, stack: str, preset: str, port: int) -> list[list]:
    """The stack's commands, each its own process group, engines first. Ports: router `port`,
    engines port+1..port+N, KV events (separate) port+N+1.. (two per engine)."""
    kvmesh, n = str(Path(sys.executable).with_name("kvmesh")), args.engines
    engine = ["--emulate", str(n), "--emulate-time-scale", str(args.emulate_time_scale)]
    engine += shlex.split(args.serve_args)
    if stack == "up":
        return [[kvmesh, "up", *engine, "--preset", preset, "--port", str(port)]]
    ev = port + n + 1
    events = dict(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{ev}")
    events["replay_endpoint"] = f"tcp://*:{ev + 1}"
    serve = [kvmesh, "serve", *engine, "--port", str(port + 1)]
    serve += ["--kv-events-config", json.dumps(events)]
    router = [kvmesh, "router", "--port", str(port), "--preset", preset]
    router += [a for i in range(n) for a in ("--endpoint", f"http://127.0.0.1:{port + 1 + i}")]
    return [serve, router]


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_health(urls: list[str], procs: list[subprocess.Popen], log: Path) -> None:
    deadline = time.monotonic() + 180
    for url in urls:
        while not healthy(url):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{url} never healthy:\n{tail}")
            time.sleep(0.3)


def healthy(url: str) -> bool:
    try:
        get(f"{url}/health", 2.0)
    except OSError:
        return False
    return True


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each process group (router first), SIGKILL after 20 s."""
    for p in reversed(procs):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def cache_counters(engines: list[str]) -> list[Counter]:
    """Each engine's prefix-cache hits and queries (tokens), from its /metrics."""
    from kvmesh.protocol.prom import parse_samples

    counts = [Counter() for _ in engines]
    for url, count in zip(engines, counts, strict=True):
        for s in parse_samples(get(f"{url}/metrics"), lambda n: n in (HITS, QUERIES)):
            count[s.name] += s.value
    return counts


def tool_command(args: argparse.Namespace, target: str, tok: Path, report: Path) -> list:
    model = json.loads(get(f"{target}/v1/models"))["data"][0]["id"]  # the served name
    flags = {
        "--backend": f"kind=openai_http,target={target},model={model},stream=true,"
        "request_format=/v1/completions",
        "--profile": f"kind=poisson,rate={args.rate}",
        "--constraint": f"kind=max_requests,count={args.requests}",
        "--data": f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens="
        f"{args.output_tokens},prefix_count={args.prefix_groups},prefix_tokens={args.prefix_tokens}",
        "--tokenizer": f"kind=hf_auto,model={tok}",
        "--seed": f"kind=static,value={args.seed}",
        "--output": f"kind=json,path={report}",
    }
    return [args.tool, "run", "--disable-console-interactive", *chain(*flags.items())]


def run_tool(cmd: list[str], out: Path, timeout: float) -> None:
    """GuideLLM offline, with 2 worker processes (its default 10 would crowd a small host)."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env |= {"GUIDELLM__MAX_WORKER_PROCESSES": "2"}
    env |= {"GUIDELLM__LOGGING__LOG_FILE": str(out / "guidellm.log")}
    with (out / "guidellm.out").open("w") as fh:
        rc = subprocess.run(cmd, cwd=out, env=env, stdout=fh, stderr=fh, timeout=timeout)
    if rc.returncode != 0 or not (out / "guidellm.json").exists():
        tail = (out / "guidellm.out").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"guidellm exited {rc.returncode}:\n{tail}")


def run_one(args: argparse.Namespace, stack: str, preset: str, rnd: int, tok: Path) -> dict:
    out = Path(args.out) / f"r{rnd}-{stack}-{preset}"
    out.mkdir(parents=True, exist_ok=True)
    port = port_block(3 * args.engines + 3)
    engines = [f"http://127.0.0.1:{port + 1 + i}" for i in range(args.engines)]
    router, log, procs = f"http://127.0.0.1:{port}", out / "stack.log", []
    cmds = stack_commands(args, stack, preset, port)
    try:
        with log.open("w") as fh:
            for i, cmd in enumerate(cmds):
                procs.append(subprocess.Popen(cmd, stdout=fh, stderr=fh, start_new_session=True))
                wait_health(engines if i < len(cmds) - 1 else [*engines, router], procs, log)
        caches = [cache_tokens(get(f"{url}/metrics")) for url in engines]
        before = cache_counters(engines)
        report = out / "guidellm.json"
        cmd = tool_command(args, router, tok, report)
        run_tool(cmd, out, timeout=300 + 4 * args.requests / args.rate)
        after = [a - b for a, b in zip(cache_counters(engines), before, strict=True)]
    finally:
        stop(procs)
    q = sum(c[QUERIES] for c in after)
    hit = round(sum(c[HITS] for c in after) / q, 3) if q else None
    # each engine's share of the prompt tokens: how the router spread the work
    shares = [round(c[QUERIES] / q, 3) if q else None for c in after]
    ran = {"tool_command": cmd, "stack_commands": cmds, "hit_rate": hit, "engine_shares": shares}
    ran["kv_cache_tokens"] = caches
    return {"stack": stack, "preset": preset, "round": rnd} | parse_report(report) | ran


def broken_run(args: argparse.Namespace, stack: str, preset: str, rnd: int, exc: Exception):
    """A run whose stack or tool failed: every request counts as failed."""
    none = {f"ttft_ms_{k}": None for k in ("p50", "p90", "mean")} | {"hit_rate": None, "burst": 0}
    error = {(str(exc).splitlines() or [repr(exc)])[0][:160]: 1}
    failed = {"requests": args.requests, "failed": args.requests, "errors": error}
    return {"stack": stack, "preset": preset, "round": rnd, "tool_command": []} | none | failed


def fleet_regime(runs: list[dict], args: argparse.Namespace) -> dict:
    """The engines' KV caches (as the first run that read them found them) against the prefix
    groups: whether one engine holds every group's prefix, or only the fleet does."""
    caches = next((r["kv_cache_tokens"] for r in runs if r.get("kv_cache_tokens")), [])
    return regime(caches or [None] * args.engines, args.prefix_groups, args.prefix_tokens)


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return done.stdout.strip()


def export_tokenizer(out: Path) -> Path:
    """The served model's tokenizer (the embedded SmolLM2's, which the router and the emulated
    engines use) saved as files GuideLLM loads offline: nothing is fetched from a hub."""
    from kvmesh.protocol.tokenizer import load_tokenizer

    folder = out / "tokenizer"
    load_tokenizer(None)[0].save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()  # GuideLLM runs in a run's folder: absolute paths only
    args.out = str(out)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stacks stopped on the way out
    out.mkdir(parents=True, exist_ok=True)
    if not Path(args.tool).exists():
        print(f"{args.tool} missing: see this script's docstring", file=sys.stderr)
        return 2
    version = subprocess.run([args.tool, "--version"], capture_output=True, text=True)
    tok = export_tokenizer(out)
    stacks, presets = args.stacks.split(","), args.presets.split(",")
    runs = []
    for rnd in range(args.rounds):
        for stack in stacks:
            for preset in presets:
                for _ in range(2):  # a run GuideLLM sent as one burst is run once more
                    try:
                        r = run_one(args, stack, preset, rnd, tok)
                    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                        r = broken_run(args, stack, preset, rnd, exc)
                    runs.append(r)
                    if not r.get("burst"):
                        break
                    print(f"round {rnd} {stack}/{preset}: {r['burst']} requests sent at once")
                line = f"failed {r['failed']}, hit {r['hit_rate']}, TTFT p50 {r['ttft_ms_p50']}"
                line += f", engines' shares of prompt tokens {r.get('engine_shares')}"
                print(f"round {rnd} {stack}/{preset}: {line}", flush=True)
    rows = summarize(runs, args.emulate_time_scale)
    commit = git("rev-parse", "--short", "HEAD") + (
        " + edits under src/" if git("status", "-s", "--", "src") else ""
    )
    lines = failures(runs) + [
        "",
        table(rows, args.emulate_time_scale),
        "",
        regime_line(fleet_regime(runs, args)),
        f"tool: {version.stdout.strip()} (shared-prefix synthetic_text, poisson)",
        f"command: {shlex.join([sys.executable, *sys.argv])}",
        f"tool command (one run): {shlex.join(max(r['tool_command'] for r in runs))}",
        f"kvmesh {commit}, {time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}; times are wall clock, {args.emulate_time_scale:g}x "
        "the emulated ones (the emulated column divides them out)",
    ]
    text = "\n".join(lines)
    print(text)
    (out / "third_party_load.md").write_text(text + "\n")
    doc = {"config": vars(args), "tool": version.stdout.strip(), "commit": commit}
    doc |= {"summary": rows, "runs": runs, "kv_regime": fleet_regime(runs, args)}
    (out / "third_party_load.json").write_text(json.dumps(doc, indent=1, default=str))
    return 1 if any(r["failed"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
