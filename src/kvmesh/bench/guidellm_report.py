"""GuideLLM's JSON report as benchmarks/third_party_load.py reads it (requests, failures with
their messages, TTFT, a Poisson schedule GuideLLM sent as one burst), and the summary of its
runs: medians per (stack, preset) over rounds, the ratio to round robin's only where neither
side failed, failures listed first."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path


def parse_report(path: Path) -> dict:
    """What one GuideLLM JSON report says of its (single) benchmark: requests, failures with
    their messages, and TTFT (ms, wall clock) of the successful requests."""
    doc = json.loads(path.read_text())
    bench = doc["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    ttft = bench["metrics"]["time_to_first_token_ms"]["successful"]
    errors = Counter()
    for kind in ("errored", "incomplete"):
        for req in bench["requests"].get(kind) or []:
            msg = str((req.get("info") or {}).get("error") or kind).splitlines()[0]
            errors[msg[:160]] += 1
    # a request GuideLLM sent but left out of every list (seen once: "processing_requests": 1
    # at the end of a run) is counted as failed, not silently dropped
    lost = bench["scheduler_state"]["created_requests"] - totals["total"]
    if lost > 0:
        errors["sent by GuideLLM but missing from its report"] = lost
    # GuideLLM 0.8.1's Poisson start can race (its workers read the arrival offset before it is
    # set): arrival times then lie before the run's start and every request goes out at once
    start, reqs = bench["scheduler_state"]["start_time"], bench["requests"].values()
    times = [r["info"].get("timings", {}) for rs in reqs for r in rs or [] if r.get("info")]
    burst = sum(1 for t in times if t.get("targeted_start", start) < start - 1.0)
    return {
        "tool_version": doc["metadata"]["guidellm_version"],
        "requests": totals["total"] + max(lost, 0),
        "successful": totals["successful"],
        "failed": totals["errored"] + totals["incomplete"] + max(lost, 0),
        "errors": dict(errors),
        "burst": burst,
        "ttft_ms_p50": ttft["percentiles"]["p50"] if ttft["count"] else None,
        "ttft_ms_p90": ttft["percentiles"]["p90"] if ttft["count"] else None,
        "ttft_ms_mean": ttft["mean"] if ttft["count"] else None,
    }


def med(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict], scale: float) -> list[dict]:
    """One row per (stack, preset), medians over rounds; the ratio to round-robin's of the same
    stack only where neither side had a failed request."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in (r for r in runs if not r["burst"]):  # not the workload asked for: left out
        groups.setdefault((r["stack"], r["preset"]), []).append(r)
    rows = {}
    for (stack, preset), rs in groups.items():
        row = rows[stack, preset] = {"stack": stack, "preset": preset} | {
            "rounds": len(rs),
            "requests": sum(r["requests"] for r in rs),
            "failed": sum(r["failed"] for r in rs),
            "hit_rate": med([r["hit_rate"] for r in rs]),
        }
        for k in ("p50", "p90", "mean"):
            v = row[f"ttft_ms_{k}"] = med([r[f"ttft_ms_{k}"] for r in rs])
            row[f"ttft_emulated_ms_{k}"] = None if v is None else v / scale
    for row in rows.values():
        rr = rows.get((row["stack"], "round-robin"))
        for k in ("p50", "p90"):
            ok = rr and not row["failed"] and not rr["failed"] and rr[f"ttft_ms_{k}"]
            ok = ok and row[f"ttft_ms_{k}"] is not None
            row[f"vs_rr_{k}"] = round(row[f"ttft_ms_{k}"] / rr[f"ttft_ms_{k}"], 2) if ok else None
    return list(rows.values())


def fmt(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def table(rows: list[dict], scale: float) -> str:
    head = (
        "| stack | preset | requests | failed | hit rate | TTFT p50 ms | p90 ms | mean ms "
        f"| emulated (÷{scale:g}) p50 / p90 / mean ms | p50 vs RR | p90 vs RR |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        emu = " / ".join(fmt(r[f"ttft_emulated_ms_{k}"], 1) for k in ("p50", "p90", "mean"))
        lines.append(
            f"| {r['stack']} | {r['preset']} | {r['requests']} | {r['failed']} "
            f"| {fmt(r['hit_rate'], 3)} | {fmt(r['ttft_ms_p50'])} | {fmt(r['ttft_ms_p90'])} "
            f"| {fmt(r['ttft_ms_mean'])} | {emu} | {fmt(r['vs_rr_p50'], 2)} "
            f"| {fmt(r['vs_rr_p90'], 2)} |"
        )
    return "\n".join(lines)


def failures(runs: list[dict]) -> list[str]:
    lines = [
        f"LEFT OUT: {r['stack']}/{r['preset']} round {r['round']}: GuideLLM sent {r['burst']} "
        f"of {r['requests']} requests at once, not as Poisson arrivals"
        for r in runs
        if r["burst"]
    ]
    return lines + [
        f"FAILED: {r['stack']}/{r['preset']} round {r['round']}: {r['failed']} of "
        f"{r['requests']} requests: {r['errors']}"
        for r in runs
        if r["failed"]
    ]
