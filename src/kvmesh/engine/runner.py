"""The runner seam: runners execute what the scheduler decided; they never schedule."""

from __future__ import annotations

import abc

from kvmesh.engine.kv_loads import ThreadCopyWorker
from kvmesh.engine.scheduler import SchedulerOutput
from kvmesh.engine.sequence import Request

# per request that samples: its new tokens (one, or with speculation the accepted drafts and
# the target's next token) and, when it asked for logprobs, one entry list per token
SampledTokens = dict[str, tuple[list[int], list[list[tuple[int, float]]] | None]]


def blocked_tokens(request: Request) -> list[int]:
    """Tokens that may not be sampled yet: EOS and stop ids while min_tokens is unmet."""
    if request.num_output_tokens >= request.sampling.min_tokens:
        return []
    return list(request.eos_token_ids) + list(request.sampling.stop_token_ids)


class ModelRunner(abc.ABC):
    """The seam between the device-free core and whatever computes a step."""

    num_blocks: int
    max_model_len: int
    kv_bytes_per_block = 0  # KV bytes of one block across all layers (sizes offload tiers)
    waits_instead_of_computing = False  # True: execute() returns at once, the step lasts
    last_step_time = 0.0  # ... last_step_time seconds, which the driver waits out
    reads_block_ids = True  # False: execute() ignores block_ids, so the core passes none

    @abc.abstractmethod
    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> SampledTokens:
        """Compute the scheduled tokens; return the next token of every request that samples."""

    def proposer(self, config):  # -> spec.speculator.Proposer
        """What drafts for `config` (a resolved SpeculativeConfig) on this runner; prompt
        lookup needs only tokens, other methods the runner's own model."""
        from kvmesh.engine.spec.speculator import PromptLookupProposer

        if config.method == "ngram":
            return PromptLookupProposer(config)
        raise ValueError(f"speculative method {config.method!r} is not available on this runner")

    def release(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """Forget per-request state (e.g. seeded generators)."""

    def export_blocks(self, block_ids: list[int]) -> tuple[bytes, dict]:
        """The KV of these blocks as bytes, with what import_blocks needs to read them."""
        raise NotImplementedError

    def import_blocks(
        self, block_ids: list[int], data: memoryview, meta: dict, select: list[int]
    ) -> None:
        """Write blocks select[i] of an exported payload into local block_ids[i]."""
        raise NotImplementedError

    def transfer_time(self, meta: dict, num_blocks: int) -> float:
        """Seconds an imported payload should have taken to arrive (emulation models it)."""
        return 0.0

    # ---- offload tiers: storage the runner owns, slots the core's tiers hand out ----------
    def init_tiers(self, slots: dict[str, int], disk_path: str | None = None) -> None:
        """Allocate storage for each tier medium ("CPU": host memory, "DISK": a file)."""
        raise NotImplementedError

    def copy_to_tier(self, medium: str, block_ids: list[int], slots: list[int]) -> None:
        """Device blocks block_ids[i] -> tier slots[i]."""
        raise NotImplementedError

    def copy_from_tier(self, medium: str, slots: list[int], block_ids: list[int]) -> None:
        """Tier slots[i] -> device blocks block_ids[i]."""
        raise NotImplementedError

    def copy_worker(self, run):
        """What runs asynchronous loads: `run(loads)` on one background thread by default."""
        return ThreadCopyWorker(run)

    def copy_between_tiers(
        self, src: str, src_slots: list[int], dst: str, dst_slots: list[int]
    ) -> None:
        """Tier src slot src_slots[i] -> tier dst slot dst_slots[i] (spills downwards)."""
        raise NotImplementedError
