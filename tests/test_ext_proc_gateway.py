"""The endpoint picker's side of the Gateway API Inference Extension protocol beyond the pick: the
gateway's subset hint, reserved x-gateway-* headers, and the endpoint header kept internal
unless asked for."""

from __future__ import annotations

import json

import pytest

grpc = pytest.importorskip("grpc")
pb = pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata  # noqa: E402
from google.protobuf.struct_pb2 import Struct  # noqa: E402

from kvmesh.router.ext_proc import DESTINATION  # noqa: E402
from tests import test_ext_proc as base  # noqa: E402
from tests.helpers import http  # noqa: E402
from tests.test_ext_proc import (  # noqa: E402
    address,
    body,
    envoy,
    headers,
    picker,
    process,
    set_headers,
)

epp, fleet = base.epp, base.fleet  # its fixtures, shared
REQUEST = {"prompt": "hello there", "max_tokens": 2}


def with_subset(message, subset: list[str] | str):
    """message carrying the gateway's envoy.lb.subset_hint metadata."""
    hint = Struct()
    hint.update({"x-gateway-destination-endpoint-subset": subset})
    message.metadata_context.CopyFrom(Metadata(filter_metadata={"envoy.lb.subset_hint": hint}))
    return message


async def test_the_subset_hint_limits_the_pick(epp, fleet) -> None:
    _, port, _ = epp
    for allowed in fleet:
        for i in range(3):  # round and round: always the one allowed
            request = {"prompt": f"request {i} for {allowed}", "max_tokens": 2}
            first = with_subset(headers("/v1/completions"), [address(allowed)])
            answers = await process(port, [first, body(request)])
            assert set_headers(answers[1].request_body.response)[DESTINATION] == address(allowed)
    first = with_subset(headers("/v1/models", method="GET", eos=True), address(fleet[1]))
    answers = await process(port, [first])  # a comma-separated string, no body
    assert set_headers(answers[0].request_headers.response)[DESTINATION] == address(fleet[1])
    first = with_subset(headers("/v1/completions"), ["127.0.0.1"])  # an IP: any of its ports
    answers = await process(port, [first, body(REQUEST)])
    assert set_headers(answers[1].request_body.response)[DESTINATION] in map(address, fleet)


@pytest.mark.parametrize("fail_open", [False, True])
async def test_a_subset_with_no_endpoint_is_503_even_failing_open(
    tokenizer, fleet, fail_open: bool
) -> None:
    with picker(tokenizer, fleet, fail_open=fail_open, kv_events=None) as (router, port, _):
        base.wait_for(lambda: len(router.pool.candidates()) == 2)
        for subset in (["10.9.9.9:8000"], []):
            first = with_subset(headers("/v1/completions"), subset)
            answers = await process(port, [first, body(REQUEST)])
            reply = answers[-1].immediate_response
            assert reply.status.code == 503
            assert json.loads(reply.body)["error"]["type"] == "ServiceUnavailableError"


async def test_reserved_gateway_headers_a_client_sent_are_dropped(epp) -> None:
    _, port, _ = epp
    sent = {
        "x-gateway-destination-endpoint": "10.9.9.9:1",
        "x-gateway-destination-endpoint-subset": "10.9.9.9:1",
        "x-gateway-inference-objective": "premium",
        "x-custom": "kept",
    }
    answers = await process(port, [headers("/v1/completions", **sent), body(REQUEST)])
    common = answers[1].request_body.response
    assert set_headers(common)[DESTINATION] != "10.9.9.9:1"  # the picker's, not the client's
    removed = set(common.header_mutation.remove_headers)
    assert {"x-gateway-destination-endpoint-subset", "x-gateway-inference-objective"} <= removed
    assert DESTINATION not in removed and "x-custom" not in removed


@pytest.mark.parametrize("opted_in", [False, True])
async def test_the_endpoint_header_is_sent_only_when_asked(tokenizer, fleet, opted_in) -> None:
    config = {"kv_events": None, "ext_proc_endpoint_header": opted_in}
    with picker(tokenizer, fleet, **config) as (router, port, _):
        base.wait_for(lambda: len(router.pool.candidates()) == 2)
        status = HeaderMap(headers=[HeaderValue(key=":status", raw_value=b"200")])
        head = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=status))
        answers = await process(port, [headers("/v1/completions"), body(REQUEST), head])
    named = set_headers(answers[2].response_headers.response)
    assert ("x-kvmesh-endpoint" in named) == opted_in


async def health(port: int, service: str, watch: bool = False):
    """grpc.health.v1.Health Check (or Watch's first answer) for service on the ext_proc port."""
    from kvmesh.router.ext_proc_health import HealthCheckRequest, HealthCheckResponse

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = "Watch" if watch else "Check"
        call = (channel.unary_stream if watch else channel.unary_unary)(
            f"/grpc.health.v1.Health/{method}",
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString,
        )
        if watch:
            stream = call(HealthCheckRequest(service=service))
            first = await stream.read()
            stream.cancel()
            return first.status
        return (await call(HealthCheckRequest(service=service))).status


async def test_grpc_health_says_live_and_ready_as_the_picker_is(tokenizer, fleet) -> None:
    from kvmesh.router.ext_proc_health import NOT_SERVING, SERVING

    services = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", "")
    with picker(tokenizer, fleet, kv_events=None) as (router, port, _):
        base.wait_for(lambda: len(router.pool.candidates()) == 2)
        assert [await health(port, s) for s in services] == [SERVING] * 4
        assert await health(port, "readiness", watch=True) == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health(port, "no-such-service")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    dead = ["http://127.0.0.1:9"]  # nothing listens: no endpoint in rotation
    with picker(tokenizer, dead, kv_events=None) as (router, port, _):
        base.wait_for(lambda: router.pool.endpoints and not router.pool.candidates())
        statuses = [await health(port, s) for s in services]
        assert statuses == [SERVING, NOT_SERVING, NOT_SERVING, NOT_SERVING]


@pytest.mark.parametrize("allowed", [0, 1])
def test_real_envoy_forwards_a_subset_hint_the_picker_honours(epp, fleet, allowed: int) -> None:
    """A filter ahead of ext_proc sets the envoy.lb.subset_hint metadata, as a gateway does;
    the shipped config forwards it and every request lands on the one endpoint allowed."""
    router, port, _ = epp
    hint = {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [
                {
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "value": {"x-gateway-destination-endpoint-subset": [address(fleet[allowed])]},
                }
            ],
        },
    }
    with envoy(port, "full-duplex-streamed", filters_before=[hint]) as url:
        for i in range(4):
            code, head, raw = http(url + "/v1/completions", {"prompt": f"p{i}", "max_tokens": 2})
            assert code == 200, raw
            assert head["x-kvmesh-endpoint"] == fleet[allowed]
