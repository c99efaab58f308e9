"""The router's settings (one flag each, `kvmesh router --help`), validated once, apart from the
router itself so that `kvmesh router --help` and `kvmesh up --help` read them without importing
the router's request path."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.protocol.auth import bearer, validate_key
from kvmesh.router.outlier import OutlierDetection


@dataclass(slots=True)
class RouterConfig:
    endpoints: list[str] = field(default_factory=list)
    endpoints_file: str | None = None
    # Kubernetes discovery (router.k8s_discovery): the ready pods of an InferencePool, or of a
    # label selector on k8s_target_port, in k8s_namespace (default: the service account's or
    # the kubeconfig context's); kubeconfig None: in-cluster config when in a pod
    k8s_inference_pool: str | None = None
    k8s_selector: str | None = None
    k8s_target_port: int = 8000
    k8s_namespace: str | None = None
    kubeconfig: str | None = None
    scheduler_config: str | None = None  # EndpointPickerConfig YAML file
    preset: str = "kvmesh"
    tokenizer: str | None = None  # None: the embedded default model's tokenizer
    served_model_name: str | None = None  # the model clients ask for: every engine must serve it
    # refuse engines of another model or tokenizer (router.engine_model); off: route to them
    engine_model_check: bool = True
    block_size: int | None = None  # the engines' KV block size; None: learned from them
    prefix_caching_hash_algo: str = "sha256"
    kv_events: str | None = "auto"  # "auto": ask each endpoint's /kv_event_sources; None: off
    scrape_interval: float = 0.1
    max_retries: int = 2
    max_body_bytes: int = 32 * 2**20
    # one request's prompts times n past this: 400 before its prompt is tokenized or forwarded
    max_choices_per_request: int = 256
    index_capacity: int = 2_000_000
    approx_capacity_per_endpoint: int = 31_250
    # before the first byte an endpoint that is silent too long is left for another; a streaming
    # answer's head comes with its first token, a non-streaming one's with the whole completion
    first_byte_timeout: float = 60.0
    non_streaming_first_byte_timeout: float = 300.0
    stream_idle_timeout: float = 30.0  # mid-answer silence that cuts it; 0: never
    # outlier detection (Envoy's consecutive_5xx): see outlier.OutlierDetection
    outlier_consecutive_errors: int = 5
    outlier_base_ejection_time: float = 30.0
    outlier_max_ejection_time: float = 300.0
    outlier_max_ejection_percent: float = 50.0
    # Envoy's healthy_panic_threshold: below this percent in rotation, route over all that answer
    healthy_panic_threshold: float = 50.0
    prefill_max_retries: int = 0  # P/D: prefill attempts beyond the first before falling back
    # a server whose /metrics shows several engine="<rank>" series: one endpoint per rank
    discover_data_parallel: bool = True
    # peer sharing: name another endpoint as the chosen one's KV source when it holds at least
    # this many more leading prompt tokens (precise index); 0: off
    kv_peer_min_cached_token_delta: int = 0
    # requests that arrive this soon after start wait (at most that long) for the engines'
    # KV-event replay to fill the precise index, so a restarted router routes as before; 0: off
    kv_index_warmup_timeout: float = 1.0
    # render templates that requests bring (chat_template, chat_template_kwargs.chat_template)
    trust_request_chat_template: bool = False
    # Envoy's ext_proc (router.ext_proc): the gRPC port Envoy asks for each request's endpoint
    # (None: not served); with no endpoint to name, let Envoy route by its own configuration
    # (fail open) instead of answering 503 (fail closed)
    ext_proc_port: int | None = None
    ext_proc_fail_open: bool = False
    # endpoints named after the chosen one in x-gateway-destination-endpoint (IP:PORT,IP:PORT),
    # the Inference Extension's fallbacks, which a gateway's retries walk in order
    ext_proc_fallback_endpoints: int = 0
    # name the endpoint that served in an x-kvmesh-endpoint answer header (an internal address:
    # off unless asked for)
    ext_proc_endpoint_header: bool = False
    # ext_proc load shedding (router.shedding): InferenceObjective manifests giving requests
    # their priority; a negative one is answered 429 while no endpoint has capacity (fewer
    # waiting than the queue threshold and KV cache usage under the utilization threshold)
    inference_objectives: str | None = None
    saturation_queue_depth_threshold: float = 5.0
    saturation_kv_cache_util_threshold: float = 0.8
    # on SIGTERM: seconds the answers and ext_proc streams in progress get to finish while new
    # requests are refused (503); 0: stop at once
    shutdown_timeout: float = 30.0
    # Bearer keys, never in repr or logs: the one clients must send on /v1/* (unset: none);
    # the one sent to endpoints in place of the client's Authorization (unset: api_key; with
    # neither, the client's header passes through)
    api_key: str | None = field(default=None, repr=False)
    endpoint_api_key: str | None = field(default=None, repr=False)

    def outlier_detection(self) -> OutlierDetection:
        return OutlierDetection(
            self.outlier_consecutive_errors,
            self.outlier_base_ejection_time,
            self.outlier_max_ejection_time,
            self.outlier_max_ejection_percent,
            self.healthy_panic_threshold,
        )

    def __post_init__(self) -> None:
        for name in ("first_byte_timeout", "non_streaming_first_byte_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.stream_idle_timeout < 0:
            raise ValueError("--stream-idle-timeout must be 0 (never) or positive")
        self.outlier_detection()  # validates the outlier fields
        if self.max_choices_per_request < 1:
            raise ValueError("--max-choices-per-request must be at least 1")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"--block-size must be positive, got {self.block_size}")
        validate_key("--api-key", self.api_key)
        validate_key("--endpoint-api-key", self.endpoint_api_key)
        if self.kv_index_warmup_timeout < 0:
            raise ValueError("--kv-index-warmup-timeout must be 0 (off) or positive")
        if self.kv_peer_min_cached_token_delta < 0:
            raise ValueError("--kv-peer-min-cached-token-delta must be 0 (off) or positive")
        if self.k8s_inference_pool and self.k8s_selector:
            raise ValueError("give one of --k8s-inference-pool and --k8s-selector")
        if self.k8s_selector:
            from kvmesh.router.k8s_discovery import parse_selector  # aiohttp: only when given

            parse_selector(self.k8s_selector)
        if self.endpoints_file and (self.k8s_inference_pool or self.k8s_selector):
            raise ValueError("--endpoints-file and Kubernetes discovery cannot both own the pool")
        if not 0 < self.k8s_target_port < 65536:
            raise ValueError(f"--k8s-target-port must be a port, got {self.k8s_target_port}")
        if self.ext_proc_fallback_endpoints < 0:
            raise ValueError("--ext-proc-fallback-endpoints must be 0 (none) or positive")
        if self.saturation_queue_depth_threshold <= 0:
            raise ValueError("--saturation-queue-depth-threshold must be positive")
        if not 0 < self.saturation_kv_cache_util_threshold <= 1:
            raise ValueError("--saturation-kv-cache-util-threshold must be in (0, 1]")
        if self.shutdown_timeout < 0:
            raise ValueError("--shutdown-timeout must be 0 (stop at once) or positive")
        if self.ext_proc_port is not None and not 0 <= self.ext_proc_port < 65536:
            raise ValueError(f"--ext-proc-port must be a port number, got {self.ext_proc_port}")

    def upstream_authorization(self, client: str | None) -> str | None:
        """The Authorization sent to endpoints: the endpoint key (default: api_key), else the
        client's own header (`client`) as it came."""
        key = self.endpoint_api_key or self.api_key
        return bearer(key) if key else client
