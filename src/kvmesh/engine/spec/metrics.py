"""Speculative-decoding counters under vLLM's names, and the figures its log line reports.

A "draft" is one request's proposal in one step (0..k tokens); per step the runner records,
for each request that drafted, how many tokens it proposed and how many the target accepted.
Position p of `num_accepted_tokens_per_pos` counts drafts whose first p + 1 tokens were all
accepted, so it never increases with p. Derived figures, as vLLM defines them:
acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter


class SpecDecodingSummary(NamedTuple):
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float  # accepted / draft tokens; 0 before any draft
    mean_acceptance_length: float  # tokens per target pass per drafting request: 1 + a / drafts
    per_position_acceptance_rate: list[float]  # accepted at position p / drafts


@dataclass(slots=True)
class SpecDecodingStats:
    """Running totals; `observe` once per drafting request per step."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_speculative_tokens:
            raise ValueError(
                f"need 0 <= accepted ({num_accepted_tokens}) <= drafted ({num_draft_tokens}) "
                f"<= num_speculative_tokens ({self.num_speculative_tokens})"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for p in range(num_accepted_tokens):
            self.accepted_per_pos[p] += 1

    def summary(self) -> SpecDecodingSummary:
        d = self.num_drafts
        return SpecDecodingSummary(
            num_drafts=d,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            acceptance_rate=self.num_accepted_tokens / self.num_draft_tokens
            if self.num_draft_tokens
            else 0.0,
            mean_acceptance_length=1.0 + self.num_accepted_tokens / d if d else 1.0,
            per_position_acceptance_rate=[a / d if d else 0.0 for a in self.accepted_per_pos],
        )


class SpecDecodingProm:
    """The four counters, registered on an engine's registry with its labels (model_name,
    engine); `record` adds one step's drafts. prometheus_client appends `_total`."""

    def __init__(
        self, registry: CollectorRegistry, labels: dict[str, str], num_speculative_tokens: int
    ) -> None:
        names = list(labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**labels)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            names + ["position"],
            registry=registry,
        )
        self.accepted_per_pos = [
            per_pos.labels(**labels, position=str(p)) for p in range(num_speculative_tokens)
        ]
        self.stats = SpecDecodingStats(num_speculative_tokens)

    def record(self, drafts: Iterable[tuple[int, int]]) -> None:
        """(num_draft_tokens, num_accepted_tokens) per drafting request of one step."""
        for drafted, accepted in drafts:
            self.stats.observe(drafted, accepted)  # validates before anything is exported
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
            self.num_accepted_tokens.inc(accepted)
            for p in range(accepted):
                self.accepted_per_pos[p].inc()
