"""What a plan is asked for: the agents and their workload, the service levels and the money.

A workload preset is a set of parameters of the agentic session generator
(kvmesh.bench.workloads.agentic), the shape `kvmesh sim --agents` runs: `agentic` is its
defaults (120-token answers), `seed` the reference fleet's (1,000-token answers)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from kvmesh.bench.workloads import agentic

WORKLOAD_PRESETS: dict[str, dict] = {
    "agentic": {},
    "seed": {"answer_tokens": 1000},
}


@dataclass(slots=True, frozen=True)
class Targets:
    """Service levels every plan must meet, and the limits of the search."""

    agents: int
    ttft_p90_s: float  # 90th percentile time to first token
    user_tok_s: float  # median per-user decode speed (tokens/s after the first)
    budget_usd_per_hour: float = 0.0  # 0: no budget
    max_gpus: int = 64

    def __post_init__(self) -> None:
        if self.agents < 1:
            raise ValueError("--agents must be at least 1")
        if not (self.ttft_p90_s > 0 and self.user_tok_s > 0):
            raise ValueError("--ttft-p90 and --user-tok-s must be positive")
        if self.budget_usd_per_hour < 0:
            raise ValueError("--budget must not be negative")
        if self.max_gpus < 1:
            raise ValueError("--max-gpus must be at least 1")


@dataclass(slots=True, frozen=True)
class Workload:
    """A preset's generator parameters (the generator's defaults filled in)."""

    name: str
    params: dict = field(default_factory=dict)

    @classmethod
    def preset(cls, name: str) -> Workload:
        if name not in WORKLOAD_PRESETS:
            raise ValueError(f"--workload must be one of {sorted(WORKLOAD_PRESETS)}, got {name!r}")
        defaults = {
            k: p.default
            for k, p in inspect.signature(agentic).parameters.items()
            if k not in ("seed", "sessions", "session_rate")
        }
        return cls(name, {**defaults, **WORKLOAD_PRESETS[name]})

    @property
    def answer_tokens(self) -> int:
        return int(self.params["answer_tokens"])

    @property
    def think_s(self) -> float:
        return float(self.params["think_s"])

    def mean_context_tokens(self) -> int:
        """The context a decoding turn reads, on average over a session's turns: the shared
        prefix, repository and task, and half the answers and tool outputs a session adds."""
        p = self.params
        base = p["system_tokens"] + p["tool_def_tokens"] + p["repo_tokens"] + p["task_tokens"]
        per_turn = p["answer_tokens"] + p["tool_tokens"]
        return int(base + (p["turns"] - 1) / 2 * per_turn + p["answer_tokens"] / 2)

    def working_set_tokens(self, agents: int) -> int:
        """KV tokens the agents can reuse: the shared prefixes and repositories, and each
        agent's context at its longest times its requests in flight (one, and a fan-out's
        sub-agents at the turns that fan out); a finished session's own context is never asked
        for again."""
        p = self.params
        shared = p["system_tokens"] + p["tool_def_tokens"] + p["repos"] * p["repo_tokens"]
        longest = (
            p["system_tokens"] + p["tool_def_tokens"] + p["repo_tokens"] + p["task_tokens"]
            + p["turns"] * (p["answer_tokens"] + p["tool_tokens"])
            + p["fanout"] * p["return_tokens"]
        )  # fmt: skip
        in_flight = 1 + p["fanout_rate"] * max(0, p["fanout"])
        return int(shared + agents * in_flight * longest)

    def decode_demand_tok_s(self, targets: Targets) -> float:
        """Output tokens/s the agents ask for when each request waits the whole TTFT target
        and decodes at exactly the target speed: a lower bound of a fleet that meets both
        (faster service and sub-agent fan-outs only raise it)."""
        answer = self.answer_tokens
        turn_s = self.think_s + targets.ttft_p90_s + answer / targets.user_tok_s
        return targets.agents * answer / turn_s
