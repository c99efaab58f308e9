"""A forward's bookkeeping: what the router (router.handlers, router.pd) and the simulator
(sim.fleet) both do when a scheduled request is sent to an endpoint, when that endpoint has
computed its prompt, and when its answer ends.

Sent: the endpoint has one more request in flight, the prompt's tokens in flight, and the
prompt tokens it lacks (SchedulingState.uncached_tokens) as pending prefill; the approximate
index records that the endpoint now holds the prompt's blocks (llm-d records at PreRequest,
before any answer). Prefilled (first token; a prefill leg's whole answer): the pending prefill
drops, once. Finished (answer ended, failed or abandoned): the rest is released, once.

A pick that carries a probe for this endpoint (state.probe: a scorer that learns time to first
token, plugins.latency) is started when sent and reported when prefilled, with the time between
on the caller's clock (`now`: the simulator's virtual one; else time.monotonic()); a forward
that finishes without its first token drops it, unreported.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import monotonic
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint
    from kvmesh.router.plugins import SchedulingRequest


@dataclass(slots=True)
class Load:
    """What one forward added to its endpoint's counters, until released.
    Invariant: `prefill` is still counted iff not `prefilled`; all of it iff not `finished`;
    `probe`, when set, is started on its model and not yet reported or dropped iff not
    `prefilled`."""

    endpoint: Endpoint
    tokens: int
    prefill: int
    prefilled: bool = False
    finished: bool = False
    probe: Any = None  # plugins.latency.Probe of this forward's pick, or None
    sent_at: float = 0.0


def sent(
    e: Endpoint,
    req: SchedulingRequest,
    approximate_index: Any,
    computes_prompt: bool = True,
    now: float | None = None,
) -> Load:
    """`req` (scheduled: its state is filled) goes to `e`. `computes_prompt`: False when `e`
    imports the prompt's KV from a prefill endpoint (P/D), so it has no prefill to wait for."""
    tokens = len(req.token_ids)
    state = req.state
    prefill = state.uncached_tokens(e.name) if computes_prompt else 0
    e.in_flight += 1
    e.in_flight_tokens += tokens
    e.pending_prefill_tokens += prefill
    if req.block_keys:
        approximate_index.record(e.name, req.block_keys)
    load = Load(e, tokens, prefill)
    probe = state.probe
    if probe is not None and computes_prompt and probe.endpoint == e.name:
        load.probe, load.sent_at = probe, monotonic() if now is None else now
        probe.model.started(e.name)
    return load


def prefilled(load: Load, now: float | None = None) -> None:
    """The endpoint has computed the prompt (its first token is out): its backlog shrinks."""
    if not load.prefilled:
        _prefill_done(load)
        probe = load.probe
        if probe is not None:
            now = monotonic() if now is None else now
            probe.model.observed(probe.endpoint, probe.features, now - load.sent_at, now)


def _prefill_done(load: Load) -> None:
    load.prefilled = True
    load.endpoint.pending_prefill_tokens -= load.prefill


def finished(load: Load) -> None:
    """The forward is over, however it ended."""
    if not load.finished:
        if not load.prefilled:  # no first token came: nothing to report
            _prefill_done(load)
            if load.probe is not None:
                load.probe.model.dropped(load.probe.endpoint)
        load.finished = True
        load.endpoint.in_flight -= 1
        load.endpoint.in_flight_tokens -= load.tokens
