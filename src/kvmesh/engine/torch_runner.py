"""TorchRunner: runs the model (CPU or CUDA) over the paged KV cache and samples."""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings

import torch

from kvmesh.engine.attention import AttentionMetadata, allocate_kv_cache, kv_cache_bytes_per_block
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.kv_loads import ThreadCopyWorker
from kvmesh.engine.runner import ModelRunner, SampledTokens, blocked_tokens
from kvmesh.engine.sampler import Sampler
from kvmesh.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvmesh.engine.sequence import Request
from kvmesh.engine.tier_storage import DiskTierStorage, HostTierStorage

logger = logging.getLogger(__name__)


class TorchRunner(ModelRunner):
    def __init__(self, config: EngineConfig, loaded) -> None:
        self.config = config
        self.model = loaded.model
        self.model_config = loaded.config
        self.model_path = getattr(loaded, "path", None)  # an HF directory holds its MTP layers
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype()
        per_block = kv_cache_bytes_per_block(self.model_config, config.block_size, self.dtype)
        self.kv_bytes_per_block = per_block
        self.tiers: dict[str, HostTierStorage | DiskTierStorage] = {}
        self.copy_seconds = 0.0  # time spent in tier copies (synchronous on CPU)
        self._copy_lock = threading.Lock()  # copy_seconds is also added to by the copy worker
        if config.num_gpu_blocks is not None:
            self.num_blocks = config.num_gpu_blocks
        else:
            self.num_blocks = max(2, int(config.kv_cache_memory_gib * 2**30) // per_block)
        self.kv_caches = allocate_kv_cache(
            self.model_config, self.num_blocks, config.block_size, self.device, self.dtype
        )
        model_len = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.max_model_len = min(self.max_model_len, self.num_blocks * config.block_size)
        self.sampler = Sampler()
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), max_model_len %d",
            self.num_blocks,
            config.block_size,
            self.num_blocks * per_block / 2**20,
            self.max_model_len,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> SampledTokens:
        bs = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        samplers: list[Request] = []
        verify_rows: list[tuple[ScheduledRequest, int]] = []  # drafting: first of its rows
        rows: list[tuple[str, int, int, int, list[int]]] = []
        for item in out.scheduled:
            req, start, n = item.request, item.request.num_computed_tokens, item.num_tokens
            table = block_ids[req.request_id]
            input_ids.extend(req.all_token_ids[start : start + n])
            if item.spec_token_ids:
                input_ids.extend(item.spec_token_ids)
                n += len(item.spec_token_ids)
            rows.append((req.request_id, len(input_ids) - n, start, n, table))
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(table)
            if item.spec_token_ids:
                verify_rows.append((item, len(input_ids) - len(item.spec_token_ids) - 1))
            elif item.samples:
                sample_rows.append(len(input_ids) - 1)
                samplers.append(req)
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev
            ),
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
        )
        # what a drafter reading the target's states starts from: the hidden states and,
        # per scheduled request, (request id, first row, first position, rows, block table)
        self.last_hidden = hidden
        self.last_rows = rows
        sampled: SampledTokens = {}
        spans = [(first, len(item.spec_token_ids) + 1) for item, first in verify_rows]
        rows_needed = sample_rows + [r for first, n in spans for r in range(first, first + n)]
        if not rows_needed:
            return sampled
        # one LM-head pass for every row that needs logits: each call reads the whole head
        all_logits = self.model.compute_logits(hidden[rows_needed])
        if samplers:
            logits = all_logits[: len(sample_rows)]
            ids = [r.request_id for r in samplers]
            tokens, logprobs = self.sampler(
                logits, ids, [r.sampling for r in samplers], [blocked_tokens(r) for r in samplers]
            )
            for rid, tok, lp in zip(ids, tokens, logprobs, strict=True):
                sampled[rid] = ([tok], [lp] if lp is not None else None)
        at = len(sample_rows)
        for (item, _), (_, n) in zip(verify_rows, spans, strict=True):
            req = item.request
            sampled[req.request_id] = self.sampler.verify(
                all_logits[at : at + n], item.spec_token_ids, req.request_id, req.sampling
            )
            at += n
        return sampled

    def proposer(self, config):  # -> spec.speculator.Proposer
        """MTP drafts from this runner's hidden states, a draft model from its own forward
        (each with its own KV on top of the target's); other methods as the base runner
        decides."""
        if config.method in ("mtp", "eagle", "eagle3"):  # heads over the target's hidden states
            from kvmesh.engine.spec.mtp_proposer import MtpProposer

            return MtpProposer(config, self)
        if config.method == "draft_model":
            from kvmesh.engine.spec.draft_model_proposer import DraftModelProposer

            return DraftModelProposer(config, self)
        return super().proposer(config)

    @torch.inference_mode()
    def run_idle_step(self) -> None:
        """This rank's forward in a lockstep step it has no tokens for: every MoE layer's
        collectives with zero local tokens (a dense model has none, so nothing runs)."""
        idle = getattr(self.model, "run_idle_step", None)
        if idle is not None:
            idle()

    def release(self, request_id: str) -> None:
        self.sampler.forget(request_id)

    @torch.inference_mode()
    def export_blocks(self, block_ids: list[int]) -> tuple[bytes, dict]:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        kv = torch.stack([cache[:, idx] for cache in self.kv_caches])  # [L, 2, n, bs, kvh, hd]
        data = memoryview(kv.contiguous().cpu().view(torch.uint8).numpy()).cast("B")
        return data, {"dtype": str(self.dtype).removeprefix("torch."), "shape": list(kv.shape)}

    @torch.inference_mode()
    def import_blocks(
        self, block_ids: list[int], data: memoryview, meta: dict, select: list[int]
    ) -> None:
        shape = list(meta["shape"])
        local = [len(self.kv_caches), *self.kv_caches[0].shape]
        if (
            meta.get("dtype") != str(self.dtype).removeprefix("torch.")
            or shape[:2] + shape[3:] != local[:2] + local[3:]
        ):
            raise ValueError(f"KV layout {meta.get('dtype')} {shape} does not match {local}")
        if len(data) != math.prod(shape) * self.dtype.itemsize:
            raise ValueError(f"KV payload has {len(data)} bytes for shape {shape}")
        with warnings.catch_warnings():  # read only: the payload buffer is never written
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=torch.uint8)
        if flat.data_ptr() % self.dtype.itemsize:  # misaligned for the dtype: copy once
            flat = flat.clone()
        kv = flat.view(self.dtype).reshape(shape)
        if select == list(range(select[0], select[0] + len(select))):  # a run: no gather copy
            kv = kv.narrow(2, select[0], len(select)).to(self.device)
        else:
            kv = kv[:, :, select].to(self.device)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, cache in enumerate(self.kv_caches):
            cache[:, idx] = kv[layer]

    # ---- offload tiers: slot-major storage, see tier_storage ---------------------------
    def init_tiers(self, slots: dict[str, int], disk_path: str | None = None) -> None:
        shape = (len(self.kv_caches), *self.kv_caches[0][:, 0].shape)  # [L, 2, bs, kvh, hd]
        pin = self.device.type == "cuda"
        for medium, n in slots.items():
            if medium == "DISK":
                assert disk_path, "a disk tier needs a path"
                self.tiers[medium] = DiskTierStorage(disk_path, n, shape, self.dtype)
            else:
                self.tiers[medium] = HostTierStorage(n, shape, self.dtype, pin)

    def close(self) -> None:
        """Release the tiers' storage (the disk tier's file is removed)."""
        for storage in self.tiers.values():
            if isinstance(storage, DiskTierStorage):
                storage.close()

    def copy_worker(self, run) -> ThreadCopyWorker:
        """Loads on a worker thread; on CUDA on their own stream, synchronized before the load
        counts as done, so the blocks are whole when the scheduler lets a step read them. (On
        CPU its torch thread count is its own, under OpenMP.)"""
        if self.device.type != "cuda":  # one thread: the step's torch threads keep the cores
            return ThreadCopyWorker(run, init=lambda: torch.set_num_threads(1))
        stream = torch.cuda.Stream(self.device)

        def on_stream(loads) -> None:
            stream.wait_stream(torch.cuda.default_stream(self.device))  # e.g. stores in flight
            with torch.cuda.stream(stream):
                run(loads)
            stream.synchronize()

        return ThreadCopyWorker(on_stream)

    def _count_copy(self, t0: float) -> None:
        with self._copy_lock:
            self.copy_seconds += time.perf_counter() - t0

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([cache[:, idx] for cache in self.kv_caches], dim=1).transpose(0, 2)

    @torch.inference_mode()
    def copy_to_tier(self, medium: str, block_ids: list[int], slots: list[int]) -> None:
        t0 = time.perf_counter()
        blocks = self._gather(block_ids)  # [n, L, 2, bs, kvh, hd]
        self.tiers[medium].write(slots, blocks)
        self._count_copy(t0)

    @torch.inference_mode()
    def copy_from_tier(self, medium: str, slots: list[int], block_ids: list[int]) -> None:
        t0 = time.perf_counter()
        store = self.tiers[medium]
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if isinstance(store, HostTierStorage) and self.device.type == "cpu":
            rows = torch.tensor(slots, dtype=torch.long)  # layer by layer: no all-layer copy
            for layer, cache in enumerate(self.kv_caches):
                cache[:, idx] = store.data[rows, layer].transpose(0, 1)
        else:
            blocks = store.read(slots).to(self.device, non_blocking=True)
            for layer, cache in enumerate(self.kv_caches):
                cache[:, idx] = blocks[:, layer].transpose(0, 1)
        self._count_copy(t0)

    def copy_between_tiers(
        self, src: str, src_slots: list[int], dst: str, dst_slots: list[int]
    ) -> None:
        t0 = time.perf_counter()
        self.tiers[dst].write(dst_slots, self.tiers[src].read(src_slots))
        self._count_copy(t0)
