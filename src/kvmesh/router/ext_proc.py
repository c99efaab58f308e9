"""The router as an endpoint picker behind Envoy: Envoy's ext_proc service, answered as the
Gateway API Inference Extension's EPP answers it (its endpoint picker protocol).

Envoy's ext_proc filter (request headers SEND, request body BUFFERED) streams each request's
headers and whole body here. The body is parsed and scheduled exactly as the router's own HTTP
path does it (router.request_parser, Router.pick, router.handlers' peer source, Charge and
error answers, router.pd's prefill leg), and the choice goes back as the header
``x-gateway-destination-endpoint: IP:PORT`` plus the same value in the dynamic metadata
namespace ``envoy.lb``, which Envoy's ORIGINAL_DST cluster (``use_http_header``) or a subset /
dynamic-forwarding load balancer routes on. The body is left as it came (CONTINUE) unless the
P/D leg replaced it with one carrying the prefill endpoint's kv_transfer_params.

No endpoint: fail closed (ImmediateResponse 503, OpenAI error JSON) or, with fail_open, CONTINUE
with no destination, so Envoy routes by its own configuration. The forward's load is charged
when the destination is sent and released when Envoy ends the gRPC stream (the HTTP stream is
over); the response headers, when Envoy sends them, mark the prompt computed and count the
decision as the HTTP path's first byte does.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import AsyncIterator
from time import perf_counter
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import grpc
import msgspec
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import (
    ExternalProcessorServicer,
    add_ExternalProcessorServicer_to_server,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from kvmesh.protocol.auth import CHALLENGE_LINE, UNAUTHORIZED
from kvmesh.protocol.openai import error_body
from kvmesh.router import handlers
from kvmesh.router.pd import prefill_remotely
from kvmesh.router.peer_source import PEER_HEADER
from kvmesh.router.request_reader import Request

if TYPE_CHECKING:
    from kvmesh.router.app import Router
    from kvmesh.router.endpoints import Endpoint

logger = logging.getLogger(__name__)
DESTINATION = "x-gateway-destination-endpoint"  # header and metadata key (EPP protocol)
METADATA_NAMESPACE = "envoy.lb"
DP_RANK_HEADER = "x-data-parallel-rank"  # as router.upstream_pool sends it
ENDPOINT_HEADER = "x-kvmesh-endpoint"  # on answers: the endpoint that served (as the proxy's)
ADDRESS_TTL = 30.0  # seconds a resolved endpoint host is reused (ORIGINAL_DST wants an IP)


class _Refusal:
    """Stands in for the front door where router.handlers answers a request with an error, so
    that the HTTP path's status, message and extra headers are the ones sent to Envoy."""

    answer: tuple[int, str, str] | None = None

    def respond_error(self, status: int, message: str, extra: str = "") -> None:
        self.answer = (status, message, extra)


def immediate(status: int, message: str, extra: str = "") -> pb.ProcessingResponse:
    """Envoy answers the client itself: ``status`` with an OpenAI error body. ``extra``: header
    lines as router.handlers writes them ("Name: value\\r\\n")."""
    lines = [line.split(": ", 1) for line in extra.split("\r\n") if ": " in line]
    headers = [("content-type", "application/json"), *((k.lower(), v) for k, v in lines)]
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=status),  # type: ignore[arg-type]  # enum values are codes
            headers=pb.HeaderMutation(set_headers=_set(headers)),
            body=msgspec.json.encode(error_body(message, status)),
            details=f"kvmesh_epp_{status}",
        )
    )


def _set(headers: list[tuple[str, str]]) -> list[HeaderValueOption]:
    return [
        HeaderValueOption(
            header=HeaderValue(key=k, raw_value=v.encode("latin-1")),
            append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        for k, v in headers
    ]


class EndpointPicker(ExternalProcessorServicer):
    """envoy.service.ext_proc.v3.ExternalProcessor over the router's scheduling pipeline."""

    def __init__(self, router: Router, fail_open: bool = False) -> None:
        self.router, self.fail_open = router, fail_open
        self._addresses: dict[str, tuple[str, float]] = {}  # host -> (IP, expiry)

    async def Process(  # noqa: N802  # the gRPC method's name
        self, requests: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        """One HTTP request's stream: an answer per message Envoy sends, in order; an immediate
        response ends it. Whatever load was charged is released when the stream ends."""
        stream = _Stream(self)
        try:
            async for message in requests:
                answer = await stream.answer(message)
                yield answer
                if answer.HasField("immediate_response"):
                    return
        finally:
            stream.end()

    async def address(self, e: Endpoint) -> str:
        """e's IP:PORT, as the Inference Extension's header names it (a host name resolved)."""
        parts = urlsplit(e.url)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            cached = self._addresses.get(host)
            if cached is None or cached[1] < time.monotonic():
                loop = asyncio.get_running_loop()
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                cached = (str(infos[0][4][0]), time.monotonic() + ADDRESS_TTL)
                self._addresses[host] = cached
            ip = ipaddress.ip_address(cached[0])
        return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


class _Stream:
    """The state of one request's ext_proc stream. Invariant: ``charge`` is the forward's load
    on ``endpoint`` from the destination's sending until end()."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker, self.router = picker, picker.router
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.endpoint: Endpoint | None = None
        self.charge: handlers.Charge | None = None

    async def answer(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            http = message.request_headers
            self.headers = {
                h.key.lower(): h.raw_value.decode("latin-1") or h.value
                for h in http.headers.headers
            }
            path = self.headers.get(":path", "").partition("?")[0]  # a query is never echoed
            if self.router.key_refused(path, self.headers):
                return immediate(401, UNAUTHORIZED, CHALLENGE_LINE)
            method = self.headers.get(":method", "")
            if path in handlers.INFERENCE_PATHS and method != "POST":
                return immediate(405, f"{method} is not allowed on {path}.")
            if http.end_of_stream:  # no body: any endpoint serves it (as GIE's EPP does)
                return await self._anywhere("request_headers")
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        if kind == "request_body":
            self.body.append(message.request_body.body)
            if not message.request_body.end_of_stream:
                return pb.ProcessingResponse(request_body=pb.BodyResponse())
            body, self.body = b"".join(self.body), []
            path = self.headers.get(":path", "").partition("?")[0]
            if path in handlers.INFERENCE_PATHS:  # a POST: others were refused at the headers
                return await self._schedule(path, body)
            return await self._anywhere("request_body")
        if kind == "response_headers":
            self._answered(message.response_headers)
            answer = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            if self.endpoint is not None:
                named = [(ENDPOINT_HEADER, self.endpoint.name)]
                answer.response_headers.response.header_mutation.set_headers.extend(_set(named))
            return answer
        # trailers or a response body (not asked for by the documented config): pass through
        return pb.ProcessingResponse(**{kind: _EMPTY[kind]()})

    @property
    def auth(self) -> str | None:
        return self.headers.get("authorization")

    async def _schedule(self, path: str, body: bytes) -> pb.ProcessingResponse:
        """Parse, pick and answer as router.handlers does for its own clients."""
        router = self.router
        if len(body) > router.config.max_body_bytes:
            return immediate(413, f"Request body over {router.config.max_body_bytes} bytes.")
        t0 = perf_counter()
        headers = {k: v for k, v in self.headers.items() if not k.startswith(":")}
        target = self.headers.get(":path", path)
        request = Request("POST", target, path, headers, body, True)
        try:
            req = await router.parser.parse(request)
        except Exception as exc:
            refusal = _Refusal()
            handlers.refuse(refusal, exc)  # type: ignore[arg-type]
            assert refusal.answer is not None
            return immediate(*refusal.answer)
        if router.warm_until:  # just started: the engines' KV-event replay is still coming in
            await router.wait_index_warm()
        result = router.pick(req, set())
        router.metrics.scheduling.observe(perf_counter() - t0)
        if result is None:
            return self.no_endpoint("request_body")
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
        return await self._destination("request_body", e, extra, None if send is body else send)

    async def _anywhere(self, kind: str) -> pb.ProcessingResponse:
        """A request that is not scheduled (no body, or no inference route): the least busy
        healthy endpoint, no load charged."""
        candidates = self.router.pool.candidates()
        if not candidates:
            return self.no_endpoint(kind)
        e = min(candidates, key=lambda c: c.in_flight + c.waiting)
        self.endpoint = e
        return await self._destination(kind, e, [], None)

    async def _destination(
        self, kind: str, e: Endpoint, extra: list[tuple[str, str]], body: bytes | None
    ) -> pb.ProcessingResponse:
        """The answer that sends the request to e: the header and envoy.lb metadata naming it,
        e's data-parallel rank, the Authorization endpoints take, and a replaced body; the
        peer-source and rank headers a client sent are dropped."""
        address = await self.picker.address(e)
        headers = [(DESTINATION, address), *extra]
        if e.dp_rank is not None:
            headers.append((DP_RANK_HEADER, str(e.dp_rank)))
        auth = self.router.config.upstream_authorization(self.auth)
        if auth and auth != self.auth:
            headers.append(("authorization", auth))
        common = pb.CommonResponse()
        if body is not None:
            common.body_mutation.body = body
            headers.append(("content-length", str(len(body))))
        common.header_mutation.set_headers.extend(_set(headers))
        # the router's own headers, never a client's (the HTTP proxy forwards no client header)
        named = {k for k, _ in headers}
        unset = [h for h in (PEER_HEADER, DP_RANK_HEADER) if h not in named]
        common.header_mutation.remove_headers.extend(unset)
        metadata = Struct()
        metadata.update({METADATA_NAMESPACE: {DESTINATION: address}})
        answer = pb.ProcessingResponse(dynamic_metadata=metadata)
        getattr(answer, kind).response.CopyFrom(common)
        return answer

    def no_endpoint(self, kind: str) -> pb.ProcessingResponse:
        if self.picker.fail_open:  # Envoy routes by its own configuration, never the client's
            answer = pb.ProcessingResponse(**{kind: _EMPTY[kind]()})
            getattr(answer, kind).response.header_mutation.remove_headers.append(DESTINATION)
            return answer
        refusal = _Refusal()
        handlers.no_endpoint(refusal)  # type: ignore[arg-type]
        assert refusal.answer is not None
        return immediate(*refusal.answer)

    def _answered(self, http: pb.HttpHeaders) -> None:
        """The endpoint's answer head: as the HTTP path's first byte, a 5xx counting towards
        the endpoint's ejection."""
        e = self.endpoint
        if e is None or self.charge is None:
            return
        status = [
            h.raw_value or h.value.encode() for h in http.headers.headers if h.key == ":status"
        ]
        code = int(status[0]) if status and status[0].isdigit() else 0
        if code >= 500:
            self.router.metrics.count(e.name, f"http_{code}")
            self.router.pool.request_failed(e, "5xx")
            return
        self.charge.first_byte()
        self.charge.passed()
        e.errors = 0
        self.router.metrics.count(e.name, "ok" if code < 400 else f"http_{code}")

    def end(self) -> None:
        if self.charge is not None:
            self.charge.release()
            self.charge = None


_EMPTY = {
    "request_headers": pb.HeadersResponse,
    "response_headers": pb.HeadersResponse,
    "request_body": pb.BodyResponse,
    "response_body": pb.BodyResponse,
    "request_trailers": pb.TrailersResponse,
    "response_trailers": pb.TrailersResponse,
}


async def serve_ext_proc(
    router: Router, host: str, port: int, fail_open: bool = False
) -> tuple[grpc.aio.Server, int]:
    """Start the ext_proc gRPC server on host:port (0: any free port); returns it and the port
    bound. Messages may carry a whole request body: the limit follows --max-body-bytes."""
    size = router.config.max_body_bytes + 2**20
    options = [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]
    server = grpc.aio.server(options=options)
    add_ExternalProcessorServicer_to_server(EndpointPicker(router, fail_open), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound
