"""The messages the endpoint picker (router.ext_proc) answers Envoy with: an immediate answer
carrying an OpenAI error body, header mutations, and the decision for a request in either of the
request body modes the picker serves.

``BUFFERED``: Envoy sends the headers, waits for their answer, then sends the whole body; the
decision rides on the body's answer (header mutation, dynamic metadata, a replaced body).
``FULL_DUPLEX_STREAMED`` (request trailers ``SEND``, as the Gateway API Inference Extension's
gateways configure it): Envoy streams headers and body chunks without waiting; the picker holds
its answer to the headers until the body is whole, then sends the headers' answer (the decision)
followed by the body as streamed body mutations, in chunks, the last one ending the stream unless
trailers follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from kvmesh.protocol.openai import error_body

FULL_DUPLEX_STREAMED = ProcessingMode.FULL_DUPLEX_STREAMED
# a streamed body mutation's largest chunk: Envoy advises at most 64 KiB per message
STREAMED_CHUNK_BYTES = 62_000

EMPTY = {
    "request_headers": pb.HeadersResponse,
    "response_headers": pb.HeadersResponse,
    "request_body": pb.BodyResponse,
    "response_body": pb.BodyResponse,
    "request_trailers": pb.TrailersResponse,
    "response_trailers": pb.TrailersResponse,
}


class Refusal:
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
            headers=pb.HeaderMutation(set_headers=set_headers(headers)),
            body=msgspec.json.encode(error_body(message, status)),
            details=f"kvmesh_epp_{status}",
        )
    )


def set_headers(headers: list[tuple[str, str]]) -> list[HeaderValueOption]:
    return [
        HeaderValueOption(
            header=HeaderValue(key=k, raw_value=v.encode("latin-1")),
            append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        for k, v in headers
    ]


def passed(kind: str) -> pb.ProcessingResponse:
    """CONTINUE, nothing changed."""
    return pb.ProcessingResponse(**{kind: EMPTY[kind]()})


def streamed_body(kind: str, body: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """body as streamed body mutations, in chunks; the last ends the stream if end_of_stream
    (an empty body still gets its one message)."""
    chunks = [body[i : i + STREAMED_CHUNK_BYTES] for i in range(0, len(body), STREAMED_CHUNK_BYTES)]
    answers = []
    for i, chunk in enumerate(chunks or [b""]):
        answer = passed(kind)
        streamed = getattr(answer, kind).response.body_mutation.streamed_response
        streamed.body = chunk
        streamed.end_of_stream = end_of_stream and i == max(len(chunks) - 1, 0)
        answers.append(answer)
    return answers


@dataclass(slots=True)
class Verdict:
    """The picker's decision for one request: an answer Envoy gives the client itself
    (``refusal``), or the header mutation and metadata the request goes upstream with, and the
    body to forward in place of the client's (None: the client's)."""

    refusal: pb.ProcessingResponse | None = None
    headers: pb.HeaderMutation | None = None
    metadata: Struct | None = None
    body: bytes | None = None

    def answers(
        self, kind: str, streamed: bool, body: bytes, trailers: bool = False
    ) -> list[pb.ProcessingResponse]:
        """The answers to the message of ``kind`` that completed the request (its headers, the
        body's last chunk or, streamed, the trailers): one for BUFFERED; streamed, the headers'
        held answer, then the body (``body``: the client's) unless the request had none."""
        if self.refusal is not None:
            return [self.refusal]
        forward = self.body if self.body is not None else body
        mutation = pb.HeaderMutation()
        if self.headers is not None:
            mutation.CopyFrom(self.headers)
        if self.body is not None or streamed and kind != "request_headers":
            # Envoy drops the header once the body may change; sent right, it stays valid
            mutation.set_headers.extend(set_headers([("content-length", str(len(forward)))]))
        head = "request_headers" if streamed else kind
        answer = passed(head)
        common = getattr(answer, head).response
        common.header_mutation.CopyFrom(mutation)
        if self.metadata is not None:
            answer.dynamic_metadata.CopyFrom(self.metadata)
        if not streamed:
            if self.body is not None:
                common.body_mutation.body = self.body
            return [answer]
        if kind == "request_headers":
            return [answer]
        return [answer, *streamed_body("request_body", forward, not trailers)]
