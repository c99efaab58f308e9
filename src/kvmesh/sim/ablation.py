"""`kvmesh sim --ablation`: the full stack, then each technique off in turn, on the same closed
loop of agents, one run each, in one table, so that what each technique adds shows part by part.

The full stack is the fleet the flags describe: the first of --policies (the router's cache-aware
preset by default), --layout (wide EP), --speculative-config (MTP), the host tier of
--serve-args (--kv-offloading-size), --kv-peer-min-cached-token-delta (peer sharing) and
--prefill-gpus (P/D, with a P/D policy such as the `pd` preset). Each other row turns one of
them off and keeps the rest:

  precise routing   the router's preset -> round-robin (with P/D: round-robin within each pool)
  host tier         --kv-offloading-size dropped (prefixes evicted from HBM are recomputed)
  peer sharing      no pulls from peers (a prefix held elsewhere is recomputed)
  P/D               the same GPUs all serving whole requests; the `pd` preset -> `kvmesh`, the
                    router's aggregated preset (another P/D policy is kept as given)
  wide EP           dpN instances -> TP8 replicas on the same GPUs (and the same split)
  MTP               --speculative-config dropped (one token per sequence per step)

A technique the full stack does not use is listed as not in it, with the flag that adds it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, replace

ROUND_ROBIN = "round-robin"
PD_PRESET, AGGREGATED = "pd", "kvmesh"  # the router's P/D preset and its aggregated one
TP_REPLICA = "tp8"  # what wide EP is compared with: one replica per 8-GPU node
DP_LAYOUT = re.compile(r"^dp\d+$")
# round-robin within each pool: the disagg handler with a round-robin picker per profile
PD_ROUND_ROBIN = """
plugins:
- {type: disagg-profile-handler, parameters: {nonCachedTokens: 0}}
- {type: decode-filter}
- {type: prefill-filter}
- {type: round-robin-picker, name: decode-picker}
- {type: round-robin-picker, name: prefill-picker}
schedulingProfiles:
- {name: decode, plugins: [{pluginRef: decode-filter}, {pluginRef: decode-picker}]}
- {name: prefill, plugins: [{pluginRef: prefill-filter}, {pluginRef: prefill-picker}]}
"""


@dataclass(slots=True, frozen=True)
class Variant:
    """One row of the ablation: a fleet and a policy, or why the row was not run."""

    name: str
    off: str  # the technique turned off ("" for the full stack)
    policy: str
    serve_args: str
    layout: str
    engine_flags: tuple[str, ...]
    skipped: str = ""  # non-empty: not run, and why
    prefill_gpus: int = 0  # P/D: the prefill pool's GPUs (sim.pd)
    peer_delta: int = 0  # peer sharing: --kv-peer-min-cached-token-delta (0: off)


def without_flag(argv: str | tuple[str, ...], flag: str) -> tuple[tuple[str, ...], bool]:
    """`argv` (a command-line string or its words) less every `flag VALUE` and `flag=VALUE`;
    and whether there was one."""
    words = shlex.split(argv) if isinstance(argv, str) else list(argv)
    out: list[str] = []
    found, skip = False, False
    for w in words:
        if skip:
            skip = False
        elif w == flag:
            found, skip = True, True
        elif w.startswith(flag + "="):
            found = True
        else:
            out.append(w)
    return tuple(out), found


def variants(
    policy: str,
    serve_args: str,
    layout: str,
    engine_flags: tuple[str, ...],
    prefill_gpus: int = 0,
    peer_delta: int = 0,
) -> list[Variant]:
    """The full stack first, then one row per technique, in the order of the issue's list."""
    full = Variant("full stack", "", policy, serve_args, layout, engine_flags)
    full = replace(full, prefill_gpus=prefill_gpus, peer_delta=peer_delta)
    rows = [full]

    def off(technique: str, why_absent: str, **changes) -> None:
        if why_absent:
            rows.append(replace(full, name=f"- {technique}", off=technique, skipped=why_absent))
        else:
            rows.append(replace(full, name=f"- {technique}", off=technique, **changes))

    off(
        "precise routing",
        "not in the full stack (--policies starts with round-robin)"
        if policy == ROUND_ROBIN
        else "",
        policy=PD_ROUND_ROBIN if prefill_gpus else ROUND_ROBIN,
    )
    serve_words, tier = without_flag(serve_args, "--kv-offloading-size")
    off(
        "host tier",
        "" if tier else "not in the full stack: add --serve-args '--kv-offloading-size GIB'",
        serve_args=shlex.join(serve_words),
    )
    off(
        "peer sharing",
        "" if peer_delta else "not in the full stack: add --kv-peer-min-cached-token-delta N",
        peer_delta=0,
    )
    off(
        "P/D",
        "" if prefill_gpus else "not in the full stack: add --prefill-gpus G --policies pd",
        prefill_gpus=0,
        policy=AGGREGATED if policy == PD_PRESET else policy,
    )
    wide = bool(DP_LAYOUT.match(layout))
    off(
        "wide EP",
        "" if wide else "not in the full stack: add --layout dpN",
        layout=TP_REPLICA,
    )
    flags, mtp_flag = without_flag(engine_flags, "--speculative-config")
    serve_words, mtp_serve = without_flag(serve_args, "--speculative-config")
    off(
        "MTP",
        "" if mtp_flag or mtp_serve else "not in the full stack: add --speculative-config",
        engine_flags=flags,
        serve_args=shlex.join(serve_words),
    )
    return rows


def prefill_share(
    uncached_input_tokens: int,
    busy_gpu_seconds: float,
    active_params: float,
    peak_flops: float,
    mfu: float,
) -> float:
    """An estimate of the share of busy GPU time spent on prefill: the prompt tokens the fleet
    computed (cache misses), at 2 x active parameters FLOPs each and the GPU's attainable
    FLOP/s (prefill is compute-bound), over the busy GPU-seconds; capped to [0, 1]. The
    attention FLOPs of long contexts are left out, so it errs low (towards cheaper input)."""
    if busy_gpu_seconds <= 0:
        return 0.0
    seconds = uncached_input_tokens * 2 * active_params / (peak_flops * mfu)
    return max(0.0, min(1.0, seconds / busy_gpu_seconds))
