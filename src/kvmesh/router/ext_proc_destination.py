"""Where the endpoint picker (router.ext_proc) sends a request, in the Gateway API Inference
Extension's words: endpoints as IP:PORT (host names resolved), the fallbacks after the chosen
endpoint in the order its scores rank them, and the endpoint Envoy reports serving."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint
    from kvmesh.router.pipeline import SchedulingResult

DESTINATION = "x-gateway-destination-endpoint"  # header and metadata key (EPP protocol)
METADATA_NAMESPACE = "envoy.lb"
SERVED = "x-gateway-destination-endpoint-served"  # metadata key: the endpoint that served
SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # metadata the gateway may send: pick among these
SUBSET = "x-gateway-destination-endpoint-subset"
RESERVED_PREFIX = "x-gateway-"  # the gateway's and the picker's headers, never a client's
ADDRESS_TTL = 30.0  # seconds a resolved endpoint host is reused (ORIGINAL_DST wants an IP)


class EndpointAddresses:
    """Endpoints' IP:PORT, host names resolved and kept ADDRESS_TTL seconds."""

    def __init__(self) -> None:
        self._addresses: dict[str, tuple[str, float]] = {}  # host -> (IP, expiry)

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


def ranked_after(result: SchedulingResult, chosen: Endpoint) -> list[Endpoint]:
    """The endpoints the profile that chose ``chosen`` scored, best weighted total first (ties
    in the candidates' order), ``chosen`` left out: the fallbacks in the order to try them."""
    for profile in result.profiles.values():
        if profile.endpoint is chosen:
            ranked = sorted(range(len(profile.endpoints)), key=lambda i: -profile.total_values[i])
            return [profile.endpoints[i] for i in ranked if profile.endpoints[i] is not chosen]
    return []


def served_by(message: pb.ProcessingRequest) -> str | None:
    """The address Envoy reports as the one that served (envoy.lb metadata, forwarded)."""
    namespace = message.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
    if namespace is None or SERVED not in namespace.fields:
        return None
    return namespace.fields[SERVED].string_value


def subset_hint(message: pb.ProcessingRequest) -> set[str] | None:
    """The endpoints (IP:PORT, or an IP for all its ports) the gateway allows for this
    request, from the envoy.lb.subset_hint metadata; None: no hint, any endpoint."""
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET not in namespace.fields:
        return None
    value = namespace.fields[SUBSET]
    if value.WhichOneof("kind") == "list_value":
        items = [v.string_value for v in value.list_value.values]
    else:  # one string, comma-separated
        items = value.string_value.split(",")
    return {item.strip() for item in items if item.strip()}


def in_subset(address: str, subset: set[str]) -> bool:
    """Whether IP:PORT address is one the subset allows (its IP alone allows every port)."""
    host = address.rpartition(":")[0]
    return address in subset or host in subset or host.strip("[]") in subset
