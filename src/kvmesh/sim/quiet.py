"""What the sim's engines skip because no one reads it: Prometheus metrics (the sim's router
reads the schedulers' gauges directly, as a scrape would), the predicted-timing log of
/admin/timing, and output text (the sim's requests have no stop strings and the sim reads token
counts only). The core skips its own metric bookkeeping (`EngineCore.log_stats`) and the
detokenizer of a request without text (a None detokenizer: its only stop is the length limit);
the null metrics take every call that is still made and do nothing."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

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


NULL_METRIC = _NullMetric()


def quieten(core: EngineCore) -> None:
    """Stop the core's metrics and step log; call `no_text` after each add_request."""
    core.log_stats = False  # the core skips its metric bookkeeping
    core.metrics = _NullMetrics()  # and what it still records goes nowhere
    core.step_observer = None


def no_text(core: EngineCore, request_id: str) -> None:
    """The request's output carries no text (its sampling must have no stop strings)."""
    core.detoks[request_id] = None


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Build and run a fleet with the cyclic collector off. A fleet's run makes no garbage in
    reference cycles (tests/test_sim_collector.py holds it to that), so reference counting
    frees all the collector would; its walks over the young objects visit every element of
    every prompt's token list, ~10-25% of a large run's wall time, and the build's millions of
    blocks set off full collections over all of them.

    A fleet is itself cyclic, so it is collected once dropped: on entry, one collection frees
    the fleets of earlier runs (an ablation runs several in one process). On exit what exists
    is frozen out of collection before the collector comes back on (if it was on), so the
    first collection after a run does not walk the whole fleet while it is still in use; the
    next entry unfreezes it."""
    was_on = gc.isenabled()
    gc.unfreeze()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()
