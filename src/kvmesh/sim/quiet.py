"""What the sim's engines skip because no one reads it: Prometheus metrics (the sim's router
reads the schedulers' gauges directly, as a scrape would), the predicted-timing log of
/admin/timing, and output text (the sim's requests have no stop strings and the sim reads token
counts only). Each stand-in takes every call its original takes and does nothing."""

from __future__ import annotations

from kvmesh.engine.core import EngineCore


class _NullMetric:
    """A Prometheus metric that records nothing (observe, inc, set, labels(...).inc()), or
    an EngineMetrics method that does nothing (request_finished, record_tier)."""

    __slots__ = ()

    def observe(self, *args, **kwargs) -> None:
        return None

    inc = set = __call__ = observe  # a call: one of EngineMetrics' recording methods

    def labels(self, *args, **kwargs) -> _NullMetric:
        return self


class _NullMetrics:
    """EngineMetrics that record nothing: every attribute is a null metric and every method
    call does nothing. Attributes are looked up once, then found in the instance dict."""

    def __getattr__(self, name: str) -> _NullMetric:
        setattr(self, name, NULL_METRIC)
        return NULL_METRIC


class _NoText:
    """An IncrementalDetokenizer for a request without stop strings whose text no one reads."""

    __slots__ = ()

    def add(self, token_id: int) -> None:
        return None

    def find_stop(self) -> None:
        return None

    def release(self, final: bool) -> str:
        return ""


NULL_METRIC = _NullMetric()
NO_TEXT = _NoText()


def quieten(core: EngineCore) -> None:
    """Stop the core's metrics and step log; call `no_text` after each add_request."""
    core.metrics = _NullMetrics()
    core.step_observer = None


def no_text(core: EngineCore, request_id: str) -> None:
    """The request's output carries no text (its sampling must have no stop strings)."""
    core.detoks[request_id] = NO_TEXT
