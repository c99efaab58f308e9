"""KV moved between the fleet's engines in virtual time: P/D (a prefill pool hands each prompt's
KV to a decode pool) and peer sharing (an engine pulls a prefix a peer holds), with the engine
code that moves KV over HTTP, so the blocks and the time they take are the engine's own.

P/D, as the router's disagg profile handler and vLLM's NixlConnector proxy do it
(router.pd.prefill_remotely, engine.pd): the handler picks a decode endpoint (`primary`) and,
when the prompt tokens it lacks reach its `nonCachedTokens`, a prefill endpoint (`prefill`;
else the decode endpoint computes the prompt itself: selective P/D). The prefill endpoint runs
a one-token copy of the request that holds its blocks when it ends (`hold_for_remote`, as
`do_remote_decode` sets it); the decode engine reads them (EngineCore.export_held) and imports
them as prefix-cache blocks (EngineCore.import_payload), and the request joins it after the
transfer time the engine computed (`last_import_seconds`, the emulated link), finding its prompt
cached. The router's forward bookkeeping is that of router.handlers: the prefill leg is in
flight until its one-token answer; the decode leg is in flight from the pick (while the prefill
leg runs, later picks see it) and is charged no prefill (`computes_prompt`).

Peer sharing, as llm-d's P2P flow and engine.peer.PeerPuller do it: after the pick, the peer
holding the longest prefix beyond the chosen endpoint's (by at least `min_cached_token_delta`,
router.peer_source.select_source) is the source; the chosen engine asks for the blocks after
its own (EngineCore.local_prefix), the peer exports them (EngineCore.export_prefix) and the
chosen engine imports them, unless its free blocks cannot hold the prompt (engine.peer's
`no_room`); the request joins after the transfer time.

Hit rate: a P/D request's `cached_tokens` is the prefill engine's prefix hit (the tokens no
engine computed); the decode engine's (the imported prompt) is `Transfer.decode_cached`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.engine.emulation.layouts import layout_name, parse_layout
from kvmesh.engine.peer import device_room
from kvmesh.router import forward_load
from kvmesh.router.plugins.profile_handlers import DisaggProfileHandler

if TYPE_CHECKING:
    from kvmesh.engine.core import EngineCore
    from kvmesh.engine.sequence import Request
    from kvmesh.router.plugins import SchedulingRequest

PREFILL_SUFFIX = "/prefill"  # the prefill leg's engine request id: <request id>/prefill


@dataclass(slots=True)
class Transfer:
    """One request's KV move: a P/D prefill leg and its hand-over, or a pull from a peer.
    `request`, `sched` and `load` are dropped once the KV has moved."""

    source: int  # engine index (FleetSim.engines) of the prefill endpoint or the peer
    sink: int  # engine index of the decode (or chosen) endpoint
    kind: str  # "pd" or "peer"
    request: Request | None = None  # P/D: the prefill leg on the source engine
    sched: SchedulingRequest | None = None  # P/D: the request as scheduled
    load: forward_load.Load | None = None  # P/D: the prefill leg's forward
    max_tokens: int = 0  # P/D: the decode leg's
    started: float = 0.0  # virtual s the move began (P/D: the prefill leg ended)
    seconds: float = 0.0  # the transfer time the sink engine computed
    saved_tokens: int = 0  # prompt tokens the sink imported (0: it recomputes them)
    prefill_cached: int = -1  # P/D: the prefill engine's prefix hit
    decode_cached: int = -1  # the sink's prefix hit at its first step


def prefill_pool(prefill_gpus: int, engines: int, layout: str, per: int) -> int:
    """Engines (or instances) of the prefill pool: `prefill_gpus` over the GPUs of one, which
    must divide it and leave at least one for decode. Raises ValueError otherwise."""
    if not prefill_gpus:
        return 0
    what = f"{layout_name(*parse_layout(layout))} instances" if layout else "engines"
    if prefill_gpus < 0 or prefill_gpus % per:
        raise ValueError(
            f"--prefill-gpus {prefill_gpus} is not a whole number of {what} of {per} GPUs "
            f"({prefill_gpus // per} x {per} leaves {prefill_gpus % per})"
        )
    n = prefill_gpus // per
    if n >= engines:
        raise ValueError(
            f"--prefill-gpus {prefill_gpus} leaves no GPUs for decode: the fleet has "
            f"{engines * per} GPUs ({engines} {what}); give the prefill pool fewer"
        )
    return n


def check_policy(pipeline, prefill_engines: int) -> None:
    """A fleet with a prefill pool needs a policy that routes by role (a disagg profile
    handler): any other would send whole requests to prefill endpoints."""
    if prefill_engines and not isinstance(pipeline.handler, DisaggProfileHandler):
        raise ValueError(
            "--prefill-gpus needs a P/D policy, one with a disagg-profile-handler (e.g. the "
            "router's `pd` preset): this one would serve whole requests on prefill endpoints"
        )


def hand_over(source: EngineCore, sink: EngineCore, held: Request, request: Request) -> tuple:
    """The decode side of P/D (engine.pd.pull_remote): read the blocks the finished prefill
    `held` holds on `source` and import them into `sink` for `request`: (tokens saved,
    seconds they take to arrive). Held blocks not read are released (an expired hold)."""
    transfer_id = (held.kv_transfer_params or {}).get("remote_request_id")
    payload = source.export_held(transfer_id) if transfer_id else None
    if payload is None:
        return 0, 0.0
    saved = sink.import_payload(request, payload)
    return saved, sink.last_import_seconds if saved else 0.0


def pull_prefix(source: EngineCore, sink: EngineCore, request: Request) -> tuple:
    """Peer sharing (engine.peer.PeerPuller.pull): `sink` pulls the blocks of `request`'s
    prompt after those it holds from `source`: (tokens saved, seconds they take to arrive)."""
    first, hashes = sink.local_prefix(request)
    if first >= len(hashes) or device_room(sink) < request.num_tokens:
        return 0, 0.0  # holds the whole prefix already, or no room: move nothing
    parts = source.export_prefix(hashes, first)
    if parts is None:
        return 0, 0.0
    saved = sink.import_payload(request, b"".join(parts))
    return saved, sink.last_import_seconds if saved else 0.0


class KVMoves:
    """FleetSim's KV moves: a P/D prefill leg and its hand-over, a pull from a peer. Each ends
    with an "add" event: the request joins its engine when its blocks have arrived."""

    __slots__ = ()

    def _prefill_leg(self, req: SchedulingRequest, d: int, p: int, max_tokens: int, digests):
        """P/D: a one-token copy of `req` on prefill engine `p` that holds its blocks for
        decode engine `d` (router.pd.prefill_remotely); its forward is in flight until then."""
        leg = self._request(
            req.request_id + PREFILL_SUFFIX, req.token_ids, digests, 1, self.engines[p]
        )
        leg.hold_for_remote = True
        approx = self.state.approximate_index
        load = forward_load.sent(self.engines[p].endpoint, req, approx, now=self.now)
        # the decode leg is charged from the pick, as the router charges it (router.handlers):
        # it carries the prefill's kv_transfer_params, so it is charged no prefill
        sink = self.engines[d].endpoint
        self._loads[req.request_id] = forward_load.sent(sink, req, approx, False, self.now)
        t = Transfer(p, d, "pd", leg, req, load, max_tokens)
        self.transfers[req.request_id] = self._legs[leg.request_id] = t
        self._add(p, leg)

    def _prefilled(self, t: Transfer, out) -> None:
        """The prefill leg's one token is out: its forward ends, the decode engine imports
        its blocks, and the decode leg joins that engine when they have arrived."""
        if t.prefill_cached < 0:
            t.prefill_cached = max(0, out.num_cached_tokens)
        if not out.finished:
            return
        del self._legs[out.request_id]
        forward_load.finished(t.load)
        req, held = t.sched, t.request
        sink = self.engines[t.sink]
        prompt_blocks = held.block_hashes[: len(req.token_ids) // self.block_size]
        request = self._request(req.request_id, req.token_ids, prompt_blocks, t.max_tokens, sink)
        t.saved_tokens, t.seconds = hand_over(self.engines[t.source].core, sink.core, held, request)
        t.started, t.request, t.sched, t.load = self.now, None, None, None
        self._push(self.now + t.seconds, "add", (t.sink, request))

    def _pull(self, peer: int, i: int, request: Request) -> bool:
        """Peer sharing: engine `i` pulls `request`'s prefix from `peer`; True when blocks
        came, and the request joins `i` when they have arrived."""
        saved, seconds = pull_prefix(self.engines[peer].core, self.engines[i].core, request)
        if not saved:
            return False
        t = Transfer(peer, i, "peer", started=self.now, seconds=seconds, saved_tokens=saved)
        self.transfers[request.request_id] = t
        self._push(self.now + seconds, "add", (i, request))
        return True
