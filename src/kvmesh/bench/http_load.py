"""Benchmark plumbing over HTTP: an async streaming OpenAI client (TTFT, token counts),
exact-length prompts calibrated with POST /tokenize, the throughput + TTFT suite run against one
server (started by bench.fleet_procs.serve).

Works against any OpenAI-compatible server (kvmesh engine, router, vLLM); imports nothing of
kvmesh's engine. Times are `time.perf_counter()` seconds.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from kvmesh.protocol.stats import percentile

SUFFIX_WORDS = 16  # new words after a cached long prompt (the "prefix + new turn" case)

# Common English words: with a leading space each is one BPE token in most tokenizers, so n words
# are close to n tokens before calibration against the server's own tokenizer.
WORDS = """the of and to in is was for that with as on by at from his her they this which had are
not be one all were we when there can an your their said if do will each about how up out them then
she many some so these would other into has more two like him see time could no make than first been
its who now people my made over did down only way find use may water long little very after words
called just where most know get through back much before go good new write our used me man too any
day same right look think also around another came come work three word must because does part even
place well such here take why things help put years different away again off went old number great
tell men say small every found still between name should home big give air line set own under read
but last never us left end along while might next sound below saw something thought both few those
always looked show large often together asked house world going want school important until form
food keep children feet land side without boy once animals life enough took four head above kind
began almost live page got earth need far hand high year mother light country father let night
""".split()  # noqa: SIM905


@dataclass
class StreamResult:
    ttft: float  # send → first chunk with a choice (first token)
    latency: float  # send → end of stream
    completion_tokens: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""


@dataclass
class BatchResult:
    concurrency: int
    wall_s: float
    output_tokens: int
    results: list[StreamResult] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        ttfts = [r.ttft * 1000 for r in self.results]
        return {
            "concurrency": self.concurrency,
            "tok_s": round(self.tok_s, 2),
            "wall_s": round(self.wall_s, 4),
            "output_tokens": self.output_tokens,
            "prompt_tokens_mean": round(statistics.mean(r.prompt_tokens for r in self.results), 1),
            "ttft_ms_p50": round(percentile(ttfts, 50), 2),
            "ttft_ms_max": round(max(ttfts), 2),
            "ttft_ms": [round(t, 2) for t in ttfts],
        }


def session(timeout_s: float = 900.0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=aiohttp.TCPConnector(limit=0),
    )


async def first_model(http: aiohttp.ClientSession, url: str) -> str | None:
    """The first model id served at url (vLLM requires `model` in requests)."""
    async with http.get(f"{url}/v1/models") as resp:
        if resp.status != 200:
            return None
        data = (await resp.json(content_type=None)).get("data") or []  # some serve text/plain
        return data[0]["id"] if data else None


async def count_tokens(http: aiohttp.ClientSession, url: str, text: str, model: str | None) -> int:
    body: dict = {"prompt": text}
    if model:
        body["model"] = model
    async with http.post(f"{url}/tokenize", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"POST {url}/tokenize: {resp.status} {(await resp.text())[:300]}")
        data = await resp.json()
    return int(data.get("count", len(data.get("tokens", []))))


async def fit_prompt(
    http: aiohttp.ClientSession, url: str, rng: random.Random, target: int, model: str | None
) -> str:
    """Random words whose tokenization on the server is `target` tokens (or as close as BPE
    allows: within a token or two)."""
    words = [rng.choice(WORDS) for _ in range(target)]
    best, best_err = " ".join(words), None
    for _ in range(8):
        text = " ".join(words)
        n = await count_tokens(http, url, text, model)
        if best_err is None or abs(n - target) < best_err:
            best, best_err = text, abs(n - target)
        if n == target:
            break
        if n > target:
            words = words[: max(1, len(words) - (n - target))]
        else:
            words += [rng.choice(WORDS) for _ in range(target - n)]
    return best


async def make_prompts(
    url: str, count: int, tokens: int, seed: int, model: str | None = None
) -> list[str]:
    """`count` distinct prompts of `tokens` tokens each, deterministic in `seed`."""
    rng = random.Random(seed)
    async with session() as http:
        prompts: list[str] = []
        while len(prompts) < count:
            text = await fit_prompt(http, url, rng, tokens, model)
            if text not in prompts:
                prompts.append(text)
        return prompts


def random_words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def stream_completion(
    http: aiohttp.ClientSession,
    url: str,
    prompt: str,
    max_tokens: int,
    model: str | None = None,
    on_token: Callable[[], None] | None = None,
) -> StreamResult:
    """One streaming /v1/completions request at temperature 0 with ignore_eos."""
    body: dict = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    ttft: float | None = None
    chunks, parts, usage = 0, [], {}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"POST {url}/v1/completions: {resp.status} {await resp.text()}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error from {url}: {chunk['error']}")
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                chunks += 1
                parts.append(chunk["choices"][0].get("text") or "")
                if on_token is not None:
                    on_token()
            if chunk.get("usage"):
                usage = chunk["usage"]
    latency = time.perf_counter() - t0
    details = usage.get("prompt_tokens_details") or {}
    return StreamResult(
        ttft=ttft if ttft is not None else latency,
        latency=latency,
        completion_tokens=int(usage.get("completion_tokens", chunks)),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens") or 0),
        text="".join(parts),
    )


async def run_batch(
    url: str,
    prompts: Sequence[str],
    max_tokens: int,
    model: str | None = None,
    on_token: Callable[[], None] | None = None,
) -> BatchResult:
    """All prompts at once (concurrency = len(prompts)); wall time from first send to last end."""
    async with session() as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(stream_completion(http, url, p, max_tokens, model, on_token) for p in prompts)
        )
        wall = time.perf_counter() - t0
    return BatchResult(len(prompts), wall, sum(r.completion_tokens for r in results), results)


async def ttft_once(url: str, prompt: str, model: str | None = None) -> StreamResult:
    """TTFT of one request with max_tokens=1 on a fresh connection."""
    async with session() as http:
        return await stream_completion(http, url, prompt, 1, model)


@dataclass
class Prompts:
    warmup: str
    by_batch: dict[int, list[str]]  # distinct prompts for every batch size
    long: list[str]  # long[0] warms long shapes up; long[1:] are one per TTFT repeat


async def build_prompts(
    url: str, sizes: list[int], tokens: int, long_tokens: int, repeats: int, seed: int, model
) -> Prompts:
    short = await make_prompts(url, 1 + sum(sizes), tokens, seed, model)
    long = await make_prompts(url, repeats + 1, long_tokens, seed + 1, model)
    by_batch, i = {}, 1
    for b in sizes:
        by_batch[b], i = short[i : i + b], i + b
    return Prompts(short[0], by_batch, long)


def _ms(x: float) -> float:
    return round(x * 1000, 2)


async def measure_server(
    url: str,
    label: str,
    prompts: Prompts,
    max_tokens: int,
    seed: int,
    progress,
    model=None,
    on_row: Callable[[dict, str], None] | None = None,
) -> tuple[dict, dict]:
    """Throughput at each batch size, then long-prompt TTFT cold / cached / cached + suffix, on
    one OpenAI-compatible server. `progress` has rich Progress's add_task and advance;
    `on_row(row, name)` is handed each batch's row, then the TTFT row, as each finishes."""
    await run_batch(url, [prompts.warmup], 4, model)
    throughput = {}
    for b, batch in prompts.by_batch.items():
        task = progress.add_task(f"{label}: batch {b}", total=b * max_tokens)
        res = await run_batch(url, batch, max_tokens, model, lambda t=task: progress.advance(t))
        throughput[str(b)] = res.summary()
        if on_row is not None:
            row = {"engine": label, "phase": "throughput", "batch": b, **throughput[str(b)]}
            on_row(row, f"{label} throughput, batch {b}")
    task = progress.add_task(f"{label}: long-prompt TTFT", total=3 * len(prompts.long) - 2)
    await ttft_once(url, prompts.long[0], model)
    progress.advance(task)
    runs: dict[str, list[StreamResult]] = {"cold": [], "cached": [], "suffix": []}
    for r, prompt in enumerate(prompts.long[1:]):
        suffix = prompt + " " + random_words(seed + 1000 + r, SUFFIX_WORDS)
        for kind, text in (("cold", prompt), ("cached", prompt), ("suffix", suffix)):
            runs[kind].append(await ttft_once(url, text, model))
            progress.advance(task)
    ttft: dict = {"prompt_tokens": runs["cold"][0].prompt_tokens}
    for kind, rs in runs.items():
        ttft[f"{kind}_ms"] = _ms(statistics.median(x.ttft for x in rs))
        ttft[f"{kind}_ms_all"] = [_ms(x.ttft) for x in rs]
        ttft[f"{kind}_cached_tokens"] = [x.cached_tokens for x in rs]
    ttft["ratio_cached"] = round(ttft["cached_ms"] / ttft["cold_ms"], 4)
    ttft["ratio_suffix"] = round(ttft["suffix_ms"] / ttft["cold_ms"], 4)
    if on_row is not None:
        on_row({"engine": label, "phase": "ttft", **ttft}, f"{label} long-prompt TTFT")
    return throughput, ttft
