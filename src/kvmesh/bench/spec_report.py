"""Figures of `kvmesh bench spec`: per-user rates of one streamed request, medians per arm x
workload x batch, ratios against speculation off, acceptance from vLLM's spec-decode counters,
the greedy-equality check, and the table, JSON rows and chart made of them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from kvmesh.protocol.prom import parse_samples

BASELINE = "off"
TARGETS = {"edit": 2.0, "chat": 0.95}  # tok/s per user vs off, per workload (issue 19)
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(slots=True)
class ChatResult:
    """One streamed chat completion. Times are perf_counter seconds since the request was sent;
    `first` and `last` are the arrivals of the first and last chunk that carried text (one chunk
    may carry several tokens when drafts are accepted)."""

    index: int
    tokens: int = 0  # usage.completion_tokens
    first: float = 0.0
    last: float = 0.0
    chunks: int = 0
    text: str = ""
    finish_reason: str = ""
    error: str = ""


def user_rates(first: float, last: float, tokens: int) -> tuple[float | None, float | None]:
    """(ITL per token in s, output tok/s per user) of one request: the decode span between the
    first and the last text chunk over the tokens after the first. None when undefined (fewer
    than two tokens, or every token in one chunk)."""
    span = last - first
    if tokens < 2 or span <= 0:
        return None, None
    return span / (tokens - 1), (tokens - 1) / span


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def summarize(results: list[ChatResult]) -> dict:
    """Medians over the requests of one arm x workload x batch run, and each request's figures."""
    rows, tok_s, itl, ttft = [], [], [], []
    for r in results:
        i, t = user_rates(r.first, r.last, r.tokens)
        rows.append(
            {
                "index": r.index,
                "tokens": r.tokens,
                "chunks": r.chunks,
                "ttft_ms": _r(r.first * 1000),
                "itl_ms": _r(None if i is None else i * 1000),
                "tok_s": _r(t),
                "finish_reason": r.finish_reason,
                "text": r.text,
            }
        )
        ttft.append(r.first * 1000)
        if i is not None and t is not None:
            itl.append(i * 1000)
            tok_s.append(t)
    tokens, chunks = sum(r.tokens for r in results), sum(r.chunks for r in results)
    return {
        "requests": len(results),
        "output_tokens": tokens,
        "tok_s_user_p50": _r(_median(tok_s)),
        "itl_ms_p50": _r(_median(itl)),
        "ttft_ms_p50": _r(_median(ttft)),
        "tokens_per_chunk": _r(tokens / chunks if chunks else None),
        "per_request": rows,
    }


def spec_counters(text: str) -> dict:
    """The spec-decode counters of a /metrics page, summed over series; per_pos by position."""
    names = {v: k for k, v in SPEC_COUNTERS.items()}
    out: dict = dict.fromkeys(SPEC_COUNTERS, 0.0) | {"per_pos": {}}
    for s in parse_samples(text, lambda n: n in names or n == PER_POS):
        if s.name == PER_POS:
            pos = int(s.labels.get("position", "0"))
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + s.value
        else:
            out[names[s.name]] += s.value
    return out


def acceptance(before: dict, after: dict) -> dict:
    """vLLM's derived figures over the counters' growth: acceptance rate = accepted / draft
    tokens; mean acceptance length = 1 + accepted / drafts; per position = accepted / drafts."""
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    drafts = d["drafts"]
    positions = sorted(after["per_pos"])
    per_pos = [after["per_pos"][p] - before["per_pos"].get(p, 0.0) for p in positions]
    return {
        **{k: int(v) for k, v in d.items()},
        "acceptance_rate": _r(d["accepted_tokens"] / d["draft_tokens"], 4)
        if d["draft_tokens"]
        else None,
        "mean_acceptance_length": _r(1 + d["accepted_tokens"] / drafts, 3) if drafts else None,
        "per_position_rate": [round(a / drafts, 4) for a in per_pos] if drafts else [],
    }


def first_diff(a: str, b: str) -> int:
    """Index of the first differing character (the shorter length when one is a prefix)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def greedy_check(arms: dict) -> dict:
    """Every request's text in every speculating arm against the same request with speculation
    off (same workload, batch and index)."""
    base = arms.get(BASELINE, {})
    checked, mismatches = 0, []
    for arm, data in arms.items():
        if arm == BASELINE or data.get("status") != "ok" or base.get("status") != "ok":
            continue
        for wl, by_batch in data["runs"].items():
            for b, run in by_batch.items():
                ref = {r["index"]: r for r in base["runs"][wl][b]["per_request"]}
                for r in run["per_request"]:
                    checked += 1
                    want = ref[r["index"]]
                    if r["text"] == want["text"] and r["tokens"] == want["tokens"]:
                        continue
                    at = first_diff(r["text"], want["text"])
                    where = {"arm": arm, "workload": wl, "batch": int(b), "index": r["index"]}
                    mismatches.append(
                        where
                        | {
                            "first_diff_char": at,
                            "tokens": r["tokens"],
                            "off_tokens": want["tokens"],
                        }
                        | {"off": want["text"][max(0, at - 40) : at + 40]}
                        | {"spec": r["text"][max(0, at - 40) : at + 40]}
                    )
    return {"checked": checked, "mismatches": mismatches, "ok": checked > 0 and not mismatches}


def rows(arms: dict) -> list[dict]:
    """One row per arm x workload x batch, with the ratio of tok/s per user to off's."""
    out = []
    base = arms.get(BASELINE, {})
    for arm, data in arms.items():
        if data.get("status") != "ok":
            out.append({"arm": arm, "status": "failed", "reason": data.get("reason", "")})
            continue
        for wl, by_batch in data["runs"].items():
            for b, run in by_batch.items():
                ref = (
                    base.get("runs", {}).get(wl, {}).get(b) if base.get("status") == "ok" else None
                )
                ratio = None
                if ref and ref["tok_s_user_p50"] and run["tok_s_user_p50"]:
                    ratio = round(run["tok_s_user_p50"] / ref["tok_s_user_p50"], 3)
                acc = run.get("acceptance") or {}
                out.append(
                    {"arm": arm, "workload": wl, "batch": int(b), "status": "ok"}
                    | {k: run[k] for k in ("tok_s_user_p50", "itl_ms_p50", "ttft_ms_p50")}
                    | {"tokens_per_chunk": run["tokens_per_chunk"], "ratio_vs_off": ratio}
                    | {"acceptance_rate": acc.get("acceptance_rate")}
                    | {"mean_acceptance_length": acc.get("mean_acceptance_length")}
                )
    return out


def targets(table_rows: list[dict]) -> list[dict]:
    """Issue 19's targets per speculating arm x workload x batch (shown, not enforced)."""
    out = []
    for r in table_rows:
        if r["status"] != "ok" or r["arm"] == BASELINE or r["workload"] not in TARGETS:
            continue
        goal = TARGETS[r["workload"]]
        name = f"{r['arm']} {r['workload']} batch {r['batch']}: tok/s per user >= {goal}x off"
        met = r["ratio_vs_off"] is not None and r["ratio_vs_off"] >= goal
        out.append({"name": name, "value": r["ratio_vs_off"], "met": met})
    return out


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(console: Console, results: dict) -> None:
    table = Table(title="kvmesh bench spec: per user, medians over requests")
    for col in ("arm", "workload", "batch", "tok/s/user", "ITL ms", "TTFT ms", "vs off"):
        table.add_column(col, justify="left" if col in ("arm", "workload") else "right")
    for col in ("tok/chunk", "accept", "accept len"):
        table.add_column(col, justify="right")
    for r in results["rows"]:
        if r["status"] != "ok":
            table.add_row(r["arm"], "[red]failed[/red]", "", "", "", "", "", "", "", "")
            continue
        ratio = r["ratio_vs_off"]
        goal = TARGETS.get(r["workload"])
        mark = (
            ""
            if r["arm"] == BASELINE or ratio is None or goal is None
            else ("[green]" if ratio >= goal else "[red]")
        )
        table.add_row(
            r["arm"],
            r["workload"],
            str(r["batch"]),
            _fmt(r["tok_s_user_p50"]),
            _fmt(r["itl_ms_p50"]),
            _fmt(r["ttft_ms_p50"], ".0f"),
            f"{mark}{_fmt(ratio, '.2f')}x" if ratio is not None else "-",
            _fmt(r["tokens_per_chunk"], ".2f"),
            _fmt(r["acceptance_rate"], ".2f"),
            _fmt(r["mean_acceptance_length"], ".2f"),
        )
    console.print(table)
    for r in results["rows"]:
        if r["status"] != "ok":
            console.print(f"[red]arm {r['arm']} failed:[/red] {r['reason'][-1500:]}")
    g = results["greedy_match"]
    if g["mismatches"]:
        console.print(
            f"[bold red]GREEDY OUTPUTS DIFFER from off: {len(g['mismatches'])} of "
            f"{g['checked']} requests[/bold red]"
        )
        for m in g["mismatches"][:10]:
            console.print(
                f"  [red]{m['arm']} {m['workload']} batch {m['batch']} #{m['index']} "
                f"at char {m['first_diff_char']}[/red]: off={m['off']!r} "
                f"spec={m['spec']!r}"
            )
    elif g["checked"]:
        console.print(f"[green]greedy outputs identical to off: {g['checked']} requests[/green]")
    else:
        console.print("[yellow]greedy outputs not compared (needs off and another arm)[/yellow]")


def print_rows(console: Console, title: str, table_rows: list[dict]) -> None:
    """Any list of row dicts as a table; a nested dict's keys become `outer.inner` columns."""
    flat = [
        {
            f"{k}.{k2}" if isinstance(v, dict) else k: v2
            for k, v in r.items()
            for k2, v2 in (v.items() if isinstance(v, dict) else [(k, v)])
        }
        for r in table_rows
    ]
    columns = list(dict.fromkeys(c for r in flat for c in r))
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for r in flat:
        table.add_row(*(str(r.get(c, "")) for c in columns))
    console.print(table)


def write_plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results["rows"] if r["status"] == "ok"]
    workloads = sorted({r["workload"] for r in ok}, key=["edit", "chat"].index)
    arms = list(dict.fromkeys(r["arm"] for r in ok))
    batches = sorted({r["batch"] for r in ok})
    if not workloads:
        return
    fig, axes = plt.subplots(1, max(1, len(workloads)), figsize=(5 * max(1, len(workloads)), 4))
    axes = list(axes) if len(workloads) > 1 else [axes]
    width = 0.8 / max(1, len(arms))
    for ax, wl in zip(axes, workloads, strict=True):
        for a, arm in enumerate(arms):
            vals = [
                next(
                    (
                        r["tok_s_user_p50"] or 0
                        for r in ok
                        if (r["arm"], r["workload"], r["batch"]) == (arm, wl, b)
                    ),
                    0,
                )
                for b in batches
            ]
            ax.bar([i + a * width for i in range(len(batches))], vals, width, label=arm)
        ax.set_xticks([i + width * (len(arms) - 1) / 2 for i in range(len(batches))])
        ax.set_xticklabels([f"batch {b}" for b in batches])
        ax.set_title(f"{wl}: output tok/s per user (median)")
        ax.set_ylabel("tok/s per user")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
