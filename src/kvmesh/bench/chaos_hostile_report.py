"""Pure summaries of `kvmesh bench chaos --hostile`: the normal clients' clean run beside their
hostile run (requests, failures, TTFT percentiles, the p99 ratio against its 20% target), each
hostile class's outcomes, and the soak's targets. No processes, no sockets: tested on canned
records."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from rich.table import Table

from kvmesh.bench.chaos_hostile import HostileRecord
from kvmesh.bench.chaos_report import Result
from kvmesh.protocol.stats import percentile

P99_TARGET = 1.2  # the hostile run's TTFT p99 at most 20% above the clean run's
REFUSED = ("refused", "closed")  # the verdicts a hostile request may end with


def normal_row(name: str, results: list[Result]) -> dict:
    """A run of the normal clients: requests, failed ones (any error, before or after the
    first token), TTFT p50 / p90 / p99 (ms) of those that got a token, the first errors."""
    ttft = [r.ttft_ms for r in results if r.ttft_ms is not None]
    failed = [r for r in results if r.error]
    row: dict = {"run": name, "requests": len(results), "failed": len(failed)}
    for q in (50, 90, 99):
        row[f"ttft_ms_p{q}"] = round(percentile(ttft, q), 1) if ttft else None
    row["errors"] = sorted({r.error[:120] for r in failed})[:4]
    return row


def p99_ratio(clean: dict, hostile: dict) -> dict:
    """The hostile run's TTFT p99 over the clean run's, with the target; no ratio when either
    run had a failed request or no TTFT (failures come first)."""
    failed = clean["failed"] + hostile["failed"]
    a, b = clean["ttft_ms_p99"], hostile["ttft_ms_p99"]
    if failed or not a or b is None or not clean["requests"] or not hostile["requests"]:
        why = f"{failed} normal requests failed" if failed else "a run without TTFT"
        return {"p99_ratio": None, "p99_ok": False, "no_ratio": why}
    ratio = round(b / a, 3)
    return {"p99_ratio": ratio, "p99_ok": ratio <= P99_TARGET, "no_ratio": ""}


def verdict(rec: HostileRecord) -> str:
    """refused: a 4xx (or 505, the status for a request line of an HTTP version other than
    1.x); closed: the server closed without an answer; else what went wrong: 5xx, accepted
    (a 1xx-3xx), timeout (hung past its timeout), reset, garbage or connect."""
    s = rec.status
    if s is not None:
        if 400 <= s < 500 or (s == 505 and rec.variant.startswith("HTTP/")):
            return "refused"
        return "5xx" if s >= 500 else "accepted"
    if rec.end == "close":
        return "closed"
    return rec.end.split(":", 1)[0]


def _outcome(rec: HostileRecord) -> str:
    return str(rec.status) if rec.status is not None else rec.end.split(":", 1)[0]


def class_rows(records: Iterable[HostileRecord]) -> list[dict]:
    """Per hostile class (in order of first send): sent, the statuses seen with counts (close,
    reset, timeout where no status came), the most seconds to answer, how many ended otherwise
    than refused or closed, and how many answers quoted the request's secret."""
    by: dict[str, list[HostileRecord]] = {}
    for r in records:
        by.setdefault(r.cls, []).append(r)
    rows = []
    for cls, recs in by.items():
        seen = Counter(_outcome(r) for r in recs)
        bad = [r for r in recs if verdict(r) not in REFUSED]
        rows.append(
            {
                "class": cls,
                "sent": len(recs),
                "variants": len({r.variant for r in recs}),
                "statuses": dict(sorted(seen.items())),
                "max_s": round(max(r.seconds for r in recs), 3),
                "bad": len(bad),
                "bad_examples": sorted({f"{r.variant}: {_outcome(r)}" for r in bad})[:3],
                "leaked": sum(r.leaked for r in recs),
            }
        )
    return rows


def targets(clean: dict, hostile: dict, classes: list[dict]) -> dict:
    """No normal request failed in either run; the TTFT p99 within 20% (only without
    failures); every hostile request refused or closed in time, none quoting its secret."""
    out: dict = {"normal_failed": clean["failed"] + hostile["failed"]}
    out["normal_failed_ok"] = out["normal_failed"] == 0
    out |= p99_ratio(clean, hostile)
    out["hostile_sent"] = sum(c["sent"] for c in classes)
    out["hostile_bad"] = sum(c["bad"] for c in classes)
    out["hostile_leaked"] = sum(c["leaked"] for c in classes)
    out["hostile_ok"] = out["hostile_sent"] > 0 and not out["hostile_bad"]
    out["hostile_ok"] = out["hostile_ok"] and not out["hostile_leaked"]
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} ms"


def normal_table(clean: dict, hostile: dict, tg: dict, title: str) -> Table:
    t = Table(title=title)
    for col in ("run", "requests", "failed", "TTFT p50", "p90", "p99", "p99 / clean (≤ 1.20)"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for row in (clean, hostile):
        ratio = ""
        if row is hostile:
            ratio = tg["no_ratio"] and f"[red]none: {tg['no_ratio']}[/]"
            if tg["p99_ratio"] is not None:
                ratio = f"{tg['p99_ratio']:.2f}" + (" ok" if tg["p99_ok"] else " [red]over[/]")
        t.add_row(
            row["run"],
            str(row["requests"]),
            f"[red]{row['failed']}[/]" if row["failed"] else "0",
            _ms(row["ttft_ms_p50"]),
            _ms(row["ttft_ms_p90"]),
            _ms(row["ttft_ms_p99"]),
            ratio,
        )
    return t


def hostile_table(classes: list[dict]) -> Table:
    t = Table(title="hostile requests, through the router (each must be refused or closed)")
    for col in ("class", "variants", "sent", "statuses seen", "max to answer", "not refused"):
        t.add_column(col, justify="left" if col in ("class", "statuses seen") else "right")
    for c in classes:
        seen = ", ".join(f"{k} x{v}" for k, v in c["statuses"].items())
        bad = f"[red]{c['bad']}[/] ({'; '.join(c['bad_examples'])})" if c["bad"] else "0"
        bad += f" [red]{c['leaked']} quoted the key[/]" if c["leaked"] else ""
        t.add_row(c["class"], str(c["variants"]), str(c["sent"]), seen, f"{c['max_s']:.2f} s", bad)
    return t
