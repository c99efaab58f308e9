"""Prometheus metrics under vLLM's names and labels (model_name, engine)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class EngineMetrics:
    def __init__(self, model_name: str, engine: str = "0") -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": engine}
        names = list(self.labels)
        r = self.registry

        # children bound to this engine's labels, so the hot path does no label lookups
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(**self.labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(**self.labels)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**self.labels)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._request_success = Counter(
            "vllm:request_success",
            "Count of finished requests.",
            names + ["finished_reason"],
            registry=r,
        )
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS)
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "End to end request latency.", _E2E_BUCKETS
        )
        self.queue_time = hist(
            "vllm:request_queue_time_seconds", "Time spent waiting in the queue.", _E2E_BUCKETS
        )
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "Information of the cache config.",
            [
                "block_size",
                "enable_prefix_caching",
                "num_gpu_blocks",
                "prefix_caching_hash_algo",
                "cache_dtype",
            ],
            registry=r,
        )

        tier = names + ["medium"]
        self.offload_usage = Gauge(
            "kvmesh:kv_offload_usage_perc",
            "Offload tier usage (CPU: host DRAM, DISK). 1 means 100 percent.",
            tier,
            registry=r,
        )
        self.offload_hits = Counter(
            "kvmesh:kv_offload_hits",
            "Prefix tokens loaded from an offload tier instead of recomputed.",
            tier,
            registry=r,
        )
        self.offload_bytes = Counter(
            "kvmesh:kv_offload_bytes",
            "KV bytes moved into (store) and out of (load) an offload tier.",
            tier + ["direction"],
            registry=r,
        )

        self.offload_copy_seconds = counter(
            "kvmesh:kv_offload_copy_seconds",
            "Seconds the engine thread spent in tier copies (synchronous on CPU).",
        )
        self.peer_pulls = Counter(
            "kvmesh:kv_peer_pulls",
            "Pulls of prefix blocks from a peer engine, by outcome (ok, miss, failed, refused).",
            names + ["outcome"],
            registry=r,
        )
        self.peer_transfers = Counter(
            "kvmesh:kv_peer_transfers",
            "Payloads peer pulls received, by transport (shm: a shared-memory segment on this "
            "host; tcp: the HTTP body) and outcome (ok: imported; failed: refused on import; "
            "unreadable: a segment that could not be mapped, asked again over tcp).",
            names + ["transport", "outcome"],
            registry=r,
        )
        self.peer_tokens = counter(
            "kvmesh:kv_peer_pulled_tokens", "Prompt tokens imported from peers, not computed."
        )

    def record_tier(self, medium: str, usage: float, traffic) -> None:
        """Usage of one tier and what moved since the last call (an offload.TierTraffic)."""
        self.offload_usage.labels(**self.labels, medium=medium).set(usage)
        if traffic.hit_tokens:
            self.offload_hits.labels(**self.labels, medium=medium).inc(traffic.hit_tokens)
        for direction, n in (("load", traffic.loaded_bytes), ("store", traffic.stored_bytes)):
            if n:
                self.offload_bytes.labels(**self.labels, medium=medium, direction=direction).inc(n)

    def set_cache_config(
        self,
        block_size: int,
        prefix_caching: bool,
        num_blocks: int,
        hash_algo: str,
        cache_dtype: str,
    ) -> None:
        self.cache_config.labels(
            block_size=str(block_size),
            enable_prefix_caching=str(prefix_caching),
            num_gpu_blocks=str(num_blocks),
            prefix_caching_hash_algo=hash_algo,
            cache_dtype=cache_dtype,
        ).set(1)

    def request_finished(self, reason: str) -> None:
        self._request_success.labels(**self.labels, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
