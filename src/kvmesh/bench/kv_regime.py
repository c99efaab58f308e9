"""Where a shared-prefix run stands against the engines' KV caches. Cache-aware routing pays
most where the groups' common prefixes together exceed one engine's KV cache but fit the
fleet's (llm-d's prefix-cache benchmarks are set up so): round robin then keeps evicting the
prefixes every engine is sent, while a router that keeps each group on a holder finds them.
Where one engine holds every group, round robin misses only a group's first request on each
engine, and the two differ only in the tail. The benches print this line beside their figures,
from what the engines declare on /metrics (vLLM's `vllm:cache_config_info`)."""

from __future__ import annotations

from kvmesh.protocol.prom import parse_samples

CACHE_INFO = "vllm:cache_config_info"


def cache_tokens(metrics_text: str) -> int | None:
    """Tokens of KV cache one engine's /metrics page declares (num_gpu_blocks x block_size of
    `vllm:cache_config_info`, summed over its series, as data-parallel ranks on one page);
    None when the page has no such series."""
    total, seen = 0, False
    for s in parse_samples(metrics_text, lambda name: name == CACHE_INFO):
        blocks, size = s.labels.get("num_gpu_blocks"), s.labels.get("block_size")
        if blocks and size and blocks.isdigit() and size.isdigit():
            total, seen = total + int(blocks) * int(size), True
    return total if seen else None


def regime(caches: list[int | None], groups: int, prefix_tokens: int) -> dict:
    """The fleet's KV caches (tokens per engine, None where unknown) against `groups` common
    prefixes of `prefix_tokens` each: how many of them one engine, and the fleet, can hold."""
    known = [c for c in caches if c is not None]
    out: dict = {"groups": groups, "prefix_tokens": prefix_tokens, "engines": len(caches)}
    out["prefixes_tokens"] = groups * prefix_tokens
    if not known or len(known) < len(caches) or prefix_tokens <= 0:
        return out | {"kv_tokens_per_engine": None, "kv_tokens_fleet": None, "regime": "unknown"}
    one, fleet = min(known), sum(known)
    out |= {"kv_tokens_per_engine": one, "kv_tokens_fleet": fleet}
    out |= {"groups_one_engine_holds": one // prefix_tokens}
    out |= {"groups_fleet_holds": fleet // prefix_tokens}
    if one >= out["prefixes_tokens"]:
        out["regime"] = "one engine holds every group's prefix"
    elif fleet >= out["prefixes_tokens"]:
        out["regime"] = "the fleet holds every group's prefix, one engine does not"
    else:
        out["regime"] = "the fleet cannot hold every group's prefix"
    return out


def regime_line(r: dict) -> str:
    """One line for a report: the caches, the groups and the regime."""
    groups = f"{r['groups']} groups x {r['prefix_tokens']:,}-token prefix"
    groups += f" = {r['prefixes_tokens']:,} tokens"
    if r["kv_tokens_per_engine"] is None:
        return f"KV cache per engine unknown; {groups}"
    one, fleet = (min(r[k], r["groups"]) for k in ("groups_one_engine_holds", "groups_fleet_holds"))
    return (
        f"KV cache {r['kv_tokens_per_engine']:,} tokens per engine "
        f"({r['kv_tokens_fleet']:,} over {r['engines']}); {groups}: one engine holds "
        f"{one} of the {r['groups']}, the fleet {fleet} ({r['regime']})"
    )
