"""EngineCore: one synchronous step = schedule, execute on the runner, turn tokens into outputs."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.kv_transfer import (
    HeldBlocks,
    KVTransferConfig,
    decode_payload,
    encode_payload,
    encode_payload_parts,
    producer_params,
)
from kvmesh.engine.metrics import EngineMetrics
from kvmesh.engine.runner import ModelRunner
from kvmesh.engine.scheduler import Scheduler, SchedulerOutput
from kvmesh.engine.sequence import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """What one step added to one request: new tokens and text, and how it ended if it did."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[list[tuple[int, float]]] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    error: str | None = None
    kv_transfer_params: dict | None = None


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        tokenizer,
        metrics: EngineMetrics,
        publish_events=None,
    ) -> None:
        self.scheduler = scheduler
        self.kv: KVCacheManager = scheduler.kv
        self.runner = runner
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.publish_events = publish_events or (lambda events: None)
        # None: a request whose output carries no text (and so has no stop strings)
        self.detoks: dict[str, IncrementalDetokenizer | None] = {}
        self.last_token_time: dict[str, float] = {}
        self.num_steps = 0
        self.log_stats = True  # record metrics (a simulator that reads none turns it off)
        self.step_observer = None  # called after each step (emulation records predicted times)
        self.transfer_config = KVTransferConfig(engine_id=uuid.uuid4().hex)
        self.held = HeldBlocks(self.transfer_config.hold_timeout_s)
        self.advertise = ("127.0.0.1", 0)  # host and port peers reach this engine at
        self.last_import_seconds = 0.0  # modelled transfer time of the last import (emulation)
        self._copy_seconds_seen = 0.0  # runner tier-copy time already counted in metrics
        # ranks in lockstep (dp.lockstep): a step that schedules nothing still runs one idle
        # forward, so this rank joins every MoE collective its peers' forwards issue
        self.lockstep = False
        self.speculator = None  # a spec.Speculator drafts for the next step, when configured

    def add_request(self, request: Request) -> None:
        p = request.sampling
        self.detoks[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, list(p.stop), p.include_stop_str_in_output, p.skip_special_tokens
        )
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self._record_load()  # an engine left idle by aborts must not report their load
        return self._output(request, [], None, "")

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; its AllBlocksCleared goes out now, not with the next step
        (an idle engine may take none, and a router replaying the events must see it)."""
        ok = self.kv.reset_prefix_cache()
        self.publish_events(self.kv.take_events())
        self._record_load()
        return ok

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        step_start = time.monotonic()
        out = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        if out.empty and self.lockstep:
            self.runner.run_idle_step()
        if not out.empty:
            block_ids = {}  # the runner's view of each request's blocks, when it reads them
            if self.runner.reads_block_ids:
                block_ids = {
                    s.request.request_id: self.kv.block_ids(s.request.request_id)
                    for s in out.scheduled
                }
            sampled = self.runner.execute(out, block_ids)
            self.num_steps += 1
            now = time.monotonic()
            if self.runner.waits_instead_of_computing:  # tokens appear when the step ends
                now += self.runner.last_step_time
            progressed = self.scheduler.update_from_output(out, sampled)
            if self.speculator is not None and self.log_stats:  # its metrics, nothing else
                self.speculator.record(out, sampled)
            if self.step_observer is not None:
                self.step_observer(
                    self.scheduler, step_start, self.runner.last_step_time, progressed
                )
            process = self._process_tokens
            outputs = [process(request, num_new, now) for request, num_new in progressed]
            if self.speculator is not None:
                self.speculator.propose(self.scheduler, out, [r for r, _ in progressed])
            self.kv.flush_offload()  # before the next step writes any device block again
        elif self.kv.loads is not None and self.kv.loads.jobs:
            self.kv.loads.wait()  # only copies in flight: wait for the first to land
        if self.held.held:
            self.expire_held()
        if self.log_stats:
            self._record(out)
        self.publish_events(self.kv.take_events())
        return outputs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """A runner failure ends every request with an error rather than dropping it."""
        outputs = []
        for request in list(self.scheduler.requests.values()):
            self._finish(request, RequestStatus.FINISHED_ERROR)
            out = self._output(request, [], None, "")
            out.error = message
            outputs.append(out)
        self.publish_events(self.kv.take_events())
        self._record_load()
        return outputs

    def _process_tokens(self, request: Request, num_new: int, now: float) -> RequestOutput:
        """The step's new tokens through the stop checks one at a time, as one-token steps
        would see them; tokens after a stop are dropped (speculation can emit several)."""
        num_output = len(request.output_token_ids)
        first = num_output - num_new
        tokens = request.output_token_ids[first:]
        detok = self.detoks[request.request_id]
        p = request.sampling
        status, end = None, num_output  # how it ends, at how many output tokens
        if detok is None and (p.ignore_eos or not request.eos_token_ids) and not p.stop_token_ids:
            # no text and no token to watch for: only the length limit can end it
            limit = min(p.max_tokens, self.runner.max_model_len - len(request.prompt_token_ids))
            if num_output >= limit:
                status, end = RequestStatus.FINISHED_LENGTH, max(limit, first + 1)
        else:
            for i, token in enumerate(tokens):
                if detok is not None:
                    detok.add(token)
                status = self._check_stop(request, token, detok, first + i + 1)
                if status is not None:
                    end = first + i + 1
                    break
        if end < num_output:
            del tokens[end - first :]
            self._drop_tokens_after(request, end)
        if first == 0:
            request.first_token_time = now
        if self.log_stats:
            self._observe_tokens(request, first, len(tokens), now, status is not None)
        if status is not None:
            self._finish(request, status)
        text = detok.release(final=status is not None) if detok is not None else ""
        logprobs = None
        if p.logprobs is not None:
            logprobs = request.output_logprobs[first:] or None
        return self._output(request, tokens, logprobs, text, end)

    def _observe_tokens(
        self, request: Request, first: int, num_tokens: int, now: float, finished: bool
    ) -> None:
        """Metrics of a step's num_tokens new tokens after the first `first` outputs."""
        m, rid = self.metrics, request.request_id
        if first == 0:
            m.ttft.observe(now - request.arrival_time)
            m.prompt_tokens.inc(len(request.prompt_token_ids))
            if request.first_scheduled_time is not None:
                m.queue_time.observe(request.first_scheduled_time - request.arrival_time)
        else:
            m.itl.observe(now - self.last_token_time.get(rid, now))
        self.last_token_time[rid] = now
        m.generation_tokens.inc(num_tokens)
        if finished:
            m.e2e.observe(now - request.arrival_time)

    @staticmethod
    def _drop_tokens_after(request: Request, num_output: int) -> None:
        """Forget verified tokens past a stop: the request ends at num_output outputs."""
        extra = request.num_output_tokens - num_output
        if extra > 0:
            del request.output_token_ids[num_output:]
            del request.all_token_ids[len(request.all_token_ids) - extra :]
            del request.output_logprobs[num_output:]

    def _check_stop(
        self, request: Request, token: int, detok, num_output: int
    ) -> RequestStatus | None:
        """Whether the num_output-th output token (token) ends the request."""
        p = request.sampling
        if num_output >= p.min_tokens:
            if not p.ignore_eos and token in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            stop_str = detok.find_stop() if detok is not None else None
            if stop_str is not None:
                request.stop_reason = stop_str
                return RequestStatus.FINISHED_STOPPED
        if num_output >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.prompt_token_ids) + num_output >= self.runner.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        keep = request.hold_for_remote and status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
        )
        blocks = self.scheduler.finish(request, status, keep_blocks=keep)
        if keep and blocks is not None:
            self._hold(request, blocks)
        self.runner.release(request.request_id)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        self.last_token_time.pop(request.request_id, None)
        self.metrics.request_finished(status.finish_reason or "abort")

    # ---- P/D: the prefill side keeps blocks for the decode side to read -----------------
    def _hold(self, request: Request, blocks) -> None:
        """Keep the prompt's full blocks (the rest is released) and say where they are."""
        n = min(request.num_prompt_tokens // self.kv.block_size, len(blocks))
        self.kv.pool.free_blocks(reversed(blocks[n:]))
        transfer_id = self.held.hold(  # minted: the decode side reads by it, not request_id
            request.request_id, blocks[:n], request.block_hashes[:n], request.num_prompt_tokens
        )
        host, port = self.advertise
        request.kv_transfer_params = producer_params(
            self.transfer_config,
            transfer_id,
            [b.block_id for b in blocks[:n]],
            host,
            port,
            request.num_prompt_tokens,
        )

    def export_held(self, transfer_id: str) -> bytes | None:
        """The held blocks of a finished prefill as a payload; they are released once read."""
        held = self.held.take(transfer_id)
        if held is None:
            return None
        try:
            data, meta = self.runner.export_blocks([b.block_id for b in held.blocks])
        finally:
            self.kv.pool.free_blocks(reversed(held.blocks))
        return encode_payload(held.block_hashes, held.num_tokens, data, meta)

    def import_payload(self, request: Request, payload: bytes) -> int:
        """Write a peer's verified blocks into this cache as prefix-cache blocks; the number
        of tokens that will not need computing. Never raises for a bad payload: recompute."""
        try:
            self.kv.flush_offload()
            header, data = decode_payload(payload)
            first = int(header.get("first_block", 0))
            indices = self.kv.adopt_blocks(request, header["block_hashes"], first)
            if not indices or len(indices) > self.kv.pool.num_free_blocks:
                return 0
            blocks = self.kv.pool.get_new_blocks(len(indices))
            try:
                select = [i - first for i in indices]
                self.runner.import_blocks([b.block_id for b in blocks], data, header, select)
            except (ValueError, RuntimeError) as exc:
                logger.warning("KV import for %s failed (%s); recomputing", request.request_id, exc)
                self.kv.pool.free_blocks(blocks)
                return 0
            self.kv.cache_imported(request, indices, blocks)
            self.kv.flush_offload()
            self.publish_events(self.kv.take_events())
            self.last_import_seconds = self.runner.transfer_time(header, len(indices))
            return len(indices) * self.kv.block_size
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("bad KV payload for %s (%s); recomputing", request.request_id, exc)
            return 0

    # ---- peer sharing: any engine serves the cached blocks a peer asks for by hash -------
    def local_prefix(self, request: Request) -> tuple[int, list[bytes]]:
        """(blocks this engine holds, from any tier, now loaded to the device; the hashes of
        every full block the request could reuse): what a pull from a peer should start at."""
        computed = self.kv.get_computed_blocks(request)
        self.kv.flush_offload()
        self.publish_events(self.kv.take_events())
        max_blocks = (request.num_tokens - 1) // self.kv.block_size
        return len(computed.blocks), request.block_hashes[:max_blocks]

    def export_prefix(self, block_hashes: list[bytes], first: int) -> list | None:
        """The blocks block_hashes[first:first + k] for the longest k this engine holds (a
        lower tier's are loaded to the device first), as transfer payload parts; None if k == 0."""
        wanted = block_hashes[first:]
        hits = self.kv.find_cached(wanted)
        if self.kv.offloader is not None and len(hits) < len(wanted):
            hits += self.kv.load_from_tiers(hits, wanted)
        if not hits:
            return None
        self.kv.pool.touch(hits)  # held while the KV is read
        try:
            data, meta = self.runner.export_blocks([b.block_id for b in hits])
        finally:
            self.kv.pool.free_blocks(reversed(hits))
        self.kv.flush_offload()
        self.publish_events(self.kv.take_events())
        meta = {**meta, "first_block": first}
        n = len(hits) * self.kv.block_size
        return encode_payload_parts(wanted[: len(hits)], n, data, meta)

    def expire_held(self) -> None:
        for held in self.held.expired():
            self.kv.pool.free_blocks(reversed(held.blocks))

    def _output(
        self, request: Request, tokens, logprobs, text: str, num_output: int | None = None
    ) -> RequestOutput:
        """The request's output for this step; num_output: its output tokens, when known."""
        status = request.status
        finished = status >= RequestStatus.FINISHED_STOPPED
        if finished:
            self.detoks.pop(request.request_id, None)
        return RequestOutput(  # positional, in field order: one a request a step
            request.request_id,
            text,
            tokens,
            logprobs,
            finished,
            status.finish_reason if finished else None,
            request.stop_reason,
            len(request.prompt_token_ids),
            request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
            len(request.output_token_ids) if num_output is None else num_output,
            None,
            request.kv_transfer_params if finished else None,
        )

    def _record_load(self) -> None:
        m, s = self.metrics, self.scheduler
        m.running.set(s.num_running)
        m.waiting.set(s.num_waiting)
        m.kv_usage.set(self.kv.usage)

    def _record(self, out: SchedulerOutput) -> None:
        m = self.metrics
        self._record_load()
        if out.preempted:
            m.preemptions.inc(len(out.preempted))
        queries, hits = self.kv.take_prefix_stats()
        if queries:
            m.prefix_queries.inc(queries)
            m.prefix_hits.inc(hits)
        if self.kv.offloader is not None:
            tiers = {t.medium: t for t in self.kv.offloader.tiers}
            for medium, traffic in self.kv.offloader.take_traffic().items():
                m.record_tier(medium, tiers[medium].usage, traffic)
            spent = getattr(self.runner, "copy_seconds", 0.0)
            if spent > self._copy_seconds_seen:
                m.offload_copy_seconds.inc(spent - self._copy_seconds_seen)
                self._copy_seconds_seen = spent
