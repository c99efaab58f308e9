"""The router's own Prometheus metrics."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

_SCHED_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class LoopHistogram:
    """A Prometheus histogram without labels, observed on the event loop alone (so no lock):
    one count per bucket (the last: +Inf) and the sum, read out when the registry is
    collected. Invariant: counts[i] is the observations in (bounds[i-1], bounds[i]]."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation)
        total, buckets = 0, []
        for bound, n in zip([*self.bounds, float("inf")], self.counts, strict=True):
            total += n
            buckets.append((floatToGoString(bound), total))
        family.add_metric([], buckets, self.sum)
        yield family


class LoopCounter:
    """A Prometheus counter without labels, incremented on the event loop alone (so no lock:
    an eighth of a locked counter's cost, paid per request)."""

    def __init__(self, name: str, documentation: str, registry) -> None:
        self.name, self.documentation = name, documentation
        self.value = 0.0
        registry.register(self)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, value=self.value)


class LoopLabelledCounter:
    """A Prometheus counter with labels, incremented on the event loop alone (so no lock): a
    count per tuple of label values, read out when the registry is collected."""

    def __init__(
        self, name: str, documentation: str, labelnames: tuple[str, ...], registry
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self.counts: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self.counts[labels] = self.counts.get(labels, 0.0) + amount

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, count in self.counts.items():
            family.add_metric(values, count)
        yield family


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = LoopLabelledCounter(
            "kvmesh_router_requests",
            "Requests by endpoint and outcome.",
            ("endpoint", "outcome"),
            r,
        )
        self.retries = Counter(
            "kvmesh_router_retries",
            "Retries on another endpoint before the first byte.",
            registry=r,
        )
        self.scheduling = LoopHistogram(
            "kvmesh_router_scheduling_seconds",
            "Time to tokenize and schedule one request.",
            _SCHED_BUCKETS,
            r,
        )
        self.predicted_cached = LoopCounter(
            "kvmesh_router_predicted_cached_tokens",
            "Prompt tokens the chosen endpoint was predicted to hold.",
            r,
        )
        self.prompt_tokens = LoopCounter("kvmesh_router_prompt_tokens", "Prompt tokens routed.", r)
        self.peer_sourced = Counter(
            "kvmesh_router_kv_peer_sourced_requests",
            "Requests forwarded naming a peer endpoint (source) to pull their KV prefix from.",
            ["source"],
            registry=r,
        )
        self.peer_lead_tokens = LoopCounter(
            "kvmesh_router_kv_peer_lead_tokens",
            "Prompt tokens the named sources were predicted to hold beyond the chosen endpoint.",
            r,
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

        # resilience: what a chaos run reads to time ejection, re-admission and index warm-up
        self.ejections = Counter(
            "kvmesh_router_endpoint_ejections",
            "Endpoints taken out of rotation, by reason: unreachable (a connect or scrape "
            "failed), or outlier detection after requests failed in a row (5xx or timeout: "
            "the last failure).",
            ["endpoint", "reason"],
            registry=r,
        )
        self.readmissions = Counter(
            "kvmesh_router_endpoint_readmissions",
            "Endpoints back in rotation, by reason: reachable (a scrape succeeded again) or "
            "ejection_expired.",
            ["endpoint", "reason"],
            registry=r,
        )
        self.ejected = Gauge(
            "kvmesh_router_endpoint_ejected",
            "1 while outlier detection keeps the endpoint out of rotation.",
            ["endpoint"],
            registry=r,
        )
        self.healthy_panic = Gauge(
            "kvmesh_router_healthy_panic",
            "1 while fewer endpoints than --healthy-panic-threshold percent are in rotation, "
            "so requests go to every endpoint that answers, ejected or not (Envoy's panic).",
            registry=r,
        )
        self.kv_event_replays = Counter(
            "kvmesh_router_kv_event_replays",
            "KV event replays applied from an endpoint's replay socket, by reason: start (a new "
            "subscription), reconnect, gap (a batch was missed), restart (the publisher's "
            "sequence began again: the endpoint's entries were cleared first).",
            ["endpoint", "reason"],
            registry=r,
        )
        self.kv_event_replayed_batches = Counter(
            "kvmesh_router_kv_event_replayed_batches",
            "KV event batches applied from replays.",
            ["endpoint"],
            registry=r,
        )
        self.kv_index_warm = Gauge(
            "kvmesh_router_kv_index_warm",
            "1 once the precise index holds the endpoint's KV event history (its publisher's "
            "replay buffer applied, live events following); 0 before, and after a loss.",
            ["endpoint"],
            registry=r,
        )
        self.kv_index_warm_seconds = Gauge(
            "kvmesh_router_kv_index_warm_seconds",
            "Seconds from subscribing to the endpoint's KV events (or from its loss) to warm.",
            ["endpoint"],
            registry=r,
        )

        # the KV block size prompts are keyed with (router.block_size) and who disagrees
        self.block_size = Gauge(
            "kvmesh_router_block_size",
            "The KV block size the router keys prompts with: --block-size, else learned from "
            "the engines (vllm:cache_config_info), else 16 until one reports it.",
            registry=r,
        )
        self.block_size_mismatch = Gauge(
            "kvmesh_router_endpoint_block_size_mismatch",
            "1 while the endpoint is out of rotation because its KV block size (its /metrics "
            "vllm:cache_config_info) is not the router's; 0 when they agree.",
            ["endpoint"],
            registry=r,
        )
        self.kv_events_refused = Gauge(
            "kvmesh_router_kv_events_refused",
            "1 while the router cannot take the endpoint's KV events: the address its publisher "
            "connects to cannot be bound here (held by another process, such as a second router "
            "replica, or by another endpoint, or not this host's); /health answers 503 meanwhile.",
            ["endpoint"],
            registry=r,
        )
        self.kv_events_dropped = Counter(
            "kvmesh_router_kv_events_dropped",
            "KV events left out of the precise index, by reason: block_size (a BlockStored "
            "keyed in another block size than the router's).",
            ["endpoint", "reason"],
            registry=r,
        )

    def count(self, endpoint: str, outcome: str) -> None:
        """requests{endpoint, outcome} += 1 (on the event loop)."""
        self.requests.inc((endpoint, outcome))

    def render(self) -> bytes:
        return generate_latest(self.registry)
