"""The router's own Prometheus metrics."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_SCHED_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._children: dict[tuple[str, str], Any] = {}
        self.requests = Counter(
            "kvmesh_router_requests",
            "Requests by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "kvmesh_router_retries",
            "Retries on another endpoint before the first byte.",
            registry=r,
        )
        self.scheduling = Histogram(
            "kvmesh_router_scheduling_seconds",
            "Time to tokenize and schedule one request.",
            buckets=_SCHED_BUCKETS,
            registry=r,
        )
        self.predicted_cached = Counter(
            "kvmesh_router_predicted_cached_tokens",
            "Prompt tokens the chosen endpoint was predicted to hold.",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvmesh_router_prompt_tokens", "Prompt tokens routed.", registry=r
        )
        self.peer_sourced = Counter(
            "kvmesh_router_kv_peer_sourced_requests",
            "Requests forwarded naming a peer endpoint (source) to pull their KV prefix from.",
            ["source"],
            registry=r,
        )
        self.peer_lead_tokens = Counter(
            "kvmesh_router_kv_peer_lead_tokens",
            "Prompt tokens the named sources were predicted to hold beyond the chosen endpoint.",
            registry=r,
        )
        self.index_entries = Gauge(
            "kvmesh_router_index_entries", "Entries in a prefix index.", ["index"], registry=r
        )
        self.event_lag = Gauge(
            "kvmesh_router_kv_event_lag_seconds",
            "Receive time minus the timestamp of the last KV event batch.",
            registry=r,
        )
        self.healthy = Gauge(
            "kvmesh_router_endpoint_healthy",
            "1 when the endpoint is healthy.",
            ["endpoint"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvmesh_router_endpoint_in_flight",
            "Requests in flight through the router.",
            ["endpoint"],
            registry=r,
        )

    def count(self, endpoint: str, outcome: str) -> None:
        """requests{endpoint, outcome} += 1, through a cache of the labelled children."""
        child = self._children.get((endpoint, outcome))
        if child is None:
            child = self._children[endpoint, outcome] = self.requests.labels(endpoint, outcome)
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
