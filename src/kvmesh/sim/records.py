"""What `kvmesh sim` replays and what it records: a request (its arrival, prompt as runs of
token ids, output length and the turns it waits for) and how it went."""

from __future__ import annotations

from dataclasses import dataclass


def run_tokens(runs: tuple[tuple[int, int], ...], into: list[int] | None = None) -> list[int]:
    """The token ids of `runs` of (first id, count), appended to `into` (a new list if None)."""
    out = [] if into is None else into
    for first, n in runs:
        out.extend(range(first, first + n))
    return out


@dataclass(slots=True)
class SimRequest:
    """One request of the replay: its arrival (virtual s), prompt and output length. The prompt
    is runs of consecutive token ids, (first id, count), so that a trace of 12k requests of 12k
    tokens holds kilobytes until a request arrives, not gigabytes."""

    rid: int
    at: float
    prompt: tuple[tuple[int, int], ...]
    max_tokens: int
    session: str = ""  # x-session-id
    deps: tuple[int, ...] = ()  # rids that must finish first (a session's previous turn)
    delay: float = 0.0  # think / tool time after the deps finish, virtual s

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prompt)

    def token_ids(self) -> list[int]:
        return run_tokens(self.prompt)


@dataclass(slots=True)
class SimRecord:
    """How one request went: where it ran, what hit, when its tokens came (virtual s)."""

    rid: int
    engine: int
    arrival: float
    prompt_tokens: int
    cached_tokens: int = 0
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    best_known_tokens: int = 0  # the longest prefix the router knew on any engine at arrival
    chosen_known_tokens: int = 0  # ... and on the engine it chose
    # the engine answered 400: prompt + max_tokens past its context (its KV cache, at most);
    # finished at arrival with no tokens
    refused: bool = False

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival
