"""Request state and sampling parameters: the unit the scheduler and block pool work on."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1  # its prefix is being loaded from a lower tier (kv_loads)
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per output token (0: sampled only)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def validate(self, max_logprobs: int = 20) -> None:
        """Raises ValueError with a client-facing message for invalid values."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens].")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise ValueError(f"logprobs must be in [0, {max_logprobs}], got {self.logprobs}.")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until scheduled
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    hold_for_remote: bool = False  # P/D prefill: keep the blocks for a decode engine to read
    kv_transfer_params: dict | None = None  # what the response returns (prefill side)
    # speculative decoding: tokens proposed for the next step, never in all_token_ids until
    # the target verifies them; dropped on preemption
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_tokens(
        self, token_ids: list[int], logprobs: list[list[tuple[int, float]]] | None
    ) -> None:
        """Append one step's sampled tokens and, when given, their logprobs (one per token)."""
        self.output_token_ids += token_ids
        self.all_token_ids += token_ids
        if logprobs:
            self.output_logprobs += [lp for lp in logprobs[: len(token_ids)] if lp is not None]

    def sort_key(self) -> tuple[int, float]:
        """Scheduling order under the priority policy: lower value runs earlier."""
        return (self.priority, self.arrival_time)
