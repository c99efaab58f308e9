"""Builds a ready engine from an EngineConfig: model, tokenizer, block pool, scheduler, events."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec

from kvmesh.engine import load_progress
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.auth import EngineKeys
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.core import EngineCore
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.kv_loads import AsyncKVLoads
from kvmesh.engine.kv_transfer import KVTransferConfig
from kvmesh.engine.metrics import EngineMetrics
from kvmesh.engine.runner import ModelRunner
from kvmesh.engine.scheduler import Scheduler, SchedulerConfig
from kvmesh.engine.serving import OpenAIServing
from kvmesh.engine.tiers import MEDIUM_CPU, MEDIUM_DISK
from kvmesh.protocol.tokenizer import DEFAULT_MODEL_NAME, is_default_model
from kvmesh.protocol.zmq_events import KVEventsConfig, make_event_publisher

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineBundle:
    config: EngineConfig
    engine: AsyncEngine
    serving: OpenAIServing
    tokenizer: object
    metrics: EngineMetrics
    model_name: str
    model_path: str
    max_model_len: int
    kv_events_dict: dict | None
    publisher: object
    created: int = field(default_factory=lambda: int(time.time()))
    faults: object | None = None  # a FaultInjector on emulated engines

    def close(self) -> None:
        self.engine.shutdown()
        self.publisher.close()
        close_runner = getattr(self.engine.core.runner, "close", None)
        if close_runner is not None:  # a disk tier's file goes with the engine
            close_runner()


def assemble(
    config: EngineConfig,
    runner: ModelRunner,
    tokenizer,
    model_name: str,
    model_path: str,
    eos_token_ids: tuple[int, ...],
) -> EngineBundle:
    """Wire the device-free core around any runner (torch today, emulated later)."""
    events_cfg = (
        KVEventsConfig.from_json(config.kv_events_config)
        if config.kv_events_config
        else KVEventsConfig()
    )
    # a wildcard endpoint binds only where HTTP listens: events carry token ids (prompts)
    publisher = make_event_publisher(events_cfg, config.data_parallel_rank, config.host)
    kv = KVCacheManager(
        runner.num_blocks,
        config.block_size,
        enable_caching=config.enable_prefix_caching,
        hash_algo=config.prefix_caching_hash_algo,
        enable_events=events_cfg.enable_kv_cache_events,
    )
    sched_cfg = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=runner.max_model_len,
        enable_chunked_prefill=config.enable_chunked_prefill,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        policy=config.scheduling_policy,
    )
    name = config.served_model_name or model_name
    metrics = EngineMetrics(name, str(config.data_parallel_rank))
    metrics.set_cache_config(
        config.block_size,
        config.enable_prefix_caching,
        runner.num_blocks,
        config.prefix_caching_hash_algo,
        str(config.dtype),
    )
    core = EngineCore(Scheduler(sched_cfg, kv), runner, tokenizer, metrics, publisher.publish)
    spec = config.speculative()
    if spec is not None:
        core.speculator = make_speculator(spec, runner, metrics, sched_cfg)
    if config.kv_transfer_config:
        core.transfer_config = KVTransferConfig.from_json(config.kv_transfer_config)
        core.held.timeout = core.transfer_config.hold_timeout_s
    tiers = tier_slots(config, core.transfer_config, runner.kv_bytes_per_block)
    if tiers and config.enable_prefix_caching:
        runner.init_tiers(dict(tiers), config.kv_offloading_disk_path)
        offloader = kv.enable_offloading(tiers, runner, runner.kv_bytes_per_block)
        if config.kv_offloading_async:
            kv.loads = AsyncKVLoads(kv, runner.copy_worker(offloader.run_loads))
        logger.info("KV offload tiers: %s", ", ".join(f"{m} {n} blocks" for m, n in tiers))
    engine = AsyncEngine(core, config.max_waiting_requests)
    serving = OpenAIServing(
        engine, tokenizer, name, runner.max_model_len, eos_token_ids, config.max_logprobs
    )
    serving.transfer_key = EngineKeys.of(config).kv_transfer
    serving.max_choices_per_request = config.max_choices_per_request
    events_dict = msgspec.to_builtins(events_cfg) if events_cfg.enable_kv_cache_events else None
    return EngineBundle(
        config,
        engine,
        serving,
        tokenizer,
        metrics,
        name,
        model_path,
        runner.max_model_len,
        events_dict,
        publisher,
    )


def make_speculator(spec, runner: ModelRunner, metrics: EngineMetrics, sched_cfg):
    """The runner's proposer for a --speculative-config, its counters on the engine's registry;
    the scheduler reserves the slots the proposer writes ahead of the target."""
    from kvmesh.engine.spec.metrics import SpecDecodingProm
    from kvmesh.engine.spec.speculator import Speculator

    spec.resolve(getattr(getattr(runner, "model_config", None), "num_nextn_predict_layers", 0))
    proposer = runner.proposer(spec)
    sched_cfg.num_lookahead_tokens = getattr(proposer, "num_lookahead_tokens", 0)
    prom = SpecDecodingProm(metrics.registry, metrics.labels, spec.num_speculative_tokens)
    logger.info("speculative decoding: %s", spec.to_dict())
    return Speculator(spec, proposer, runner.max_model_len, prom)


def tier_slots(
    config: EngineConfig, transfer: KVTransferConfig, bytes_per_block: int
) -> list[tuple[str, int]]:
    """[(medium, slots)] of the offload tiers, top first: host DRAM from --kv-offloading-size or
    an OffloadingConnector's cpu_bytes_to_use (num_cpu_blocks in older configs), then disk."""
    if bytes_per_block <= 0:
        return []
    offloading = transfer.kv_connector == "OffloadingConnector"
    extra = transfer.kv_connector_extra_config if offloading else {}
    tiers = []
    if config.kv_offloading_size is not None:
        cpu_slots = int(config.kv_offloading_size * 2**30) // bytes_per_block
    elif "cpu_bytes_to_use" in extra:
        cpu_slots = int(extra["cpu_bytes_to_use"]) // bytes_per_block
    else:
        cpu_slots = int(extra.get("num_cpu_blocks", 0))
    if cpu_slots > 0:
        tiers.append((MEDIUM_CPU, cpu_slots))
    if config.kv_offloading_disk_path:
        disk_slots = int(config.kv_offloading_disk_size * 2**30) // bytes_per_block
        if disk_slots > 0:
            tiers.append((MEDIUM_DISK, disk_slots))
    return tiers


def build_engine(config: EngineConfig, expert_parallel=None) -> EngineBundle:
    """expert_parallel: this data-parallel rank's models.expert_parallel.ExpertParallelConfig
    (a MoE model then loads only the experts the rank holds)."""
    t0 = time.perf_counter()
    if is_default_model(config.model):
        logger.info(
            "loading the embedded %s on %s (can take a minute on a busy small CPU)...",
            DEFAULT_MODEL_NAME,
            config.device,
        )
    else:
        logger.info("loading %s on %s...", config.model, config.device)
    import torch

    from kvmesh.engine.models.loader import load_model
    from kvmesh.engine.torch_runner import TorchRunner

    if config.device == "cpu":
        torch.set_num_threads(config.resolved_threads())
    torch.manual_seed(config.seed)
    extra = {} if expert_parallel is None else {"expert_parallel": expert_parallel}
    loaded = load_model(config.model, device=config.device, dtype=config.torch_dtype(), **extra)
    logger.info("loaded %s in %.1fs", loaded.name, time.perf_counter() - t0)
    load_progress.step("allocating the KV cache")
    runner = TorchRunner(config, loaded)
    eos = tuple(loaded.config.eos_token_ids)
    return assemble(config, runner, loaded.tokenizer, loaded.name, str(loaded.path), eos)
