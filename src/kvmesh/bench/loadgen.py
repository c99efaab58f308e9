"""The load client: runs a workload against one OpenAI-compatible URL (an engine, kvmesh's router
or any other), streaming /v1/completions, open loop (arrival times) or closed loop (sessions in
flight). Measures TTFT, inter-token latency, end-to-end latency, output tokens/s, errors, the
hit rate from usage.prompt_tokens_details.cached_tokens, requests per engine (the
x-kvmesh-endpoint header), and the engines' /metrics counters before and after.

`kvmesh bench agentic|shared-prefix|trace --url URL` runs one workload and writes JSON."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import aiohttp
from rich.table import Table

from kvmesh.bench.engine_probes import kvmesh_engines
from kvmesh.bench.fleet_procs.procs import admin_headers
from kvmesh.bench.http_load import first_model
from kvmesh.bench.progress import LineProgress
from kvmesh.bench.session_loop import play
from kvmesh.bench.workloads import VOCAB, Request, Workload
from kvmesh.protocol.prom import parse_samples
from kvmesh.protocol.stats import percentile

ENDPOINT_HEADER = "x-kvmesh-endpoint"
COUNTERS = {  # engine /metrics counters read before and after a run
    "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "requests": "vllm:request_success_total",
}


@dataclass(slots=True)
class Record:
    rid: int
    start: float  # since the run began, s
    ttft: float = 0.0
    e2e: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    endpoint: str = ""
    error: str = ""
    itls: list[float] = field(default_factory=list)


async def send(
    http: aiohttp.ClientSession,
    url: str,
    model: str | None,
    text: str | list[int],
    r: Request,
    t0: float,
    scale: float = 1.0,
) -> Record:
    """One streaming completion; errors are recorded, never raised. Times are divided by
    `scale`, the engines' time scale (wall seconds per emulated second)."""
    body: dict = {
        "prompt": text,
        "max_tokens": r.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    headers = {"x-session-id": r.agent} if r.agent else {}
    start = time.perf_counter()
    rec = Record(r.rid, (start - t0) / scale)
    last, usage, chunks = None, {}, 0
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            rec.endpoint = resp.headers.get(ENDPOINT_HEADER, url)
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":  # read on to the end: the server closes the stream
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {str(chunk['error'])[:200]}"
                    break
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        rec.ttft = (now - start) / scale
                    else:
                        rec.itls.append((now - last) / scale)
                    last, chunks = now, chunks + 1
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    rec.e2e = (time.perf_counter() - start) / scale
    details = usage.get("prompt_tokens_details") or {}
    rec.prompt_tokens = int(usage.get("prompt_tokens", r.prompt_tokens))
    rec.cached_tokens = int(details.get("cached_tokens") or 0)
    rec.output_tokens = int(usage.get("completion_tokens", chunks))
    if not rec.error and last is None:
        rec.error = "no tokens"
    return rec


async def run_workload(
    url: str,
    wl: Workload,
    *,
    concurrency: int = 0,
    engines: list[str] = (),
    label: str = "",
    progress: LineProgress | None = None,
    timeout_s: float = 600.0,
    time_scale: float = 1.0,
    prompt_format: str = "text",
    on_record: Callable[[Record], None] | None = None,
) -> dict:
    """Every request of `wl` against `url`; a request starts once its deps have finished and its
    delay has passed. Open loop (concurrency 0): each session starts at its arrival time. Closed
    loop: `concurrency` sessions at a time, in arrival order. Returns summarize's dict.
    With engines in slow motion (time_scale K), arrivals and think times are stretched K times
    and every measured time is divided by K, so results are in the engines' emulated seconds.
    `on_record` sees each request's record as it finishes."""
    scale = time_scale
    timeout = aiohttp.ClientTimeout(total=timeout_s * scale, sock_connect=30)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        model = await served_model(http, url, engines)
        prompt = wl.text
        if prompt_format == "ids":
            vocab = await vocab_token_ids(http, engines[0] if engines else url, model)
            prompt = lambda r: wl.token_ids(r, vocab)  # noqa: E731
        timed = await asyncio.to_thread(kvmesh_engines, list(engines))
        before = await scrape_engines(http, engines, timed)
        task = progress.add_task(label or wl.kind, total=len(wl.requests)) if progress else None
        records: list[Record] = []
        tally = [0, 0, 0]  # errors, cached tokens, prompt tokens
        t0 = time.perf_counter()

        async def one(r: Request) -> None:
            rec = await send(http, url, model, prompt(r), r, t0, scale)
            records.append(rec)
            if on_record is not None:
                on_record(rec)
            tally[0] += bool(rec.error)
            tally[1] += rec.cached_tokens
            tally[2] += rec.prompt_tokens if not rec.error else 0
            if progress is not None:
                hit = tally[1] / max(1, tally[2])
                text = f"{label} hit {hit:.2f} err {tally[0]}"
                progress.update(task, advance=1, description=text)

        sessions = len(wl.sessions())
        await play(wl, one, t0, scale, min(concurrency, sessions) if concurrency > 0 else 0)
        wall = (time.perf_counter() - t0) / scale
        after = await scrape_engines(http, engines, timed)
    records.sort(key=lambda x: x.rid)
    return summarize(records, wall, before, after, engines)


async def vocab_token_ids(http: aiohttp.ClientSession, url: str, model: str | None) -> list[int]:
    """Each VOCAB word's token id with a leading space, from the engine's /tokenize."""
    body = {"prompt": "".join(f" {w}" for w in VOCAB), "add_special_tokens": False}
    if model:
        body["model"] = model
    async with http.post(f"{url}/tokenize", json=body) as resp:
        resp.raise_for_status()
        ids = (await resp.json())["tokens"]
    if len(ids) != len(VOCAB):
        raise RuntimeError(f"{url}/tokenize: the workload's words are not one token each")
    return ids


async def served_model(http: aiohttp.ClientSession, url: str, engines: list[str]) -> str | None:
    """The engines' model id when they answer (some routers list a placeholder such as
    "unknown" of their own), else what `url` lists."""
    for engine in engines[:1]:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            if model := await first_model(http, engine):
                return model
    return await first_model(http, url)


def hit_rate(records: list[Record]) -> float:
    prompt = sum(r.prompt_tokens for r in records if not r.error)
    return sum(r.cached_tokens for r in records if not r.error) / prompt if prompt else 0.0


def parse_counters(text: str) -> dict[str, float]:
    """Sums of COUNTERS over every series on a Prometheus text page."""
    names = {v: k for k, v in COUNTERS.items()}
    out = dict.fromkeys(COUNTERS, 0.0)
    for sample in parse_samples(text, names.__contains__):
        out[names[sample.name]] += sample.value
    return out


async def scrape_engines(
    http: aiohttp.ClientSession, engines: list[str], timed: Collection[str] = ()
) -> dict[str, dict]:
    """Each engine's COUNTERS and, from the kvmesh engines among them (`timed`: only those serve
    /admin/timing, and only emulated ones answer it), the predicted busy time."""

    async def one(url: str) -> dict:
        got: dict = {}
        try:
            async with http.get(f"{url}/metrics") as resp:
                got.update(parse_counters(await resp.text()))
            if url not in timed:
                return got
            async with http.get(f"{url}/admin/timing", headers=admin_headers()) as resp:
                if resp.status == 200:
                    got["busy_s"] = float((await resp.json()).get("predicted_step_s_sum", 0.0))
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            got["error"] = str(exc)[:200]
        return got

    return dict(zip(engines, await asyncio.gather(*(one(u) for u in engines)), strict=True))


def summarize(
    records: list[Record], wall: float, before: dict, after: dict, engines: list[str]
) -> dict:
    ok = [r for r in records if not r.error]
    ms = [r.ttft * 1000 for r in ok]
    itl = [x * 1000 for r in ok for x in r.itls]
    e2e = [r.e2e * 1000 for r in ok]
    per_engine, deltas = {}, dict.fromkeys([*COUNTERS, "busy_s"], 0.0)
    for u in engines:
        a, b = after.get(u, {}), before.get(u, {})
        d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in deltas if k in a}
        if "busy_s" in a and "busy_s" in b:  # told by the engine (emulated kvmesh), else unknown
            d["busy"] = d["busy_s"] / wall if wall > 0 else 0.0
        per_engine[u] = d
        for k in deltas:
            deltas[k] += d.get(k, 0.0)
    busy = [d["busy"] for d in per_engine.values() if "busy" in d]
    counted = any("preemptions" in d for d in per_engine.values())
    load = {u: 0 for u in engines}
    for r in records:
        load[r.endpoint] = load.get(r.endpoint, 0) + 1
    if engines and not any(r.endpoint in per_engine for r in records):
        # a router that does not name its endpoint: the engines' own finished-request counts
        load = {u: int(per_engine[u].get("requests", 0)) for u in engines}
    mean = sum(load.values()) / len(load) if load else 0.0
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_samples": sorted({r.error for r in records if r.error})[:5],
        "wall_s": round(wall, 3),
        "hit_rate": round(hit_rate(records), 4),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "output_tokens": sum(r.output_tokens for r in ok),
        "output_tok_s": round(sum(r.output_tokens for r in ok) / wall, 1) if wall else 0.0,
        "req_s": round(len(ok) / wall, 3) if wall else 0.0,
        **{f"ttft_ms_p{q}": round(percentile(ms, q), 2) for q in (50, 90, 99)},
        "ttft_ms_mean": round(sum(ms) / len(ms), 2) if ms else 0.0,
        "itl_ms_p50": round(percentile(itl, 50), 2),
        "itl_ms_p90": round(percentile(itl, 90), 2),
        "itl_ms_p99": round(percentile(itl, 99), 2),  # where prefill stalls in decode batches show
        "itl_ms_max": round(max(itl), 2) if itl else 0.0,
        "e2e_ms_p50": round(percentile(e2e, 50), 2),
        "e2e_ms_p90": round(percentile(e2e, 90), 2),
        "load": load,
        "load_max_mean": round(max(load.values()) / mean, 3) if mean else 0.0,
        "engine_hit_rate": round(deltas["hits"] / deltas["queries"], 4)
        if deltas["queries"]
        else None,
        # None where no engine said (no engine metrics read; no busy time outside emulation)
        "preemptions": int(deltas["preemptions"]) if counted else None,
        "busy_mean": round(sum(busy) / len(busy), 3) if busy else None,
        "engines": per_engine,
        # per request, for plots: start s, ttft ms, e2e ms, prompt, cached, output, endpoint, ok
        "records": [_row(r) for r in records],
    }


def _row(r: Record) -> list:
    """start s, TTFT ms, e2e ms, prompt, cached, output tokens, endpoint, ok (for plots)"""
    ms = (round(r.ttft * 1000, 2), round(r.e2e * 1000, 1))
    return [
        round(r.start, 3),
        *ms,
        r.prompt_tokens,
        r.cached_tokens,
        r.output_tokens,
        r.endpoint,
        int(not r.error),
    ]


def failures(rows: list[tuple[str, dict]]) -> list[str]:
    """One line per row whose requests did not all succeed: printed before any table, since a
    ratio over the survivors of a failing run says nothing."""
    out = []
    for name, s in rows:
        if s["errors"]:
            seen = "; ".join(s.get("error_samples", [])[:3])
            out.append(f"{name}: {s['errors']} of {s['requests']} requests failed ({seen})")
    return out


def table(rows: list[tuple[str, dict]], ceiling: float, title: str) -> Table:
    """A rich table, one row per (name, summary); a row with failed requests shows its failures
    first and no hit rate or ratio (those of its survivors would mislead)."""
    t = Table(title=f"{title}: hit-rate ceiling {ceiling:.3f} (infinite cache, one engine)")
    cols = "policy|failed|hit rate|of ceiling|TTFT p50|p90|p99|ITL p50|p99|out tok/s"
    for col in (cols + "|load max/mean|busy|preempt").split("|"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for name, s in rows:
        busy, failed = s.get("busy_mean"), s["errors"]
        ratios = (
            ("-", "-")
            if failed
            else (f"{s['hit_rate']:.3f}", f"{s['hit_rate'] / ceiling:.0%}" if ceiling else "-")
        )
        t.add_row(
            name,
            f"[red]{failed} of {s['requests']}[/]" if failed else "0",
            *ratios,
            *(f"{s[f'ttft_ms_p{q}']:.0f} ms" for q in (50, 90, 99)),
            f"{s['itl_ms_p50']:.1f} ms",
            f"{s.get('itl_ms_p99', 0.0):.1f} ms",
            f"{s['output_tok_s']:.0f}",
            f"{s['load_max_mean']:.2f}",
            f"{busy:.0%}" if busy is not None else "-",
            str(s["preemptions"]) if s.get("preemptions") is not None else "-",
        )
    return t
