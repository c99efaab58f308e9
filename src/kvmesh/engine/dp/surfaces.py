"""The front door's merged views of its ranks: one /metrics page, one /kv_event_sources map."""

from __future__ import annotations


def merge_metrics(pages: list[str]) -> str:
    """Prometheus text pages of several ranks as one page: each family once (its # HELP and
    # TYPE from the first rank that has it), then every rank's samples of it, in rank order.
    Ranks label their series engine="<rank>", so samples differ; a line two ranks share
    exactly (an info gauge without the label) is kept once."""
    order: list[str] = []
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    seen: set[str] = set()
    for page in pages:
        family = ""
        for line in page.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split(" ", 3)[2]
                if family not in heads:
                    order.append(family)
                    heads[family], samples[family] = [], []
                kind = line[:7]
                if not any(h.startswith(kind) for h in heads[family]):
                    heads[family].append(line)
            elif line and not line.startswith("#") and line not in seen:
                seen.add(line)
                if family not in samples:  # samples before any header
                    order.append(family)
                    heads[family], samples[family] = [], []
                samples[family].append(line)
    lines = [line for family in order for line in heads[family] + samples[family]]
    return "\n".join(lines) + "\n" if lines else ""


def merge_event_sources(answers: list[dict]) -> dict:
    """Each rank's /kv_event_sources ({rank: its publisher}) as one map over all ranks."""
    merged: dict = {}
    for answer in answers:
        merged.update(answer)
    return dict(sorted(merged.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else -1))
