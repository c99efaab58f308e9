"""P/D disaggregation on an emulated fleet, in one run: the same long-prompt workload (by default
5,000 tokens in / 250 out at a fixed Poisson rate, as llm-d's P/D guide) through 4 aggregated
engines behind the `kvmesh` router preset, and through 2 prefill + 2 decode engines behind the
`pd` preset. Reports TTFT, inter-token latency (ITL) and end-to-end latency side by side: P/D
trades a transfer and a hop for decode steps that never wait behind a long prefill."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from kvmesh.bench import http_load

PD_TRANSFER = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default="h100", help="Emulated accelerator.")
    p.add_argument("--model", default="llama-3.1-8b", help="Emulated model.")
    p.add_argument("--prompt-words", type=int, default=5000, help="Words (~tokens) per prompt.")
    p.add_argument("--max-tokens", type=int, default=250, help="Output tokens per request.")
    p.add_argument("--rate", type=float, default=4.0, help="Requests per second (Poisson).")
    p.add_argument("--requests", type=int, default=80, help="Requests per configuration.")
    p.add_argument("--port", type=int, default=0, help="First port (0: pick free ones).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="CI-sized: 8 short requests.")
    p.add_argument("--out", default="bench-results/pd", help="Folder for JSON and plot.")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _router(port: int, args: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvmesh.cli", "router", "--port", str(port), *args]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            import urllib.request

            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"router did not start: {log.read_text()[-2000:]}")


async def _run_load(
    url: str, prompts: list[str], max_tokens: int, rate: float, seed: int
) -> list[dict]:
    rng = random.Random(seed)
    out: list[dict] = []

    async def one(http, prompt: str) -> None:
        try:
            r = await http_load.stream_completion(http, url, prompt, max_tokens)
        except Exception as exc:  # counted, never hidden
            out.append({"error": str(exc)})
            return
        itl = (r.latency - r.ttft) / max(1, r.completion_tokens - 1)
        out.append(
            {
                "ttft": r.ttft,
                "itl": itl,
                "e2e": r.latency,
                "cached": r.cached_tokens,
                "prompt": r.prompt_tokens,
            }
        )

    async with http_load.session() as http:
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(http, prompt)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return out


def _summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r]
    s = {"requests": len(rows), "errors": len(rows) - len(ok)}
    for key in ("ttft", "itl", "e2e"):
        xs = [r[key] * 1000 for r in ok]
        s[f"{key}_ms_p50"] = round(_pct(xs, 0.5), 2)
        s[f"{key}_ms_p90"] = round(_pct(xs, 0.9), 2)
        s[f"{key}_ms_mean"] = round(statistics.mean(xs), 2) if xs else 0.0
    return s


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.prompt_words, args.max_tokens, args.requests, args.rate = 600, 16, 8, 4.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = args.port or http_load.free_port()
    rng = random.Random(args.seed)
    prompts = [
        http_load.random_words(rng.randrange(1 << 30), args.prompt_words)
        for _ in range(args.requests)
    ]
    serve = [
        "--emulate",
        "4",
        "--emulate-gpu",
        args.gpu,
        "--emulate-model",
        args.model,
        "--kv-transfer-config",
        PD_TRANSFER,
    ]
    console = Console()
    results: dict = {"settings": {k: v for k, v in vars(args).items() if not callable(v)}}
    with http_load.EngineProcess(base, serve, out / "engines.log") as _:
        urls = [f"http://127.0.0.1:{base + i}" for i in range(4)]
        roles = ["prefill", "prefill", "decode", "decode"]
        (out / "endpoints.yaml").write_text(
            yaml.safe_dump(
                [
                    {"url": u, "labels": {"llm-d.ai/role": r}}
                    for u, r in zip(urls, roles, strict=True)
                ]
            )
        )
        configs = {
            "aggregated 4": [a for u in urls for a in ("--endpoint", u)] + ["--preset", "kvmesh"],
            "P/D 2P+2D": [
                "--endpoints-file",
                str(out / "endpoints.yaml"),
                "--preset",
                "pd",
            ],
        }
        for i, (name, rargs) in enumerate(configs.items()):
            rport = http_load.free_port()
            proc = _router(rport, [*rargs, "--kv-events", "none"], out / f"router-{i}.log")
            try:
                console.print(f"[bold]{name}[/]: {args.requests} requests at {args.rate}/s")
                rows = asyncio.run(
                    _run_load(
                        f"http://127.0.0.1:{rport}", prompts, args.max_tokens, args.rate, args.seed
                    )
                )
            finally:
                proc.terminate()
                proc.wait(timeout=20)
            results[name] = _summary(rows)
            # distinct prompts next time: the second configuration must not hit the first's cache
            prompts = [p + " " + http_load.random_words(i + 7, 3) for p in prompts]
    table = Table(
        title=f"P/D vs aggregated: {args.prompt_words} in / {args.max_tokens} out at "
        f"{args.rate} req/s, emulated {args.model} on {args.gpu}"
    )
    for col in (
        "configuration",
        "TTFT p50",
        "TTFT p90",
        "ITL p50",
        "ITL p90",
        "e2e p50",
        "e2e p90",
        "errors",
    ):
        table.add_column(col, justify="right" if col != "configuration" else "left")
    for name in configs:
        s = results[name]
        table.add_row(
            name,
            *(
                f"{s[k]:.1f} ms"
                for k in (
                    "ttft_ms_p50",
                    "ttft_ms_p90",
                    "itl_ms_p50",
                    "itl_ms_p90",
                    "e2e_ms_p50",
                    "e2e_ms_p90",
                )
            ),
            str(s["errors"]),
        )
    console.print(table)
    (out / "pd.json").write_text(json.dumps(results, indent=2))
    _plot(results, list(configs), out / "pd.png")
    console.print(f"results: {out / 'pd.json'}, {out / 'pd.png'}")
    return 0


def _plot(results: dict, names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    for ax, key in zip(axes, ("ttft", "itl", "e2e"), strict=True):
        for j, q in enumerate(("p50", "p90")):
            ax.bar(
                [i + 0.4 * j for i in range(len(names))],
                [results[n][f"{key}_ms_{q}"] for n in names],
                width=0.4,
                label=q,
            )
        ax.set_xticks([i + 0.2 for i in range(len(names))], ["aggregated", "P/D"])
        ax.set_title(f"{key.upper()} (ms)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
