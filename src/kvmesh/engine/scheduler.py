"""Scheduler: continuous batching with a token budget, chunked prefill and recompute preemption.

There are no prefill and decode phases: each step, every request's num_computed_tokens moves
towards num_tokens within the budget. Running requests go first; waiting ones are admitted only
when no request was preempted in this step. With asynchronous tier loads (`kv.loads`), a waiting
request whose prefix is in a lower tier leaves the queue for WAITING_FOR_REMOTE_KVS while its
blocks load, and comes back to the front of the queue when they have landed.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.sequence import Request, RequestStatus

_FINISHED = RequestStatus.FINISHED_STOPPED  # statuses from here on are finished


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    # slots reserved past a drafting request's drafts, for a drafter that writes its own KV
    # ahead of the target (MTP's chained depths); 0 for prompt lookup
    num_lookahead_tokens: int = 0


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # known tokens to compute this step, from request.num_computed_tokens
    # drafts computed after them at the following positions (speculative decoding); only
    # a request that samples carries them, and the target's pass verifies them (read-only)
    spec_token_ids: Sequence[int] = ()

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens and so yields the next one."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """Rows of the forward pass: known tokens and drafts."""
        return self.num_tokens + len(self.spec_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """FCFS deque or a (priority, arrival) heap; both pop the next request to admit."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = 0

    def add(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            self._seq += 1
            heapq.heappush(self._heap, (request.priority, request.arrival_time, self._seq, request))
        elif front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> Request:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, request: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[3] is not request]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self):
        return iter([e[3] for e in self._heap] if self.policy == "priority" else self._fifo)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, "duplicate request id"
        self.requests[request.request_id] = request
        self.waiting.add(request)

    @property
    def has_work(self) -> bool:
        loads = self.kv.loads
        return bool(self.running or len(self.waiting) or (loads is not None and loads.busy))

    @property
    def num_loading(self) -> int:
        return self.kv.loads.num_waiting if self.kv.loads is not None else 0

    def _prefill_cap(self, num_new: int, budget: int) -> int:
        cap = self.config.long_prefill_token_threshold
        if cap > 0:
            num_new = min(num_new, cap)
        return min(num_new, budget)

    def _lookahead(self, num_positions: int) -> int:
        """Slots reserved past num_positions for a drafter's own KV (never past max_model_len)."""
        room = self.config.max_model_len - num_positions
        return max(0, min(self.config.num_lookahead_tokens, room))

    def _victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=Request.sort_key)
        return self.running[-1]

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(victim, front=True)
        out.preempted.append(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled, preempted = out.scheduled, out.preempted
        config = self.config
        budget = config.max_num_batched_tokens
        cap = config.long_prefill_token_threshold
        allocate_slots = self.kv.allocate_slots
        loads = self.kv.loads
        if loads is not None:
            for request in reversed(loads.poll()):  # blocks landed: first in line again
                request.status = RequestStatus.WAITING
                self.waiting.add(request, front=True)

        # the hot loop of a decode-heavy engine: one pass per running request per step
        for request in list(self.running):
            if budget <= 0:
                break
            if preempted and request in preempted:  # preempted earlier in this step
                continue
            num_tokens = len(request.all_token_ids)
            num_computed = request.num_computed_tokens
            num_new = num_tokens - num_computed  # _prefill_cap, inlined
            if 0 < cap < num_new:
                num_new = cap
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                continue
            samples = num_computed + num_new == num_tokens
            spec: Sequence[int] = ()
            if request.spec_token_ids:  # drafts go only where the step samples; trimmed first
                if samples:
                    spec = request.spec_token_ids[: budget - num_new]
                request.spec_token_ids = []
            num_slots = num_new + len(spec)
            if samples and config.num_lookahead_tokens:
                num_slots += self._lookahead(num_computed + num_slots)
            while allocate_slots(request, num_slots) is None:
                victim = self._victim()
                if any(s.request is victim for s in scheduled):  # never undo planned work
                    victim = request
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new, spec))
                budget -= num_new + len(spec)

        if out.preempted:
            return out

        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if loads is None:
                computed = self.kv.get_computed_blocks(request)  # loads from tiers inline
            else:
                computed = loads.computed_or_park(request)
                if computed is None:  # its prefix is loading: the next ones go meanwhile
                    self.waiting.pop()
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    continue
            num_new = request.num_tokens - computed.num_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = self._prefill_cap(num_new, budget)
            lookahead = 0  # a drafter writing ahead needs its slots from the first sample on
            if computed.num_tokens + num_new == request.num_tokens:
                lookahead = self._lookahead(request.num_tokens)
            if self.kv.allocate_slots(request, num_new + lookahead, computed) is None:
                if loads is not None:  # no waiting request keeps blocks it cannot use yet
                    loads.release_all()
                break
            if loads is not None:
                loads.release(request)  # allocate_slots took the request's own references
            self.waiting.pop()
            if request.num_cached_tokens < 0:  # first admission: what the client sees as cached
                request.num_cached_tokens = computed.num_tokens
                self.kv.record_prefix_lookup(request.num_tokens, computed.num_tokens)
            request.num_computed_tokens = computed.num_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, tuple[int, list | None]]
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens; return (request, tokens it gained).

        With drafts, the rows of the accepted ones join the computed tokens and the rejected
        ones' KV stays past num_computed_tokens, where the next step overwrites it: only
        verified tokens are ever hashed, cached or announced."""
        progressed = []
        cache_blocks = self.kv.cache_blocks
        for item in out.scheduled:
            request = item.request
            if request.status >= _FINISHED:  # aborted while the step ran
                continue
            new = sampled.get(request.request_id)
            if new is None:  # a prefill chunk short of the end
                request.num_computed_tokens += item.num_tokens
            else:
                tokens, logprobs = new
                num_accepted = len(tokens) - 1
                assert 0 <= num_accepted <= len(item.spec_token_ids)  # never past the drafts
                request.num_computed_tokens += item.num_tokens + num_accepted
                request.append_output_tokens(tokens, logprobs)
                progressed.append((request, len(tokens)))
            cache_blocks(request, request.num_computed_tokens)
        return progressed

    def finish(self, request: Request, status: RequestStatus, keep_blocks: bool = False):
        """Move a request out of the scheduler and release its blocks (idempotent); with
        keep_blocks, hand them to the caller still referenced instead."""
        if request.request_id not in self.requests:
            return None
        del self.requests[request.request_id]
        if request in self.running:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        if self.kv.loads is not None:
            self.kv.loads.forget(request)  # a load in flight is freed when its copy ends
        request.status = status
        if keep_blocks:
            return self.kv.detach(request)
        self.kv.free(request)
        return None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + self.num_loading
