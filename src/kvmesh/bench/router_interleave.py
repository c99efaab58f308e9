"""`kvmesh bench router --interleave`: every router runs at once in front of the same engines,
and the one-at-a-time latency cases send request i through each router in turn (and straight to
an engine), the order reversed every other request, each with a prompt of its own. A busy moment
of a shared host then lands on every router alike, instead of on whichever one was being
measured, so the added latencies of one run compare with each other (the sequential mode's
rounds only spread that noise). The sequential mode uses the same sampler with one router.

The routers that wait meanwhile only scrape the engines: all of them scrape in every case, so
the engines' core is as busy for each. CPU per request still comes from each router's own
closed loop, one router at a time."""

from __future__ import annotations

from kvmesh.bench.router_client import Conn, completion_body, prompt_text
from kvmesh.bench.router_client import request_bytes as raw_request
from kvmesh.protocol.stats import percentile

CASES = (  # name, prompt kind, streaming (then the first body byte is timed, not the end)
    ("small", "small", False),
    ("8k", "long", False),
    ("small_stream_ttfb", "small", True),
    ("8k_stream_ttfb", "long", True),
)
DIRECT = ""  # the label of straight-to-an-engine samples


def percentiles_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    return {"p50_ms": round(percentile(ms, 50), 4), "p99_ms": round(percentile(ms, 99), 4)}


def sample(
    routers: dict[str, str], engines: list[str], model: str | None, n: int, seed: int
) -> tuple[dict[str, dict[str, list[float]]], dict[str, int]]:
    """Per case, per router label (DIRECT: an engine, in turn): the seconds of n requests
    after a warm-up, request i through every router before request i + 1; and each label's
    non-200 answers."""
    conns = {label: Conn(url) for label, url in routers.items()}
    direct = [Conn(u) for u in engines]
    warm = max(5, n // 10)
    out: dict[str, dict[str, list[float]]] = {}
    errors = dict.fromkeys([*routers, DIRECT], 0)
    try:
        for name, kind, stream in CASES:
            text = prompt_text(kind, seed)
            got = out[name] = {label: [] for label in [*routers, DIRECT]}
            for i in range(n + warm):
                d = i % len(engines)
                targets = [*((label, conns[label], url) for label, url in routers.items()),
                           (DIRECT, direct[d], engines[d])]  # fmt: skip
                sends = []
                for k, (label, conn, url) in enumerate(targets):
                    # a prompt of its own: an engine sees each text once, so none of them
                    # is answered from what an earlier one of the same round left warm
                    body = completion_body(model, f"{text} #{i}.{k}", stream)
                    sends.append((label, conn, raw_request(url, "/v1/completions", body)))
                for label, conn, raw in sends if i % 2 else sends[::-1]:
                    resp, first, total = conn.send(raw)
                    if resp.status != 200:
                        errors[label] += 1
                    elif i >= warm:
                        got[label].append(first if stream else total)
    finally:
        for conn in [*conns.values(), *direct]:
            conn.close()
    return out, errors


def latencies(samples: dict[str, dict[str, list[float]]], errors: dict[str, int]) -> dict:
    """Per router label: the latency rows `kvmesh bench router` reports (added = routed minus
    direct, both from the same interleaved requests)."""
    rows: dict[str, dict] = {}
    for name, by_label in samples.items():
        dd = percentiles_ms(by_label[DIRECT])
        for label, values in by_label.items():
            if label == DIRECT:
                continue
            if not values:
                raise RuntimeError(f"{label}: no successful {name} request")
            r = percentiles_ms(values)
            rows.setdefault(label, {})[name] = {
                **r,
                "direct_p50_ms": dd["p50_ms"],
                "direct_p99_ms": dd["p99_ms"],
                "added_p50_ms": round(r["p50_ms"] - dd["p50_ms"], 4),
                "added_p99_ms": round(r["p99_ms"] - dd["p99_ms"], 4),
                "n": len(values),
                "errors": errors[label],
            }
    return rows
