"""The router as an endpoint picker behind Envoy: one request's ext_proc stream, answered as the
Gateway API Inference Extension's EPP answers it (its endpoint picker protocol); the gRPC server
around it is router.ext_proc_server.

Envoy's ext_proc filter streams each request's headers and body here, the body either whole
(``BUFFERED``) or in chunks as they arrive (``FULL_DUPLEX_STREAMED`` with request trailers
``SEND``, the mode the Inference Extension's gateways use; Envoy names its mode in the stream's
first message). The body is parsed and scheduled exactly as the router's own HTTP path does it
(router.request_parser, Router.pick, router.handlers' peer source, Charge and error answers,
router.pd's prefill leg), among the endpoints of the gateway's subset hint when it sends one,
and the choice goes back as the header ``x-gateway-destination-endpoint: IP:PORT`` (then any
fallback endpoints, comma-separated) plus the same value in the dynamic metadata namespace
``envoy.lb``, which Envoy's ORIGINAL_DST cluster (``use_http_header``, one address) or its
override_host load balancing policy routes on. Reserved ``x-gateway-*`` headers a client sent
are dropped. The body goes on as it came unless the P/D leg replaced it with one carrying the
prefill endpoint's kv_transfer_params; router.ext_proc_messages shapes the answers for each mode.

No endpoint in rotation: fail closed (ImmediateResponse 503, OpenAI error JSON) or, with
fail_open, CONTINUE with no destination, so Envoy routes by its own configuration. The forward's
load is charged when the destination is sent and released when Envoy ends the gRPC stream (the
HTTP stream is over); the response headers, when Envoy sends them, mark the prompt computed and
count the decision as the HTTP path's first byte does, on the fallback when Envoy reports one
served.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.struct_pb2 import Struct

from kvmesh.protocol.auth import CHALLENGE_LINE, UNAUTHORIZED
from kvmesh.router import handlers
from kvmesh.router.ext_proc_destination import (
    DESTINATION,
    METADATA_NAMESPACE,
    RESERVED_PREFIX,
    in_subset,
    ranked_after,
    served_by,
    subset_hint,
)
from kvmesh.router.ext_proc_messages import (
    Refusal,
    Verdict,
    immediate,
    passed,
    set_headers,
    streamed_body,
)
from kvmesh.router.pd import prefill_remotely
from kvmesh.router.peer_source import PEER_HEADER
from kvmesh.router.request_reader import Request
from kvmesh.router.shedding import SATURATED, Shedding

if TYPE_CHECKING:
    from kvmesh.router.app import Router
    from kvmesh.router.endpoints import Endpoint

logger = logging.getLogger(__name__)
DP_RANK_HEADER = "x-data-parallel-rank"  # as router.upstream_pool sends it
ENDPOINT_HEADER = "x-kvmesh-endpoint"  # on answers: the endpoint that served (as the proxy's)


class RequestStream:
    """The state of one request's ext_proc stream. Invariant: ``charge`` is the forward's load
    on ``endpoint`` from the destination's sending until end()."""

    def __init__(
        self,
        router: Router,
        fail_open: bool,
        address: Callable[[Endpoint], Awaitable[str]],
        shedding: Shedding | None = None,
    ) -> None:
        self.router, self.fail_open, self.address = router, fail_open, address
        self.shedding = shedding or Shedding()
        self.streamed_request = self.streamed_response = False  # FULL_DUPLEX_STREAMED bodies
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.size = 0  # bytes of body received
        self.decided = False  # the request's answer is sent (streamed: the held headers' too)
        self.endpoint: Endpoint | None = None
        self.named: dict[str, Endpoint] = {}  # the addresses sent (fallbacks too): endpoints
        self.subset: set[str] | None = None  # the gateway's subset hint: pick among these only
        self.charge: handlers.Charge | None = None

    async def answer(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers to one of Envoy's messages (none while a streamed body is incomplete)."""
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self.subset = subset_hint(message)
            return await self._request_headers(message.request_headers)
        if kind == "request_body":
            chunk = message.request_body
            self.body.append(chunk.body)
            self.size += len(chunk.body)
            limit = self.router.config.max_body_bytes
            if self.size > limit:
                return [immediate(413, f"Request body over {limit} bytes.")]
            if not chunk.end_of_stream:  # buffered: a chunk of a body over Envoy's buffer
                return [] if self.streamed_request else [passed(kind)]
            return await self._complete(kind, trailers=False)
        if kind == "request_trailers":
            if self.streamed_request and not self.decided:  # the body is whole: decide now
                return [*await self._complete(kind, trailers=True), passed(kind)]
            return [passed(kind)]
        if kind == "response_headers":
            return [self._answered(message.response_headers, served_by(message))]
        if kind == "response_body" and self.streamed_response:  # the answer, as it came
            chunk = message.response_body
            return streamed_body(kind, chunk.body, chunk.end_of_stream)
        return [passed(kind)]  # response trailers, or a body not streamed: pass through

    async def _request_headers(self, http: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        self.headers = {
            h.key.lower(): h.raw_value.decode("latin-1") or h.value for h in http.headers.headers
        }
        path = self.headers.get(":path", "").partition("?")[0]  # a query is never echoed
        if self.router.key_refused(path, self.headers):
            return [immediate(401, UNAUTHORIZED, CHALLENGE_LINE)]
        method = self.headers.get(":method", "")
        if path in handlers.INFERENCE_PATHS and method != "POST":
            return [immediate(405, f"{method} is not allowed on {path}.")]
        if http.end_of_stream:  # no body: any endpoint serves it (as GIE's EPP does)
            self.decided = True
            verdict = await self._anywhere()
            return verdict.answers("request_headers", self.streamed_request, b"")
        if self.streamed_request:  # held until the body is whole: the pick needs it
            return []
        return [passed("request_headers")]

    async def _complete(self, kind: str, trailers: bool) -> list[pb.ProcessingResponse]:
        """The body is whole: schedule the request (an inference POST) or send it anywhere."""
        body, self.body = b"".join(self.body), []
        self.decided = True
        path = self.headers.get(":path", "").partition("?")[0]
        if path in handlers.INFERENCE_PATHS:  # a POST: others were refused at the headers
            verdict = await self._schedule(path, body)
        else:
            verdict = await self._anywhere()
        answer_kind = "request_body" if kind == "request_trailers" else kind
        return verdict.answers(answer_kind, self.streamed_request, body, trailers)

    @property
    def auth(self) -> str | None:
        return self.headers.get("authorization")

    async def _schedule(self, path: str, body: bytes) -> Verdict:
        """Parse, pick and answer as router.handlers does for its own clients."""
        router = self.router
        t0 = perf_counter()
        headers = {k: v for k, v in self.headers.items() if not k.startswith(":")}
        target = self.headers.get(":path", path)
        request = Request("POST", target, path, headers, body, True)
        try:
            req = await router.parser.parse(request)
        except Exception as exc:
            refusal = Refusal()
            handlers.refuse(refusal, exc)  # type: ignore[arg-type]
            assert refusal.answer is not None
            return Verdict(refusal=immediate(*refusal.answer))
        if router.warm_until:  # just started: the engines' KV-event replay is still coming in
            await router.wait_index_warm()
        outside = await self._outside_subset()
        candidates = (e for e in router.pool.candidates() if e.name not in outside)
        if self.shedding.sheds(self.headers, candidates):  # sheddable, and no room anywhere
            return Verdict(refusal=immediate(429, SATURATED, "Retry-After: 1\r\n"))
        result = router.pick(req, outside, everywhere=False)  # no retry here: 503 instead
        router.metrics.scheduling.observe(perf_counter() - t0)
        if result is None:
            return self.no_endpoint()
        e, send, source = result.primary, body, None
        if result.prefill is not None:  # P/D: the decode endpoint gets its KV from prefill
            send = await prefill_remotely(router, path, body, req, result.prefill)
        else:
            source = handlers.peer_source(router, req, e, {e.name})
        self.endpoint = e
        self.charge = handlers.Charge(router, req, e, source, computes_prompt=send is body)
        extra = [("x-request-id", req.request_id)]
        if source is not None:
            extra.append((PEER_HEADER, source.address))
        fallbacks = [] if result.prefill is not None else ranked_after(result, e)
        return await self._destination(e, extra, None if send is body else send, fallbacks)

    async def _anywhere(self) -> Verdict:
        """A request that is not scheduled (no body, or no inference route): the least busy
        healthy endpoint, no load charged."""
        outside = await self._outside_subset()
        candidates = [e for e in self.router.pool.candidates() if e.name not in outside]
        if not candidates:
            return self.no_endpoint()
        e = min(candidates, key=lambda c: c.in_flight + c.waiting)
        self.endpoint = e
        return await self._destination(e, [], None)

    async def _outside_subset(self) -> set[str]:
        """The endpoints the gateway's subset hint leaves out (none without a hint)."""
        if self.subset is None:
            return set()
        endpoints = self.router.pool.endpoints.values()
        return {e.name for e in endpoints if not in_subset(await self.address(e), self.subset)}

    async def _destination(
        self,
        e: Endpoint,
        extra: list[tuple[str, str]],
        body: bytes | None,
        fallbacks: list[Endpoint] | None = None,
    ) -> Verdict:
        """The decision that sends the request to e: the header and envoy.lb metadata naming
        it (then up to --ext-proc-fallback-endpoints other addresses of ``fallbacks``, in
        order), e's data-parallel rank, the Authorization endpoints take, and a replaced body;
        the peer-source and rank headers a client sent are dropped."""
        addresses = [await self.address(e)]
        self.named = {addresses[0]: e}
        for other in fallbacks or ():
            if len(addresses) > self.router.config.ext_proc_fallback_endpoints:
                break
            named = await self.address(other)
            if named not in addresses:  # data-parallel ranks share their server's address
                addresses.append(named)
                self.named[named] = other
        address = ",".join(addresses)
        headers = [(DESTINATION, address), *extra]
        if e.dp_rank is not None:
            headers.append((DP_RANK_HEADER, str(e.dp_rank)))
        auth = self.router.config.upstream_authorization(self.auth)
        if auth and auth != self.auth:
            headers.append(("authorization", auth))
        mutation = pb.HeaderMutation(set_headers=set_headers(headers))
        # the router's own headers, never a client's (the HTTP proxy forwards no client header)
        named = {k for k, _ in headers}
        mutation.remove_headers.extend(h for h in (PEER_HEADER, DP_RANK_HEADER) if h not in named)
        mutation.remove_headers.extend(self._reserved(named))
        metadata = Struct()
        metadata.update({METADATA_NAMESPACE: {DESTINATION: address}})
        return Verdict(headers=mutation, metadata=metadata, body=body)

    def _reserved(self, named: set[str]) -> list[str]:
        """The reserved x-gateway-* headers the client sent that the answer does not set."""
        return [k for k in self.headers if k.startswith(RESERVED_PREFIX) and k not in named]

    def no_endpoint(self) -> Verdict:
        """503; or, failing open (and with no subset hint, which must be honoured), no
        destination: Envoy routes by its own configuration, never the client's."""
        if self.fail_open and self.subset is None:
            unset = [DESTINATION, *self._reserved({DESTINATION})]
            return Verdict(headers=pb.HeaderMutation(remove_headers=unset))
        refusal = Refusal()
        handlers.no_endpoint(refusal)  # type: ignore[arg-type]
        assert refusal.answer is not None
        return Verdict(refusal=immediate(*refusal.answer))

    def _answered(self, http: pb.HttpHeaders, served: str | None) -> pb.ProcessingResponse:
        """The endpoint's answer head: as the HTTP path's first byte, a 5xx counting towards
        the endpoint's ejection; the answer names the endpoint that served (when asked to).
        ``served``: the
        address Envoy reports serving; a fallback's means the chosen endpoint failed, and the
        forward's load moves to the fallback."""
        answer = passed("response_headers")
        fallback = self.named.get(served or "")
        if fallback is not None and fallback is not self.endpoint and self.endpoint is not None:
            self.router.metrics.count(self.endpoint.name, "fallback")
            self.router.pool.request_failed(self.endpoint, "fallback")
            if self.charge is not None:
                req = self.charge.req
                self.charge.release()
                self.charge = handlers.Charge(self.router, req, fallback, None)
            self.endpoint = fallback
        e = self.endpoint
        if e is not None and self.router.config.ext_proc_endpoint_header:
            named = set_headers([(ENDPOINT_HEADER, e.name)])
            answer.response_headers.response.header_mutation.set_headers.extend(named)
        if e is None or self.charge is None:
            return answer
        status = [
            h.raw_value or h.value.encode() for h in http.headers.headers if h.key == ":status"
        ]
        code = int(status[0]) if status and status[0].isdigit() else 0
        if code >= 500:
            self.router.metrics.count(e.name, f"http_{code}")
            self.router.pool.request_failed(e, "5xx")
            return answer
        self.charge.first_byte()
        self.charge.passed()
        e.errors = 0
        self.router.metrics.count(e.name, "ok" if code < 400 else f"http_{code}")
        return answer

    def end(self) -> None:
        if self.charge is not None:
            self.charge.release()
            self.charge = None
