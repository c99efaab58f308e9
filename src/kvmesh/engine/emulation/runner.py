"""EmulatedRunner: the forward pass replaced by the time a latency model predicts for it.

Everything around it is real (scheduler, block pool, prefix cache, KV events, metrics, HTTP);
only the tokens are made up: a deterministic stream of ordinary words, so that usage, streaming,
stop strings and max_tokens behave as with a model. It never samples EOS on its own.
"""

from __future__ import annotations

import logging

from kvmesh.engine.emulation.latency import LatencyModel, SequenceWork
from kvmesh.engine.runner import ModelRunner, SampledTokens
from kvmesh.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

FILLER_TEXT = (
    " The engine keeps the context of every agent warm, so that the next turn starts where the"
    " last one ended. Blocks of tokens move between tiers as they cool, and the router sends each"
    " request to the engine that already holds its prefix."
)


class EmulatedRunner(ModelRunner):
    waits_instead_of_computing = True  # the AsyncEngine drives it from the event loop

    def __init__(
        self,
        latency: LatencyModel,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        tokenizer,
        slowdown: float = 1.0,
    ) -> None:
        self.latency = latency
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = min(max_model_len, num_blocks * block_size)
        self.slowdown = slowdown
        self.faults = None  # a FaultInjector whose slowdown applies on top, when set
        spec = getattr(latency, "model", None)
        self.kv_bytes_per_block = (spec.kv_bytes_per_token * block_size) if spec else 0
        self.transfer_bandwidth = 25e9  # bytes/s between engines (an RDMA NIC class link)
        self.filler = tokenizer.encode(FILLER_TEXT, add_special_tokens=False) or [0]
        self.last_step_time = 0.0
        self.predicted_time_total = 0.0
        self.num_steps = 0

    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> SampledTokens:
        work = [
            SequenceWork(
                s.num_tokens,
                s.request.num_computed_tokens,
                s.num_tokens > 1 or s.request.num_output_tokens == 0,
            )
            for s in out.scheduled
        ]
        slowdown = self.slowdown * (self.faults.config.slowdown if self.faults else 1.0)
        self.last_step_time = self.latency.step_time(work) * slowdown
        self.predicted_time_total += self.last_step_time
        self.num_steps += 1
        sampled: SampledTokens = {}
        n = len(self.filler)
        for item in out.scheduled:
            if not item.samples:
                continue
            req = item.request
            start = sum(req.prompt_token_ids[-4:]) % n
            token = self.filler[(start + req.num_output_tokens) % n]
            logprobs = [(token, 0.0)] if req.sampling.logprobs is not None else None
            sampled[req.request_id] = (token, logprobs)
        return sampled

    def export_blocks(self, block_ids: list[int]) -> tuple[bytes, dict]:
        """No tensors here: the payload is empty and says how many bytes it stands for."""
        return b"", {"emulated": True, "bytes": len(block_ids) * self.kv_bytes_per_block}

    def import_blocks(self, block_ids, data, meta, select) -> None:
        return None

    def transfer_time(self, meta: dict, num_blocks: int) -> float:
        return num_blocks * self.kv_bytes_per_block / self.transfer_bandwidth
