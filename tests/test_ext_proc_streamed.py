"""The endpoint picker in FULL_DUPLEX_STREAMED body mode (request trailers SEND), as the Gateway
API Inference Extension's gateways configure it: driven over a real gRPC channel the way Envoy
drives it, every message written without waiting for an answer."""

from __future__ import annotations

import json

import pytest

grpc = pytest.importorskip("grpc")
pb = pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue  # noqa: E402
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import (  # noqa: E402
    ProcessingMode,
)
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import (  # noqa: E402
    ExternalProcessorStub,
)

from kvmesh.router.ext_proc import DESTINATION, METADATA_NAMESPACE  # noqa: E402
from kvmesh.router.ext_proc_messages import STREAMED_CHUNK_BYTES  # noqa: E402
from tests import test_ext_proc as base  # noqa: E402
from tests.conftest import emulated_fleet  # noqa: E402
from tests.test_ext_proc import (  # noqa: E402
    BODY_MODES,
    address,
    envoy,
    headers,
    picker,
    set_headers,
    wait_for,
)
from tests.test_router_drain import Stream  # noqa: E402

epp, fleet = base.epp, base.fleet  # its fixtures, shared

FULL_DUPLEX = pb.ProtocolConfiguration(
    request_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED,
    response_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED,
)


def chunks(data: bytes, size: int, last: bool = True) -> list:
    """data as request body chunks of size bytes; the last ends the stream if ``last``."""
    parts = [data[i : i + size] for i in range(0, len(data), size)]
    return [
        pb.ProcessingRequest(
            request_body=pb.HttpBody(body=p, end_of_stream=last and i == len(parts) - 1)
        )
        for i, p in enumerate(parts)
    ]


async def duplex(port: int, messages: list, expect: int) -> list:
    """Envoy's side of a full-duplex stream: the protocol configuration on the first message,
    every message written at once, then ``expect`` answers read."""
    first = pb.ProcessingRequest()
    first.CopyFrom(messages[0])
    first.protocol_config.CopyFrom(FULL_DUPLEX)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = ExternalProcessorStub(channel).Process()
        for message in [first, *messages[1:]]:
            await call.write(message)
        answers = [await call.read() for _ in range(expect)]
        await call.done_writing()
        return answers


def streamed(answer) -> tuple[bytes, bool]:
    s = answer.request_body.response.body_mutation.streamed_response
    return s.body, s.end_of_stream


async def test_the_headers_answer_waits_for_the_whole_body(epp, fleet) -> None:
    """Body chunks get no answer until the last; then the headers' answer carries the
    destination (header and envoy.lb metadata), and the body follows as streamed mutations,
    re-chunked, the last one ending the stream."""
    router, port, _ = epp
    prompt = "A long shared system prompt. " * 4000  # ~116 kB: over one streamed chunk
    raw = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 2}).encode()
    messages = [headers("/v1/completions"), *chunks(raw, 16_384)]
    answers = await duplex(port, messages, 1 + -(-len(raw) // STREAMED_CHUNK_BYTES))
    head = answers[0]
    assert head.HasField("request_headers")  # the held headers' answer comes first
    sent = set_headers(head.request_headers.response)
    assert sent[DESTINATION] in {address(u) for u in fleet}
    assert sent["content-length"] == str(len(raw))
    lb = head.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value
    assert lb.fields[DESTINATION].string_value == sent[DESTINATION]
    bodies = [streamed(a) for a in answers[1:]]
    assert all(a.HasField("request_body") for a in answers[1:])
    assert b"".join(b for b, _ in bodies) == raw  # the body goes on as it came
    assert [eos for _, eos in bodies] == [False] * (len(bodies) - 1) + [True]
    assert all(len(b) <= STREAMED_CHUNK_BYTES for b, _ in bodies)


async def test_trailers_complete_the_body(epp) -> None:
    """A request with trailers: the body's last chunk does not end the stream; the trailers
    do, and are answered after the decision and the body (which then does not end it)."""
    _, port, _ = epp
    raw = json.dumps({"prompt": "hello there", "max_tokens": 2}).encode()
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers(trailers=HeaderMap()))
    messages = [headers("/v1/completions"), *chunks(raw, 10, last=False), trailers]
    answers = await duplex(port, messages, 3)
    kinds = [a.WhichOneof("response") for a in answers]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    assert DESTINATION in set_headers(answers[0].request_headers.response)
    assert streamed(answers[1]) == (raw, False)


async def test_bad_body_is_an_immediate_error_with_no_headers_answer(epp) -> None:
    _, port, _ = epp
    answers = await duplex(port, [headers("/v1/completions"), *chunks(b"{not json", 4)], 1)
    reply = answers[0].immediate_response
    assert reply.status.code == 400
    assert json.loads(reply.body)["error"]["type"] == "BadRequestError"


async def test_answer_bodies_pass_through_unchanged(epp) -> None:
    """With response bodies streamed too, each chunk of the answer goes back as it came."""
    _, port, _ = epp
    raw = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    status = HeaderMap(headers=[HeaderValue(key=":status", raw_value=b"200")])
    answer_head = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=status))
    sse = [b"data: {}\n\n", b"data: [DONE]\n\n"]
    answer_body = [
        pb.ProcessingRequest(response_body=pb.HttpBody(body=c, end_of_stream=i == 1))
        for i, c in enumerate(sse)
    ]
    messages = [headers("/v1/completions"), *chunks(raw, 1000), answer_head, *answer_body]
    answers = await duplex(port, messages, 5)
    assert answers[2].HasField("response_headers")
    passed = [a.response_body.response.body_mutation.streamed_response for a in answers[3:]]
    assert [(p.body, p.end_of_stream) for p in passed] == [(sse[0], False), (sse[1], True)]


@pytest.fixture(scope="module")
def slow_engine(tokenizer):
    """One emulated engine answering a token every 50 ms."""
    with emulated_fleet(tokenizer, 1, emulate_ttft_ms=5.0, emulate_itl_ms=50.0) as (urls, _):
        yield urls[0]


@pytest.mark.parametrize(("body_mode", "stream_responses"), BODY_MODES)
def test_the_load_counts_until_the_answer_ends(
    tokenizer, slow_engine, body_mode: str, stream_responses: bool
) -> None:
    """Through a real Envoy in each mode, the picker's stream, and with it the forward's load
    on the endpoint, lasts until the streamed answer ends, not only to its head."""
    config = {"kv_events": None, "preset": "round-robin"}
    with (
        picker(tokenizer, [slow_engine], **config) as (router, port, _),
        envoy(port, body_mode, stream_responses) as url,
    ):
        wait_for(lambda: len(router.pool.candidates()) == 1)
        (endpoint,) = router.pool.endpoints.values()
        stream = Stream(url)  # 60 tokens: 3 s
        assert stream.started.wait(30) and stream.status == 200
        assert endpoint.in_flight == 1
        assert not stream.done.is_set()  # counted mid-answer
        assert stream.done.wait(30) and stream.chunks[-1] == b"data: [DONE]"
        wait_for(lambda: endpoint.in_flight == 0)
