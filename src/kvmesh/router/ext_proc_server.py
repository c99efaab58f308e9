"""The ext_proc gRPC server: router.ext_proc's endpoint picker on a port of its own, beside the
router's HTTP port, and its drain."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import (
    add_ExternalProcessorServicer_to_server,
)

from kvmesh.router.ext_proc import EndpointPicker

if TYPE_CHECKING:
    from kvmesh.router.app import Router


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
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return ExtProcServer(server, picker), bound
