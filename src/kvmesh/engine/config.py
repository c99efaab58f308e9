"""EngineConfig: one validated config object for the engine, flags named as vLLM names them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from kvmesh.protocol.auth import validate_key
from kvmesh.protocol.hashing import DEFAULT_BLOCK_SIZE

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
SCHEDULING_POLICIES = ("fcfs", "priority")
PEER_TRANSPORTS = ("auto", "tcp", "shm")
EXPERT_PLACEMENTS = ("linear", "round_robin")
DEFAULT_DP_RPC_PORT = 29550  # vLLM's --data-parallel-rpc-port default


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    served_model_name: str | None = None
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    block_size: int = DEFAULT_BLOCK_SIZE
    num_gpu_blocks: int | None = None  # overrides the memory budget when set
    kv_cache_memory_gib: float = 1.0  # budget for the KV cache when num_gpu_blocks is unset
    max_model_len: int | None = None  # defaults to the model's context length (capped by cache)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no per-request cap inside the token budget
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    scheduling_policy: str = "fcfs"
    max_waiting_requests: int = 1024  # beyond this, new requests get 503 + Retry-After
    # one request's prompts times n past this: 400 before any is tokenized or queued
    max_choices_per_request: int = 256
    max_logprobs: int = 20
    # render templates that requests bring (chat_template, chat_template_kwargs.chat_template)
    trust_request_chat_template: bool = False
    seed: int = 0
    kv_events_config: str | None = None  # JSON as vLLM's --kv-events-config
    kv_transfer_config: str | None = None  # JSON as vLLM's --kv-transfer-config (P/D)
    kv_offloading_size: float | None = None  # GiB of host DRAM for the CPU tier (vLLM's flag)
    kv_offloading_disk_path: str | None = None  # a directory or file for the disk tier
    kv_offloading_disk_size: float = 8.0  # GiB of the disk tier (with a disk path)
    kv_offloading_async: bool = True  # tier loads on a copy worker; False: inline in the step
    kv_peer_allowlist: str | None = None  # comma-separated host:port peers that may be pulled
    kv_peer_transport: str = "auto"  # auto (shm on one host, else tcp), tcp or shm
    data_parallel_size: int = 1
    # given with --data-parallel-size > 1: this server is that one rank (vLLM's external LB);
    # the flag is only set when given (commands.flags), so not giving it means internal LB
    data_parallel_rank: int = field(default=0, metadata={"only_when_given": True})
    data_parallel_address: str = "127.0.0.1"  # where the ranks' process group meets
    data_parallel_rpc_port: int | None = None  # None: a free port (internal LB), else 29550
    enable_expert_parallel: bool = False  # MoE experts sharded over the DP ranks (lockstep)
    expert_placement_strategy: str = "linear"
    enable_eplb: bool = False
    eplb_config: str | None = None  # JSON as vLLM's --eplb-config (dp.eplb_config)
    # where HTTP listens (cli.py's --host, so no generated flag): a wildcard KV event
    # endpoint (tcp://*:PORT) binds this address, never wider
    host: str = "127.0.0.1"
    # Bearer keys, never in repr or logs: the OpenAI routes' (env VLLM_API_KEY); /admin/*'s
    # (unset: not served; KVMESH_ADMIN_API_KEY); /kv_transfer/*'s (unset: api_key, else
    # loopback callers only; KVMESH_KV_TRANSFER_API_KEY)
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    kv_transfer_api_key: str | None = field(default=None, repr=False)
    num_threads: int | None = None  # torch intra-op threads on CPU
    speculative_config: str | None = None  # JSON as vLLM's --speculative-config (engine.spec)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a positive power of two, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError("--num-gpu-blocks must be at least 2")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError("--kv-cache-memory-gib must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be at least 1")
        if self.max_choices_per_request < 1:
            raise ValueError("--max-choices-per-request must be at least 1")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"--prefix-caching-hash-algo must be one of {HASH_ALGOS}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {SCHEDULING_POLICIES}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError("--dtype must be auto, float32, bfloat16 or float16")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must be at least 2")
        if self.kv_offloading_size is not None and self.kv_offloading_size <= 0:
            raise ValueError("--kv-offloading-size must be positive (GiB)")
        if self.kv_offloading_disk_path is not None and self.kv_offloading_disk_size <= 0:
            raise ValueError("--kv-offloading-disk-size must be positive (GiB)")
        for peer in (self.kv_peer_allowlist or "").split(","):
            host, _, port = peer.strip().rpartition(":")
            if peer.strip() and (not host or not port.isdigit()):
                raise ValueError(f"--kv-peer-allowlist entries must be host:port, got {peer!r}")
        if self.kv_peer_transport not in PEER_TRANSPORTS:
            raise ValueError(f"--kv-peer-transport must be one of {PEER_TRANSPORTS}")
        self._check_parallel()
        self.speculative()  # raises ValueError when malformed
        for name in ("api_key", "admin_api_key", "kv_transfer_api_key"):
            validate_key("--" + name.replace("_", "-"), getattr(self, name))
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                "without chunked prefill --max-num-batched-tokens must be >= --max-model-len"
            )

    def _check_parallel(self) -> None:
        from kvmesh.engine.dp.eplb_config import EPLBConfig

        if self.data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be at least 1")
        if self.data_parallel_rank < 0 or (
            self.data_parallel_size > 1 and self.data_parallel_rank >= self.data_parallel_size
        ):
            raise ValueError(
                f"--data-parallel-rank must be in [0, {self.data_parallel_size}), "
                f"got {self.data_parallel_rank}"
            )
        port = self.data_parallel_rpc_port
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"--data-parallel-rpc-port must be a TCP port, got {port}")
        if self.expert_placement_strategy not in EXPERT_PLACEMENTS:
            raise ValueError(f"--expert-placement-strategy must be one of {EXPERT_PLACEMENTS}")
        if self.enable_expert_parallel and self.data_parallel_size < 2:
            raise ValueError(
                "--enable-expert-parallel shards the experts over the data-parallel ranks: "
                "it needs --data-parallel-size 2 or more"
            )
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("--enable-eplb needs --enable-expert-parallel")
        if self.eplb_config is not None and not self.enable_eplb:
            raise ValueError("--eplb-config needs --enable-eplb")
        EPLBConfig.from_json(self.eplb_config)  # raises ValueError when malformed

    def speculative(self):  # -> spec.config.SpeculativeConfig | None
        if self.speculative_config is None:
            return None
        from kvmesh.engine.spec.config import SpeculativeConfig

        return SpeculativeConfig.from_cli(self.speculative_config)

    def eplb(self):  # -> dp.eplb_config.EPLBConfig
        from kvmesh.engine.dp.eplb_config import EPLBConfig

        return EPLBConfig.from_json(self.eplb_config)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def torch_dtype(self):  # -> torch.dtype, imported lazily to keep this module light
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)

    def resolved_threads(self) -> int:
        return self.num_threads or max(1, len(os.sched_getaffinity(0)))
