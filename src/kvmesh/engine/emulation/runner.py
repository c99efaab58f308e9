"""EmulatedRunner: the forward pass replaced by the time a latency model predicts for it.

Everything around it is real (scheduler, block pool, prefix cache, KV events, metrics, HTTP);
only the tokens are made up: a deterministic stream of ordinary words, so that usage, streaming,
stop strings and max_tokens behave as with a model. It never samples EOS on its own. With
--speculative-config a step verifies drafts and accepts some (kvmesh.engine.emulation.spec);
the tokens are the same stream.
"""

from __future__ import annotations

import logging
from functools import partial
from types import SimpleNamespace

from kvmesh.engine.emulation.latency import LatencyModel, SequenceWork
from kvmesh.engine.emulation.spec import (
    DEFAULT_ACCEPTANCE,
    MODEL_DRAFTERS,
    Acceptance,
    EmulatedDrafter,
)
from kvmesh.engine.runner import ModelRunner, SampledTokens
from kvmesh.engine.scheduler import SchedulerOutput
from kvmesh.engine.sequence import Request

logger = logging.getLogger(__name__)

FILLER_TEXT = (
    " The engine keeps the context of every agent warm, so that the next turn starts where the"
    " last one ended. Blocks of tokens move between tiers as they cool, and the router sends each"
    " request to the engine that already holds its prefix."
)


# SequenceWork(*fields) without the namedtuple's Python-level __new__ (one row a request a step)
_new_work = partial(tuple.__new__, SequenceWork)

# named bandwidths of the links offloaded KV crosses (bytes/s)
PCIE_BANDWIDTH = 50e9  # host DRAM <-> device: PCIe 5.0 x16, as copies achieve it
NVME_BANDWIDTH = 6e9  # disk <-> host DRAM: one PCIe 4.0 NVMe drive
NETWORK_BANDWIDTH = 25e9  # engine <-> engine: a 200 Gb/s RDMA NIC
TIER_BANDWIDTH = {"CPU": PCIE_BANDWIDTH, "DISK": NVME_BANDWIDTH}


class EmulatedRunner(ModelRunner):
    waits_instead_of_computing = True  # the AsyncEngine drives it from the event loop
    reads_block_ids = False  # no tensors: a step is its time, not its memory

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
        # a RankClock when this rank steps in an emulated lockstep group (dp_clock): the
        # AsyncEngine then ends each step when the group's step ends
        self.lockstep_clock = None
        spec = getattr(latency, "model", None)
        self.kv_bytes_per_block = (spec.kv_bytes_per_token * block_size) if spec else 0
        self.transfer_bandwidth = NETWORK_BANDWIDTH
        self.pending_load_time = 0.0  # tier -> device copies the next step waits for
        self.pending_store_time = 0.0  # device -> tier copies, overlapped with the next step
        self.modelled_loads: dict[str, float] = {}  # medium -> seconds of loads modelled so far
        self.filler = tokenizer.encode(FILLER_TEXT, add_special_tokens=False) or [0]
        # the filler then its start again: any run of up to len(filler) tokens is one slice
        self._filler_twice = self.filler * 2
        self._filler_wrap = len(self.filler)
        self._stream_starts: dict[str, int] = {}  # request id -> its offset in the filler
        self.last_step_time = 0.0
        self.predicted_time_total = 0.0
        self.clock = 0.0  # emulated seconds: steps and idle waits for loads
        self.num_steps = 0
        # what a spec decode's drafts are worth: set before proposer() (the builder does)
        self.spec_acceptance: tuple[float, ...] = DEFAULT_ACCEPTANCE
        self.spec_seed: object = 0
        self.acceptance: Acceptance | None = None  # set by proposer()
        # the emulated model's MTP layers, for method "mtp" (the builder resolves k with it)
        self.model_config = SimpleNamespace(
            num_nextn_predict_layers=getattr(spec, "num_nextn_predict_layers", 0)
        )

    def proposer(self, config):
        """Model drafters are emulated (placeholder drafts, accepted at the configured rates);
        n-gram is the real prompt lookup, checked against the output stream."""
        self.acceptance = Acceptance(config.method, self.spec_acceptance, self.spec_seed)
        if config.method in MODEL_DRAFTERS:
            return EmulatedDrafter(self.stream_tokens)
        return super().proposer(config)

    def stream_token(self, request: Request, index: int) -> int:
        """The emulated output token at output position `index` of `request`."""
        return self.filler[(self._stream_start(request) + index) % len(self.filler)]

    def stream_tokens(self, request: Request, first: int, count: int) -> list[int]:
        """The emulated output tokens at output positions first, ..., first + count - 1."""
        start = self._stream_starts.get(request.request_id)
        if start is None:
            start = self._stream_start(request)
        start = (start + first) % len(self.filler)
        if count <= self._filler_wrap:  # one slice of the filler followed by its start
            return self._filler_twice[start : start + count]
        filler, n = self.filler, len(self.filler)
        return [filler[(start + j) % n] for j in range(count)]

    def _stream_start(self, request: Request) -> int:
        """Where the request's stream starts in the filler (kept until release())."""
        start = self._stream_starts.get(request.request_id)
        if start is None:
            start = sum(request.prompt_token_ids[-4:]) % len(self.filler)
            self._stream_starts[request.request_id] = start
        return start

    def release(self, request_id: str) -> None:
        self._stream_starts.pop(request_id, None)

    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> SampledTokens:
        drafted = self.acceptance is not None and self.acceptance.method in MODEL_DRAFTERS
        work: list[SequenceWork] = []
        samplers = []  # the scheduled requests whose step yields a token
        for s in out.scheduled:
            req, num_known, num_spec = s.request, s.num_tokens, len(s.spec_token_ids)
            num_computed = req.num_computed_tokens
            work.append(
                _new_work(
                    (
                        num_known + num_spec,
                        num_computed,
                        num_known > 1 or not req.output_token_ids,
                        num_spec,
                        num_spec if drafted else 0,
                    )
                )
            )
            if num_computed + num_known == len(req.all_token_ids):  # s.samples
                samplers.append(s)
        slowdown = self.slowdown * (self.faults.config.slowdown if self.faults else 1.0)
        compute = self.latency.step_time(work) * slowdown
        # stores overlap compute on the copy engine; loads must land before the step reads them
        self.last_step_time = max(compute, self.pending_store_time) + self.pending_load_time
        self.pending_load_time = self.pending_store_time = 0.0
        self.predicted_time_total += self.last_step_time
        self.clock += self.last_step_time
        self.num_steps += 1
        sampled: SampledTokens = {}
        acceptance, stream_tokens = self.acceptance, self.stream_tokens
        for item in samplers:
            req, drafts = item.request, item.spec_token_ids
            first = len(req.output_token_ids)
            accepted = 0
            if drafts and acceptance is not None:
                if drafted:  # placeholders: only their number matters
                    accepted = acceptance.num_drawn(len(drafts))
                else:
                    accepted = acceptance.num_accepted(
                        drafts, lambda j, r=req, f=first: self.stream_token(r, f + j)
                    )
            tokens = stream_tokens(req, first, accepted + 1)
            logprobs = [[(t, 0.0)] for t in tokens] if req.sampling.logprobs is not None else None
            sampled[req.request_id] = (tokens, logprobs)
        return sampled

    def export_blocks(self, block_ids: list[int]) -> tuple[bytes, dict]:
        """No tensors here: the payload is empty and says how many bytes it stands for."""
        return b"", {"emulated": True, "bytes": len(block_ids) * self.kv_bytes_per_block}

    def import_blocks(self, block_ids, data, meta, select) -> None:
        return None

    def transfer_time(self, meta: dict, num_blocks: int) -> float:
        return num_blocks * self.kv_bytes_per_block / self.transfer_bandwidth

    # ---- offload tiers: no data, only the time the copies take on the named links ---------
    def init_tiers(self, slots: dict[str, int], disk_path: str | None = None) -> None:
        self.tier_slots = dict(slots)

    def _copy_time(self, medium: str, num_blocks: int) -> float:
        return num_blocks * self.kv_bytes_per_block / TIER_BANDWIDTH.get(medium, PCIE_BANDWIDTH)

    def copy_to_tier(self, medium: str, block_ids: list[int], slots: list[int]) -> None:
        self.pending_store_time += self._copy_time(medium, len(block_ids))

    def load_time(self, medium: str, num_blocks: int) -> float:
        """Seconds to bring blocks from a tier to the device (counted in modelled_loads)."""
        time = self._copy_time(medium, num_blocks)
        if medium != "CPU":  # lower tiers reach the device through host memory
            time += self._copy_time("CPU", num_blocks)
        self.modelled_loads[medium] = self.modelled_loads.get(medium, 0.0) + time
        return time

    def copy_from_tier(self, medium: str, slots: list[int], block_ids: list[int]) -> None:
        self.pending_load_time += self.load_time(medium, len(slots))  # the next step waits

    def copy_worker(self, run) -> ModelledCopyWorker:
        return ModelledCopyWorker(self)

    def idle(self, seconds: float) -> None:
        """A step with nothing to compute that lasts `seconds` (waiting for a load)."""
        self.last_step_time = seconds
        self.clock += seconds

    def copy_between_tiers(
        self, src: str, src_slots: list[int], dst: str, dst_slots: list[int]
    ) -> None:
        self.pending_store_time += self._copy_time(dst, len(dst_slots))


class ModelledLoad:
    def __init__(self, runner: EmulatedRunner, ready_at: float) -> None:
        self.runner = runner
        self.ready_at = ready_at

    def done(self) -> bool:
        return self.runner.clock >= self.ready_at - 1e-12

    def exception(self) -> None:
        return None


class ModelledCopyWorker:
    """Asynchronous loads on the emulated timeline: a load occupies the copy link for its
    modelled time, one after another, and is done once the runner's clock has passed its end;
    the steps in between run at their own speed (nothing is charged to them)."""

    def __init__(self, runner: EmulatedRunner) -> None:
        self.runner = runner
        self.link_free_at = 0.0

    def submit(self, loads) -> ModelledLoad:
        seconds = sum(self.runner.load_time(ld.medium, len(ld.slots)) for ld in loads)
        self.link_free_at = max(self.runner.clock, self.link_free_at) + seconds
        return ModelledLoad(self.runner, self.link_free_at)

    def wait(self, handles: list[ModelledLoad], timeout: float) -> None:
        """Nothing else to run: the engine idles (a step of that length) until the first lands."""
        first = min(h.ready_at for h in handles)
        if first > self.runner.clock:
            self.runner.idle(first - self.runner.clock)
