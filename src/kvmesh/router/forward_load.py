"""A forward's bookkeeping: what the router (router.handlers, router.pd) and the simulator
(sim.fleet) both do when a scheduled request is sent to an endpoint, when that endpoint has
computed its prompt, and when its answer ends.

Sent: the endpoint has one more request in flight, the prompt's tokens in flight, and the
prompt tokens it lacks (SchedulingState.uncached_tokens) as pending prefill; the approximate
index records that the endpoint now holds the prompt's blocks (llm-d records at PreRequest,
before any answer). Prefilled (first token; a prefill leg's whole answer): the pending prefill
drops, once. Finished (answer ended, failed or abandoned): the rest is released, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint
    from kvmesh.router.plugins import SchedulingRequest


@dataclass(slots=True)
class Load:
    """What one forward added to its endpoint's counters, until released.
    Invariant: `prefill` is still counted iff not `prefilled`; all of it iff not `finished`."""

    endpoint: Endpoint
    tokens: int
    prefill: int
    prefilled: bool = False
    finished: bool = False


def sent(
    e: Endpoint, req: SchedulingRequest, approximate_index: Any, computes_prompt: bool = True
) -> Load:
    """`req` (scheduled: its state is filled) goes to `e`. `computes_prompt`: False when `e`
    imports the prompt's KV from a prefill endpoint (P/D), so it has no prefill to wait for."""
    tokens = len(req.token_ids)
    prefill = req.state.uncached_tokens(e.name) if computes_prompt else 0
    e.in_flight += 1
    e.in_flight_tokens += tokens
    e.pending_prefill_tokens += prefill
    if req.block_keys:
        approximate_index.record(e.name, req.block_keys)
    return Load(e, tokens, prefill)


def prefilled(load: Load) -> None:
    """The endpoint has computed the prompt (its first token is out): its backlog shrinks."""
    if not load.prefilled:
        load.prefilled = True
        load.endpoint.pending_prefill_tokens -= load.prefill


def finished(load: Load) -> None:
    """The forward is over, however it ended."""
    if not load.finished:
        prefilled(load)
        load.finished = True
        load.endpoint.in_flight -= 1
        load.endpoint.in_flight_tokens -= load.tokens
