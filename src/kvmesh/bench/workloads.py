"""Workloads for the load client: agentic sessions, shared-prefix groups (as inference-perf) and
Mooncake trace replay, with the hit-rate ceiling of each (an infinite cache on one engine).

A prompt is a tuple of segments ``(key, length)``; a segment's text is ``length`` words drawn
deterministically from ``key`` and the seed (a shorter length gives a prefix of a longer one).
Every word of VOCAB is one token in SmolLM2's and most BPE tokenizers, with or without a leading
space, so the words joined by spaces are exactly ``sum(length)`` tokens and equal segment
sequences give equal token blocks. Times are seconds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from kvmesh.bench.http_load import WORDS
from kvmesh.protocol.ceiling import hit_ceiling as prefix_hit_ceiling
from kvmesh.protocol.trace import arrival_offsets, read_trace

# one token each in SmolLM2's tokenizer with and without a leading space (checked by a test)
_SPLIT = {"saw", "looked", "asked", "took", "began"}  # two tokens without the space
VOCAB: tuple[str, ...] = tuple(w for w in dict.fromkeys(WORDS) if w not in _SPLIT)
SEGMENT_BASE = 1 << 41  # segment_runs' token ids start here, clear of a trace's
SEGMENT_SPAN = 1 << 20  # ids reserved for one segment key: longer than any segment

Seg = tuple[str, int]


@dataclass(slots=True)
class Request:
    rid: int
    session: int  # the unit of arrival (open loop) and of concurrency (closed loop)
    prompt: tuple[Seg, ...]
    max_tokens: int
    deps: tuple[int, ...] = ()  # requests of the same session that must finish first
    delay: float = 0.0  # think / tool time after the deps finish (or after the session starts)
    at: float = 0.0  # the session's arrival offset (open loop)
    agent: str = ""  # x-session-id ("" for none)

    @property
    def prompt_tokens(self) -> int:
        return sum(n for _, n in self.prompt)


@dataclass
class Workload:
    kind: str
    requests: list[Request]  # rids 0..n-1; deps come before their dependents
    seed: int = 0
    params: dict = field(default_factory=dict)

    def sessions(self) -> list[list[Request]]:
        """Requests grouped by session, sessions ordered by arrival."""
        by: dict[int, list[Request]] = {}
        for r in self.requests:
            by.setdefault(r.session, []).append(r)
        return sorted(by.values(), key=lambda rs: (rs[0].at, rs[0].session))

    def text(self, request: Request) -> str:
        return prompt_text(request.prompt, self.seed)

    def token_ids(self, request: Request, vocab_ids: list[int]) -> list[int]:
        return prompt_token_ids(request.prompt, self.seed, vocab_ids)

    def describe(self) -> dict:
        tokens = [r.prompt_tokens for r in self.requests]
        return {
            "kind": self.kind,
            "seed": self.seed,
            "requests": len(self.requests),
            "sessions": len({r.session for r in self.requests}),
            "prompt_tokens_total": sum(tokens),
            "prompt_tokens_mean": round(sum(tokens) / max(1, len(tokens)), 1),
            "prompt_tokens_max": max(tokens, default=0),
            "output_tokens_total": sum(r.max_tokens for r in self.requests),
            **self.params,
        }


@lru_cache(maxsize=8192)
def segment_words(key: str, length: int, seed: int) -> str:
    rng = random.Random(f"{seed}|{key}")
    return " ".join(rng.choices(VOCAB, k=length))


def prompt_text(prompt: tuple[Seg, ...], seed: int) -> str:
    return " ".join(segment_words(k, n, seed) for k, n in prompt if n > 0)


@lru_cache(maxsize=8192)
def segment_vocab_indices(key: str, length: int, seed: int) -> tuple[int, ...]:
    """The VOCAB indices of `segment_words(key, length, seed)`: the same draws."""
    rng = random.Random(f"{seed}|{key}")
    return tuple(rng.choices(range(len(VOCAB)), k=length))


def prompt_token_ids(prompt: tuple[Seg, ...], seed: int, vocab_ids: list[int]) -> list[int]:
    """The prompt as token ids, each word its leading-space token (`vocab_ids[i]` for VOCAB[i]):
    what a client that tokenized the prompt itself sends, at the same length as its text."""
    return [vocab_ids[i] for k, n in prompt if n > 0 for i in segment_vocab_indices(k, n, seed)]


def segment_runs(requests: list[Request]) -> list[tuple[tuple[int, int], ...]]:
    """Each request's prompt as runs of token ids: a segment key's tokens are ids of its own
    (keys numbered by first appearance), so prompts share exactly the tokens their segments
    share, as their texts do (a segment's text is a function of its key and offset)."""
    starts: dict[str, int] = {}
    out = []
    for r in requests:
        runs = []
        for key, n in r.prompt:
            if n <= 0:
                continue
            if n > SEGMENT_SPAN:
                raise ValueError(f"segment {key!r} of {n} tokens is longer than {SEGMENT_SPAN}")
            runs.append((starts.setdefault(key, SEGMENT_BASE + len(starts) * SEGMENT_SPAN), n))
        out.append(tuple(runs))
    return out


def hit_ceiling(requests: list[Request], block_size: int = 16) -> dict:
    """The workload's hit-rate ceiling (kvmesh.protocol.ceiling: an infinite vLLM prefix cache
    on one engine, requests in list order), as a dict for the reports."""
    return prefix_hit_ceiling(segment_runs(requests), block_size).as_dict()


def _size(rng: random.Random, mean: float, sigma: float = 0.5) -> int:
    """A lognormal draw with the given mean, clipped to [mean / 8, mean * 4] and >= 1."""
    if mean <= 0:
        return 0
    x = mean * math.exp(rng.gauss(-sigma * sigma / 2, sigma))
    return max(1, int(min(max(x, mean / 8), mean * 4)))


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """Poisson arrival offsets at `rate` per second (all at 0 when rate <= 0)."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        if rate > 0:
            t += rng.expovariate(rate)
    return out


def agentic(
    sessions: int = 16,
    turns: int = 6,
    system_tokens: int = 1500,
    tool_def_tokens: int = 1500,
    repos: int = 4,
    repo_tokens: int = 4000,
    task_tokens: int = 200,
    tool_tokens: int = 600,
    answer_tokens: int = 120,
    think_s: float = 1.0,
    fanout: int = 3,
    fanout_rate: float = 0.2,
    sub_turns: int = 2,
    sub_task_tokens: int = 150,
    return_tokens: int = 150,
    session_rate: float = 0.0,
    seed: int = 0,
) -> Workload:
    """Coding-agent sessions: system prompt + tool definitions (shared by all), one of `repos`
    repository contexts, a task; each turn appends the answer and a tool output, so the context
    grows; think/tool time between turns; at a turn, with probability `fanout_rate`, `fanout`
    sub-agents start from the parent's context, run `sub_turns` turns each, and their results are
    appended to the parent's next turn."""
    params = {k: v for k, v in locals().items() if k != "seed"}
    rng = random.Random(seed)
    reqs: list[Request] = []

    def add(
        s: int, ctx: list[Seg], out: int, deps: tuple[int, ...], delay: float, at: float, agent: str
    ) -> int:
        reqs.append(Request(len(reqs), s, tuple(ctx), out, deps, delay, at, agent))
        return len(reqs) - 1

    for s, at in enumerate(_arrivals(rng, sessions, session_rate)):
        ctx: list[Seg] = [("system", system_tokens), ("tools", tool_def_tokens)]
        ctx += [(f"repo{rng.randrange(max(1, repos))}", repo_tokens), (f"task{s}", task_tokens)]
        deps: tuple[int, ...] = ()
        for t in range(turns):
            delay = _think(rng, think_s) if deps else 0.0
            ans = _size(rng, answer_tokens)
            rid = add(s, ctx, ans, deps, delay, at, f"s{s}")
            ctx += [(f"a{s}.{t}", ans), (f"o{s}.{t}", _size(rng, tool_tokens))]
            deps = (rid,)
            if t == turns - 1 or fanout <= 0 or rng.random() >= fanout_rate:
                continue
            ends = []
            for j in range(fanout):
                cctx, cdeps = [*ctx, (f"st{s}.{t}.{j}", _size(rng, sub_task_tokens))], deps
                for k in range(max(1, sub_turns)):
                    ans = _size(rng, answer_tokens)
                    cdeps = (add(s, cctx, ans, cdeps, _think(rng, think_s), at, f"s{s}.{t}.{j}"),)
                    cctx += [
                        (f"a{s}.{t}.{j}.{k}", ans),
                        (f"o{s}.{t}.{j}.{k}", _size(rng, tool_tokens)),
                    ]
                ends.append(cdeps[0])
                ctx.append((f"r{s}.{t}.{j}", _size(rng, return_tokens)))
            deps = tuple(ends)
    return Workload("agentic", reqs, seed, params)


def _think(rng: random.Random, mean: float) -> float:
    return rng.expovariate(1 / mean) if mean > 0 else 0.0


def shared_prefix(
    groups: int = 8,
    prompts_per_group: int = 16,
    system_tokens: int = 2000,
    question_tokens: int = 200,
    output_tokens: int = 100,
    rate: float = 0.0,
    seed: int = 0,
) -> Workload:
    """inference-perf's shared_prefix: `groups` system prompts, each followed by
    `prompts_per_group` distinct questions; requests in a seeded random order, Poisson at
    `rate` (or all at once for a closed loop)."""
    params = {k: v for k, v in locals().items() if k != "seed"}
    rng = random.Random(seed)
    pairs = [(g, i) for g in range(groups) for i in range(prompts_per_group)]
    rng.shuffle(pairs)
    reqs = []
    for rid, ((g, i), at) in enumerate(zip(pairs, _arrivals(rng, len(pairs), rate), strict=True)):
        prompt = ((f"sp{g}", system_tokens), (f"q{g}.{i}", question_tokens))
        reqs.append(Request(rid, rid, prompt, output_tokens, at=at))
    return Workload("shared-prefix", reqs, seed, params)


def mooncake(
    path: str | Path,
    limit: int = 0,
    start: int = 0,
    time_scale: float = 1.0,
    rate: float = 0.0,
    max_output: int = 0,
    seed: int = 0,
) -> Workload:
    """Mooncake-format trace replay, prompts as kvmesh.protocol.trace converts them: each run of
    token ids is a segment of its own words, so equal hash ids give equal text blocks and the
    reuse is exactly the trace's. Arrival offsets are the timestamps times `time_scale`, or
    rescaled to a mean of `rate` requests/s when given."""
    params = {
        "trace": str(path),
        "limit": limit,
        "start": start,
        "time_scale": time_scale,
        "rate": rate,
        "max_output": max_output,
    }
    rows = read_trace(path, limit, start)
    offsets = arrival_offsets(rows, time_scale, rate)
    reqs = []
    for rid, (row, at) in enumerate(zip(rows, offsets, strict=True)):
        prompt = tuple((f"ids{first}", n) for first, n in row.token_runs())
        out = min(row.max_tokens, max_output) if max_output else row.max_tokens
        reqs.append(Request(rid, rid, prompt, out, at=at))
    params["span_s"] = round(offsets[-1], 3) if offsets else 0.0
    return Workload("trace", reqs, seed, params)
