"""Speculative decoding in emulated engines: a drafter, the target's verification, its cost.

A step verifies each drafting request's k drafts with its next token, k + 1 query rows priced
by the latency model like any other rows. What the target accepts:

- mtp / eagle / eagle3 / draft_model: an emulated drafter proposes k placeholder tokens, and the
  runner accepts a prefix of them position by position with the configured conditional
  acceptance rates (the chance draft j is accepted given drafts 0..j-1 were), drawn from a
  seeded RNG per engine. Expected tokens per step: 1 + a1 + a1 a2 + ... + a1 ... ak.
- ngram: real prompt lookup over the request's tokens, and a draft is accepted when it equals
  what the emulated output stream yields at its position. That stream is a fixed filler text
  repeated from an offset set by the prompt, so lookup hits once the output repeats itself
  (after one pass through the filler) or when the prompt already holds the filler at the same
  offset (a later turn that resends an earlier answer); elsewhere it drafts nothing or misses.

Accepted drafts are replaced by the filler stream's tokens at their positions, so the text is
the text without speculation. The drafter's own cost (MTP / EAGLE: one decoder layer per draft
position): each draft position is one pass of one average layer of the target (the whole
step's time less the fixed overhead, over num_layers) over one row per drafting request; a
draft model is priced the same way. It is charged in the step that verifies the drafts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from kvmesh.engine.emulation.config import (  # noqa: F401 - settings, also this module's API
    DEFAULT_ACCEPTANCE,
    parse_acceptance,
)
from kvmesh.engine.sequence import Request
from kvmesh.engine.spec.speculator import Proposer

MODEL_DRAFTERS = ("mtp", "eagle", "eagle3", "draft_model")


def expected_tokens_per_step(rates: Sequence[float], k: int) -> float:
    """1 + sum over j < k of the chance that drafts 0..j are all accepted."""
    total, alive = 1.0, 1.0
    for j in range(k):
        alive *= rates[min(j, len(rates) - 1)]
        total += alive
    return total


class EmulatedDrafter(Proposer):
    """MTP / EAGLE / draft model without weights: k placeholder drafts per request, the output
    stream's next tokens (the runner's acceptance decides what they were worth)."""

    def __init__(self, stream: Callable[[Request, int, int], list[int]]) -> None:
        # (request, first output index, count) -> the emulated output tokens there
        self.stream = stream

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        stream = self.stream
        return [
            stream(r, len(r.output_token_ids), limit)
            for r, limit in zip(requests, limits, strict=True)
        ]


class Acceptance:
    """What the target accepts of a request's drafts (see the module's docstring)."""

    def __init__(self, method: str, rates: Sequence[float], seed: object = 0) -> None:
        self.method = method
        self.rates = tuple(rates) or DEFAULT_ACCEPTANCE
        self.rng = random.Random(str(seed))

    def num_accepted(self, drafts: Sequence[int], stream: Callable[[int], int]) -> int:
        """Accepted prefix length; stream(j) is the output token at draft position j."""
        if self.method == "ngram":
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == stream(accepted):
                accepted += 1
            return accepted
        return self.num_drawn(len(drafts))

    def num_drawn(self, num_drafts: int) -> int:
        """A model drafter's accepted prefix of num_drafts drafts: position by position, one
        draw each until the first rejection."""
        rates, draw = self.rates, self.rng.random
        last = len(rates) - 1
        accepted = 0
        while accepted < num_drafts:
            if draw() >= rates[accepted if accepted < last else last]:
                break
            accepted += 1
        return accepted
