"""The gRPC Health Checking Protocol (grpc.health.v1.Health) on the ext_proc port, with the
services the Gateway API Inference Extension names for an endpoint picker: ``liveness`` (the
process answers), ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` (it can pick:
some endpoint in rotation, not draining), and ``""`` (the server as a whole: as readiness).

The two messages are declared here through protobuf's descriptor API (the schema of
grpc/health/v1/health.proto, in a pool of their own), so the router needs no further package.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE = "grpc.health.v1.Health"
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
WATCH_INTERVAL = 1.0  # seconds between a Watch's looks at the status


def _messages() -> tuple[type, type]:
    field = descriptor_pb2.FieldDescriptorProto
    schema = descriptor_pb2.FileDescriptorProto(
        name="grpc/health/v1/health.proto", package="grpc.health.v1", syntax="proto3"
    )
    request = schema.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    response = schema.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for number, name in enumerate(("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")):
        status.value.add(name=name, number=number)
    response.field.add(
        name="status",
        number=1,
        type=field.TYPE_ENUM,
        label=field.LABEL_OPTIONAL,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(schema)
    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{schema.package}.{name}"))
        for name in ("HealthCheckRequest", "HealthCheckResponse")
    )  # type: ignore[return-value]


HealthCheckRequest, HealthCheckResponse = _messages()
SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3


class PickerHealth:
    """Check and Watch over ``ready()``: whether the picker can pick now."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self.ready = ready

    def status(self, service: str) -> int:
        if service == "liveness":
            return SERVING
        if service in ("", "readiness", EXT_PROC):
            return SERVING if self.ready() else NOT_SERVING
        return SERVICE_UNKNOWN

    async def check(self, request, context: grpc.aio.ServicerContext):
        status = self.status(request.service)
        if status == SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return HealthCheckResponse(status=status)

    async def watch(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        """The status now, then each change, until the caller leaves."""
        last = None
        while True:
            status = self.status(request.service)
            if status != last:
                last = status
                yield HealthCheckResponse(status=status)
            await asyncio.sleep(WATCH_INTERVAL)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Check": grpc.unary_unary_rpc_method_handler(
                    self.check,
                    request_deserializer=HealthCheckRequest.FromString,
                    response_serializer=HealthCheckResponse.SerializeToString,
                ),
                "Watch": grpc.unary_stream_rpc_method_handler(
                    self.watch,
                    request_deserializer=HealthCheckRequest.FromString,
                    response_serializer=HealthCheckResponse.SerializeToString,
                ),
            },
        )
