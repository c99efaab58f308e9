"""The ext_proc gRPC server: Envoy's ExternalProcessor service on a port of its own, beside the
router's HTTP port, each stream one request answered by router.ext_proc; gRPC health
(router.ext_proc_health) on the same port; and its drain."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import (
    ExternalProcessorServicer,
    add_ExternalProcessorServicer_to_server,
)

from kvmesh.router.app import SHUTTING_DOWN
from kvmesh.router.ext_proc import RequestStream
from kvmesh.router.ext_proc_destination import EndpointAddresses
from kvmesh.router.ext_proc_health import PickerHealth
from kvmesh.router.ext_proc_messages import FULL_DUPLEX_STREAMED, immediate
from kvmesh.router.shedding import Shedding, load_objectives

if TYPE_CHECKING:
    from kvmesh.router.app import Router


class EndpointPicker(ExternalProcessorServicer):
    """envoy.service.ext_proc.v3.ExternalProcessor over the router's scheduling pipeline."""

    def __init__(self, router: Router, fail_open: bool = False) -> None:
        self.router, self.fail_open = router, fail_open
        self.address = EndpointAddresses().address
        config = router.config
        objectives = config.inference_objectives
        self.shedding = Shedding(
            load_objectives(objectives) if objectives else {},
            config.saturation_queue_depth_threshold,
            config.saturation_kv_cache_util_threshold,
        )
        self.open_streams = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    async def Process(  # noqa: N802  # the gRPC method's name
        self, requests: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        """One HTTP request's stream: answers in the order of Envoy's messages (streamed bodies
        may hold some back until the body is whole); an immediate response ends it. Whatever
        load was charged is released when the stream ends."""
        if self.draining:  # answered once Envoy has said what it sends (its first message)
            async for _ in requests:
                yield immediate(503, SHUTTING_DOWN, "Retry-After: 1\r\n")
                return
        stream = RequestStream(self.router, self.fail_open, self.address, self.shedding)
        self.open_streams += 1
        self._idle.clear()
        try:
            async for message in requests:
                if message.HasField("protocol_config"):
                    config = message.protocol_config
                    stream.streamed_request = config.request_body_mode == FULL_DUPLEX_STREAMED
                    stream.streamed_response = config.response_body_mode == FULL_DUPLEX_STREAMED
                for answer in await stream.answer(message):
                    yield answer
                    if answer.HasField("immediate_response"):
                        return
        finally:
            stream.end()
            self.open_streams -= 1
            if not self.open_streams:
                self._idle.set()

    def ready(self) -> bool:
        """Whether the picker can pick: as the HTTP port's /health (some endpoint in rotation,
        no KV event subscription refused), and not draining."""
        events = self.router.events
        refused = events is not None and bool(events.refused)
        return not self.draining and not refused and bool(self.router.pool.candidates())

    async def drain(self, timeout: float) -> bool:
        """Answer new streams 503 from now on; wait (at most timeout seconds) for the open
        ones to end. Whether they all did."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


@dataclass(slots=True)
class ExtProcServer:
    """The ext_proc gRPC server and its picker."""

    server: grpc.aio.Server
    picker: EndpointPicker

    async def drain(self, timeout: float) -> bool:
        """New streams refused (503), open ones given up to timeout seconds to end."""
        return await self.picker.drain(timeout)

    async def stop(self, grace: float | None = 0) -> None:
        await self.server.stop(grace)


async def serve_ext_proc(
    router: Router, host: str, port: int, fail_open: bool = False
) -> tuple[ExtProcServer, int]:
    """Start the ext_proc gRPC server on host:port (0: any free port); returns it and the port
    bound. Messages may carry a whole request body: the limit follows --max-body-bytes."""
    size = router.config.max_body_bytes + 2**20
    options = [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]
    server = grpc.aio.server(options=options)
    picker = EndpointPicker(router, fail_open)
    add_ExternalProcessorServicer_to_server(picker, server)
    server.add_generic_rpc_handlers((PickerHealth(picker.ready).handler(),))
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return ExtProcServer(server, picker), bound
