"""Speculator: after each step, who drafts for the next one and how many tokens, and what the
target accepted of the last drafts (vLLM's spec_decode counters).

A request drafts only when its next step samples (its prompt is computed), its sampling has
no blocked tokens left (min_tokens met), speculation is on for the batch size
(disable_by_batch_size), and at most as many drafts as max_tokens and max_model_len leave room
for after the target's own next token. Drafts live in `request.spec_token_ids` until the
scheduler takes them; the runner verifies them.
"""

from __future__ import annotations

import abc

from kvmesh.engine.scheduler import Scheduler, SchedulerOutput
from kvmesh.engine.sequence import Request, RequestStatus
from kvmesh.engine.spec.config import SpeculativeConfig
from kvmesh.engine.spec.metrics import SpecDecodingProm
from kvmesh.engine.spec.ngram import NgramProposer


class Proposer(abc.ABC):
    """What proposes draft tokens: prompt lookup, an MTP head, an emulated drafter."""

    @abc.abstractmethod
    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """Drafts per request, at most limits[i] tokens each (limits are >= 1)."""

    def forget(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """Drop per-request state."""

    def observe_step(self, out: SchedulerOutput) -> None:  # noqa: B027 - optional hook
        """Every step, once its verified tokens are appended and before any propose(): a
        drafter with its own KV (MTP) writes the rows of every scheduled request here."""


class PromptLookupProposer(Proposer):
    """n-gram drafting over each request's verified tokens (spec.ngram)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram = NgramProposer.from_config(config)

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        return [
            self.ngram.propose(r.request_id, r.all_token_ids, limit)
            for r, limit in zip(requests, limits, strict=True)
        ]

    def forget(self, request_id: str) -> None:
        self.ngram.forget(request_id)


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        max_model_len: int,
        metrics: SpecDecodingProm | None = None,
    ) -> None:
        assert config.num_speculative_tokens is not None, "resolve() the config first"
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.metrics = metrics

    def limit(self, request: Request) -> int:
        """How many drafts the request may carry into its next step."""
        p = request.sampling
        if request.num_output_tokens < p.min_tokens:  # blocked ids: the sampler's own path
            return 0
        room_outputs = p.max_tokens - request.num_output_tokens - 1
        room_positions = self.max_model_len - request.num_tokens - 1
        return max(0, min(self.k, room_outputs, room_positions))

    def propose(self, scheduler: Scheduler, out: SchedulerOutput, sampled: list[Request]) -> None:
        """Draft for every request whose step sampled (gained tokens) and that runs on."""
        self.proposer.observe_step(out)
        if not self.config.use_speculation(scheduler.num_running):
            return
        requests, limits = [], []
        for request in sampled:
            if request.status != RequestStatus.RUNNING:
                continue
            limit = self.limit(request)
            if limit > 0:
                requests.append(request)
                limits.append(limit)
        if not requests:
            return
        for request, drafts, limit in zip(
            requests, self.proposer.propose(requests, limits), limits, strict=True
        ):
            assert len(drafts) <= limit  # a proposer never passes its limit
            request.spec_token_ids = list(drafts)

    def record(self, out: SchedulerOutput, sampled: dict) -> None:
        """(drafted, accepted) of every request that carried drafts into this step."""
        if self.metrics is None:
            return
        drafts = []
        for item in out.scheduled:
            new = sampled.get(item.request.request_id)
            if item.spec_token_ids and new is not None:
                drafts.append((len(item.spec_token_ids), len(new[0]) - 1))
        if drafts:
            self.metrics.record(drafts)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
