"""`kvmesh bench engine`: the HTTP load client against a fake OpenAI server, and real quick runs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from kvmesh.bench import http_load
from kvmesh.bench.fleet_procs.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def fake_app() -> web.Application:
    """OpenAI-shaped server: a token per word (two for long words), a prefix cache of prompts."""
    seen: set[tuple[str, ...]] = set()

    def count(text: str) -> int:
        return sum(2 if len(w) > 6 else 1 for w in text.split())

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake"}]})

    async def tokenize(request: web.Request) -> web.Response:
        n = count((await request.json())["prompt"])
        return web.json_response({"count": n, "tokens": list(range(n))})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
        assert body["model"] == "fake"
        words = tuple(body["prompt"].split())
        cached = max((i for i in range(len(words) + 1) if words[:i] in seen), default=0)
        seen.update(words[:i] for i in range(len(words) + 1))
        await asyncio.sleep(0.0005 * (len(words) - cached))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(0.001)
            chunk = {"choices": [{"index": 0, "text": " x", "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {
            "prompt_tokens": count(body["prompt"]),
            "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", completions)
    return app


@pytest.fixture
async def fake_url():
    runner = web.AppRunner(fake_app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_prompts_have_exact_lengths_and_are_distinct(fake_url):
    prompts = await http_load.make_prompts(fake_url, 5, 40, seed=3, model="fake")
    assert len(set(prompts)) == 5
    async with http_load.session() as http:
        for p in prompts:
            assert await http_load.count_tokens(http, fake_url, p, "fake") == 40
    assert prompts == await http_load.make_prompts(fake_url, 5, 40, seed=3, model="fake")


async def test_measure_server_on_fake(fake_url):
    prompts = await http_load.build_prompts(fake_url, [1, 3], 20, 200, 2, 0, "fake")
    assert [len(v) for v in prompts.by_batch.values()] == [1, 3] and len(prompts.long) == 3

    class Progress:
        def __init__(self) -> None:
            self.done: dict[int, int] = {}

        def add_task(self, name: str, total: int | None = None) -> int:
            self.done[len(self.done)] = 0
            return len(self.done) - 1

        def advance(self, task: int, n: int = 1) -> None:
            self.done[task] += n

    progress = Progress()
    tp, ttft = await http_load.measure_server(fake_url, "fake", prompts, 5, 0, progress, "fake")
    assert progress.done[0] == 5 and progress.done[1] == 15
    assert tp["3"]["output_tokens"] == 15 and tp["3"]["tok_s"] > 0
    assert len(tp["3"]["ttft_ms"]) == 3 and tp["3"]["prompt_tokens_mean"] == 20
    assert ttft["prompt_tokens"] == 200
    assert ttft["cold_cached_tokens"] == [0, 0]
    words = [len(p.split()) for p in prompts.long[1:]]  # the fake caches words, not tokens
    assert ttft["cached_cached_tokens"] == words and ttft["suffix_cached_tokens"] == words
    assert 0 < ttft["ratio_cached"] < 1 and ttft["cold_ms"] > 0


def run_bench(tmp_path: Path, *flags: str, timeout: int) -> dict:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvmesh.cli", "bench", "engine", "--quick", "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "160"}
    proc = subprocess.run(
        [*cmd, *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Output tokens/s" in proc.stdout and "TTFT" in proc.stdout
    assert (out / "engine_bench.png").stat().st_size > 1000
    assert "[bench engine " in proc.stderr and "kvmesh: batch 2" in proc.stderr
    results = json.loads((out / "results.json").read_text())
    rows = json.loads((out / "engine.rows.json").read_text())
    assert rows["status"] == "complete" and rows["rows_done"] == rows["rows_total"]
    tp = [r for r in rows["rows"] if r["phase"] == "throughput" and r["engine"] == "kvmesh"]
    assert [r["tok_s"] for r in tp] == [results["throughput"]["kvmesh"][b]["tok_s"] for b in "12"]
    return results


def check_server_results(results: dict) -> None:
    assert results["config"]["batch_sizes"] == [1, 2] and results["config"]["max_tokens"] == 4
    tp = results["throughput"]["kvmesh"]
    for b in ("1", "2"):
        assert tp[b]["tok_s"] > 0 and tp[b]["output_tokens"] == 4 * int(b)
        assert len(tp[b]["ttft_ms"]) == int(b) and tp[b]["ttft_ms_p50"] > 0
    ttft = results["ttft"]["kvmesh"]
    assert ttft["prompt_tokens"] > 250
    for key in ("cold_ms", "cached_ms", "suffix_ms", "ratio_cached", "ratio_suffix"):
        assert ttft[key] > 0
    assert ttft["cold_cached_tokens"] == [0]
    assert ttft["cached_cached_tokens"][0] > 0


def test_quick_engine_only(tmp_path):
    results = run_bench(tmp_path, "--skip-hf", timeout=240)
    check_server_results(results)
    assert "hf_batched" not in results["throughput"]
    assert [t["name"] for t in results["targets"]][0].startswith("kvmesh TTFT")


@pytest.mark.slow
def test_quick_with_hf(tmp_path):
    results = run_bench(tmp_path, timeout=400)
    check_server_results(results)
    assert "hf_error" not in results
    for name in ("hf_batched", "hf_sequential"):
        for b in ("1", "2"):
            assert results["throughput"][name][b]["tok_s"] > 0
            assert results["throughput"][name][b]["output_tokens"] == 4 * int(b)
    assert len(results["targets"]) == 4
