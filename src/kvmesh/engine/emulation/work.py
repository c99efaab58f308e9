"""What a step computes per request, as the latency models read it, and the drafter passes a
speculating request's drafts took (see kvmesh.engine.emulation.spec)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple


class SequenceWork(NamedTuple):
    num_new_tokens: int  # tokens computed this step (drafts verified included)
    num_context_tokens: int  # tokens already in the cache before this step
    is_prefill: bool = False  # prompt (or recomputed) tokens rather than one decode token
    num_spec_tokens: int = 0  # of num_new_tokens, drafts the step verifies
    num_draft_passes: int = 0  # one-layer drafter passes that made them (0: n-gram lookup)


def draft_passes(works: Sequence[Sequence[SequenceWork]]) -> list[list[list[SequenceWork]]]:
    """Per draft position j, each rank's rows of the drafter's j-th pass: one row for every
    request whose drafts took more than j passes, at the context the draft saw."""
    depth = max((w.num_draft_passes for ws in works for w in ws), default=0)
    return [
        [
            [
                SequenceWork(1, w.num_context_tokens + w.num_new_tokens - w.num_spec_tokens + j)
                for w in ws
                if w.num_draft_passes > j
            ]
            for ws in works
        ]
        for j in range(depth)
    ]


def draft_time(
    forward: Callable[[list[SequenceWork]], float],
    work: Sequence[SequenceWork],
    num_layers: int,
    step_overhead: float,
) -> float:
    """Seconds of the drafter's passes over one batch (one average layer of `forward` each)."""
    total = 0.0
    for (rows,) in draft_passes([work]):
        total += max(0.0, forward(rows) - step_overhead) / num_layers
    return total
