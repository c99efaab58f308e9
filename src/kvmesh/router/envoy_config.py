"""Envoy's configuration with the router as its endpoint picker (router.ext_proc), in either
request body mode the picker serves: ``buffered`` (docs/envoy-ext-proc.yaml) or
``full-duplex-streamed`` (docs/envoy-ext-proc-streamed.yaml, request trailers sent, as the
Gateway API Inference Extension's gateways configure it). Both shipped files are this module's
output; tests hold them to it.

    python -m kvmesh.router.envoy_config --body-mode full-duplex-streamed \\
        --port 8080 --ext-proc-port 9002 > envoy.yaml
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

BODY_MODES = {"buffered": "BUFFERED", "full-duplex-streamed": "FULL_DUPLEX_STREAMED"}
ROUTE_TIMEOUT = "600s"  # a whole answer, a long completion's included
IDLE_TIMEOUT = "300s"  # no byte for this long: a stalled or hung engine's answer is cut
MAX_BODY_BYTES = 32 * 2**20  # the router's --max-body-bytes default
DESTINATION = "x-gateway-destination-endpoint"
ROUND_ROBIN = {
    "name": "envoy.load_balancing_policies.round_robin",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3"
        ".RoundRobin"
    },
}

HEADER = """\
# Envoy in front of model servers, with kvmesh as its endpoint picker (ext_proc), as the
# Gateway API Inference Extension wires an EPP: clients talk to Envoy on {port}; Envoy streams
# each request's headers and body ({mode}) to `kvmesh router --ext-proc-port {ext}`,
# which answers with the header x-gateway-destination-endpoint: IP:PORT (and the same in
# metadata envoy.lb); the ORIGINAL_DST cluster sends the request to that address. Route: a
# 600 s timeout for a whole answer, 300 s idle, connection failures retried.
# Generated: python -m kvmesh.router.envoy_config --body-mode {body_mode}
#
#   kvmesh router --endpoint http://127.0.0.1:8001 --endpoint http://127.0.0.1:8002 \\
#       --port 8000 --ext-proc-port {ext}
#   envoy -c {file} --disable-hot-restart
#   curl localhost:{port}/v1/completions -H 'Content-Type: application/json' \\
#       -d '{{"prompt": "Hello", "max_tokens": 8}}'
"""


def processing_mode(body_mode: str, stream_responses: bool = False) -> dict[str, str]:
    """ext_proc's processing_mode: the request headers and body always; streamed, trailers
    too (Envoy requires the request's with FULL_DUPLEX_STREAMED; the answer's keep the stream
    open to its end) and, with stream_responses, the answer's body as well (the picker passes
    it through unchanged)."""
    mode = BODY_MODES[body_mode]
    streamed = mode == "FULL_DUPLEX_STREAMED"
    return {
        "request_header_mode": "SEND",
        "request_body_mode": mode,
        "request_trailer_mode": "SEND" if streamed else "SKIP",
        # the answer's head: the router counts the prompt as computed and the decision as served
        "response_header_mode": "SEND",
        "response_body_mode": "FULL_DUPLEX_STREAMED" if streamed and stream_responses else "NONE",
        # streamed, Envoy ends the picker's stream after the answer's head unless a later part
        # is still to come: the trailers keep it open, so the load counts to the answer's end
        "response_trailer_mode": "SEND" if streamed else "SKIP",
    }


def envoy_config(
    listen_port: int = 8080,
    ext_proc_port: int = 9002,
    body_mode: str = "buffered",
    stream_responses: bool = False,
    ext_proc_host: str = "127.0.0.1",
    endpoints: list[str] | None = None,
) -> dict[str, Any]:
    """Envoy's bootstrap: a listener on listen_port whose requests the picker on
    ext_proc_host:ext_proc_port routes (to any address, or to one of ``endpoints``, IP:PORT,
    walking the picker's fallbacks on retries)."""
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "kvmesh_epp"}},
        # the picker unreachable: answer 500 rather than let a client-set
        # x-gateway-destination-endpoint choose the upstream
        "failure_mode_allow": False,
        # tokenizing a long prompt (and a P/D prefill leg) happens before the answer
        "message_timeout": "30s",
        "processing_mode": processing_mode(body_mode, stream_responses),
        # the picker's destination in; out, the endpoint that served (when the cluster
        # reports it) and a gateway's subset hint
        "metadata_options": {
            "receiving_namespaces": {"untyped": ["envoy.lb"]},
            "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
        },
    }
    route = {
        "cluster": "model_servers",
        "timeout": ROUTE_TIMEOUT,
        "idle_timeout": IDLE_TIMEOUT,
        # a connection the engine refuses or resets before answering, or its 503, is tried
        # again: at the picker's next fallback endpoint where the cluster takes a list
        "retry_policy": {
            "retry_on": "connect-failure,refused-stream,reset-before-request,"
            "retriable-status-codes",
            "retriable_status_codes": [503],
            "num_retries": 2,
        },
    }
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
        ".v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "models",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}],
                }
            ]
        },
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    listener = {
        "name": "inference",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
        # a BUFFERED body must fit in this buffer (else Envoy answers 413): at most the
        # router's --max-body-bytes
        "per_connection_buffer_limit_bytes": MAX_BODY_BYTES,
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }
    model_servers = model_servers_cluster(endpoints)
    address = {"socket_address": {"address": ext_proc_host, "port_value": ext_proc_port}}
    epp = {  # kvmesh's ext_proc port (gRPC: HTTP/2)
        "name": "kvmesh_epp",
        "type": "STATIC",
        "connect_timeout": "5s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3"
                ".HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "kvmesh_epp",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
        },
    }
    return {"static_resources": {"listeners": [listener], "clusters": [model_servers, epp]}}


def model_servers_cluster(endpoints: list[str] | None) -> dict[str, Any]:
    """The model servers. None: whatever address the picker names, one only (an ORIGINAL_DST
    cluster on the header, the Inference Extension's data path). A list of IP:PORT: those
    servers, the picker's choice and fallbacks taken in order (Envoy's override_host load
    balancing policy on the header or the envoy.lb metadata, which also reports the endpoint
    that served), round robin when the picker names none (--ext-proc-fail-open)."""
    if not endpoints:
        return {
            "name": "model_servers",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        }
    hosts = []
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        address = {"address": host.strip("[]"), "port_value": int(port)}
        hosts.append({"endpoint": {"address": {"socket_address": address}}})
    metadata_key = {"key": "envoy.lb", "path": [{"key": DESTINATION}]}
    override = {
        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3"
        ".OverrideHost",
        "override_host_sources": [{"header": DESTINATION}, {"metadata": metadata_key}],
        "selected_host_key": {"key": "envoy.lb", "path": [{"key": f"{DESTINATION}-served"}]},
        "fallback_policy": {"policies": [{"typed_extension_config": ROUND_ROBIN}]},
    }
    return {
        "name": "model_servers",
        "type": "STATIC",
        "connect_timeout": "5s",
        "load_assignment": {
            "cluster_name": "model_servers",
            "endpoints": [{"lb_endpoints": hosts}],
        },
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": override,
                    }
                }
            ]
        },
    }


def shipped_file(body_mode: str) -> str:
    return (
        "docs/envoy-ext-proc.yaml"
        if body_mode == "buffered"
        else "docs/envoy-ext-proc-streamed.yaml"
    )


def render(
    listen_port: int = 8080,
    ext_proc_port: int = 9002,
    body_mode: str = "buffered",
    stream_responses: bool = False,
    endpoints: list[str] | None = None,
) -> str:
    """envoy_config as commented YAML (the shipped files: the defaults, per body mode)."""
    config = envoy_config(
        listen_port, ext_proc_port, body_mode, stream_responses, endpoints=endpoints
    )
    header = HEADER.format(
        port=listen_port,
        ext=ext_proc_port,
        mode=BODY_MODES[body_mode],
        body_mode=body_mode,
        file=shipped_file(body_mode),
    )
    return header + yaml.safe_dump(config, sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Envoy's configuration with kvmesh as its picker.")
    p.add_argument("--body-mode", choices=sorted(BODY_MODES), default="buffered")
    p.add_argument("--port", type=int, default=8080, help="Envoy's listener port.")
    p.add_argument("--ext-proc-port", type=int, default=9002, help="The router's ext_proc port.")
    p.add_argument(
        "--stream-responses",
        action="store_true",
        help="full-duplex-streamed: stream the answers' bodies through the picker too.",
    )
    p.add_argument(
        "--endpoint",
        action="append",
        default=None,
        help="A model server's IP:PORT (repeat): route to these, walking the picker's fallback "
        "endpoints on retries (default: any address the picker names, one only).",
    )
    args = p.parse_args(argv)
    text = render(
        args.port, args.ext_proc_port, args.body_mode, args.stream_responses, args.endpoint
    )
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
