"""What the latency model predicts each request should have seen, to judge timing fidelity.

A request's predicted TTFT is the predicted time of every step from its arrival to its first
token (the remainder of the step in flight when it arrived included); each later token's
predicted inter-token latency is the predicted time of the step that produced it. All figures are
in emulated seconds: with a time scale K, wall time on this host is K times longer.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PredictedTiming:
    ttft_sum: float = 0.0
    ttft_count: int = 0
    itl_sum: float = 0.0
    itl_count: int = 0
    steps: int = 0
    predicted_step_sum: float = 0.0
    time_scale: float = 1.0  # wall seconds per emulated second
    timeline_restarts: object = None  # () -> how often the engine fell behind its timeline
    _elapsed: dict[str, float] = field(default_factory=dict)
    _last_step_end: float = 0.0

    def observe(self, scheduler, step_start: float, step_time: float, progressed) -> None:
        self.steps += 1
        self.predicted_step_sum += step_time
        live = scheduler.requests
        for rid in [r for r in self._elapsed if r not in live]:
            del self._elapsed[rid]
        for rid, request in live.items():
            if rid not in self._elapsed:  # first seen: it waited out the step in flight
                waited = (self._last_step_end - request.arrival_time) / self.time_scale
                self._elapsed[rid] = max(0.0, waited)
            self._elapsed[rid] += step_time
        for request, num_new in progressed:  # a step emits several tokens with speculation
            if request.num_output_tokens == 1:
                self.ttft_sum += self._elapsed.get(request.request_id, step_time)
                self.ttft_count += 1
            else:
                self.itl_sum += step_time
                self.itl_count += num_new
        self._last_step_end = step_start + step_time * self.time_scale  # wall clock

    def summary(self) -> dict:
        return {
            "time_scale": self.time_scale,
            "timeline_restarts": self.timeline_restarts() if self.timeline_restarts else 0,
            "steps": self.steps,
            "predicted_step_s_sum": self.predicted_step_sum,
            "predicted_ttft_s_sum": self.ttft_sum,
            "ttft_count": self.ttft_count,
            "predicted_itl_s_sum": self.itl_sum,
            "itl_count": self.itl_count,
            "predicted_ttft_s_mean": self.ttft_sum / self.ttft_count if self.ttft_count else None,
            "predicted_itl_s_mean": self.itl_sum / self.itl_count if self.itl_count else None,
        }
