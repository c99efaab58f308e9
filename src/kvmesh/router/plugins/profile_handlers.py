"""Profile handlers: which scheduling profiles run for a request, in what order, and what their
picks mean (one endpoint; or, under P/D, a decode endpoint and maybe a prefill endpoint)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kvmesh.router.plugins.base import Plugin, SchedulingRequest
from kvmesh.router.plugins.state import SchedulingResult

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint


class Runner(Protocol):
    """What a handler asks of the pipeline (router.pipeline.Pipeline)."""

    def run_profile(self, profile: Any, req: SchedulingRequest, endpoints: list[Endpoint]): ...


class SingleProfileHandler(Plugin):
    """Runs the only profile (or the one named `default`)."""

    __slots__ = ("name", "profile")

    def __init__(self, name: str, profiles: dict[str, Any]) -> None:
        self.name = name
        self.profile = profiles.get("default") or next(iter(profiles.values()))

    def run(
        self, pipeline: Runner, req: SchedulingRequest, endpoints: list[Endpoint]
    ) -> SchedulingResult:
        result = pipeline.run_profile(self.profile, req, endpoints)
        return SchedulingResult(result.endpoint, req.state.profiles)


class DisaggProfileHandler(Plugin):
    """llm-d's decode-first P/D: pick the decode endpoint, then run the prefill profile only
    when the prompt tokens it lacks (SchedulingState.uncached_tokens) reach `nonCachedTokens`
    (0: always)."""

    reads_tokens = True
    reads_precise_index = True
    reads_approximate_index = True
    __slots__ = ("name", "decode", "prefill", "threshold")

    def __init__(self, name: str, decode: Any, prefill: Any | None, threshold: int) -> None:
        self.name, self.decode, self.prefill, self.threshold = name, decode, prefill, threshold

    def run(
        self, pipeline: Runner, req: SchedulingRequest, endpoints: list[Endpoint]
    ) -> SchedulingResult:
        d = pipeline.run_profile(self.decode, req, endpoints).endpoint
        state = req.state
        if d is None or self.prefill is None:
            return SchedulingResult(d, state.profiles)
        if state.uncached_tokens(d.name) < max(self.threshold, 1):
            return SchedulingResult(d, state.profiles)
        p = pipeline.run_profile(self.prefill, req, [e for e in endpoints if e is not d])
        return SchedulingResult(d, state.profiles, p.endpoint)
