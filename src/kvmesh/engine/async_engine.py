"""AsyncEngine: drives EngineCore steps and streams their outputs to asyncio consumers.

Two drivers: a dedicated thread for runners that compute (torch releases the GIL in its kernels),
and an event-loop task for runners that only wait (emulated engines), so that many emulated
engines share one process without a thread each.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from kvmesh.engine.core import EngineCore, RequestOutput
from kvmesh.engine.sequence import Request
from kvmesh.protocol.wording import noun_for, plural

logger = logging.getLogger(__name__)


CATCH_UP_S = 0.05


class EngineOverloaded(Exception):
    """The waiting queue is full; the client should retry later."""


class EngineDead(EngineOverloaded):
    """The engine can no longer step (a data-parallel peer is gone); a supervisor restarts it."""


class AsyncEngine:
    def __init__(self, core: EngineCore, max_waiting_requests: int = 1024) -> None:
        self.core = core
        self.max_waiting_requests = max_waiting_requests
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._pending_calls: list[tuple[Callable[[EngineCore], Any], asyncio.Future]] = []
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task | None = None
        self._async_wake: asyncio.Event | None = None
        self._stopped = False
        # Wall seconds per emulated second (emulated runners only): at 4 every step lasts four
        # times its predicted time, so a host too small for a fleet's token rate keeps the
        # fleet's timing faithful in slow motion; clients divide what they measure by it.
        self.time_scale = 1.0
        self.timeline_restarts = 0  # steps that started late enough to leave the timeline
        # data-parallel lockstep (dp.lockstep.Lockstep): one agreement per iteration, all ranks
        self.lockstep = None
        self.failed: str | None = None  # why the engine stopped stepping for good
        self.on_failure: Callable[[str], None] | None = None  # called on the engine thread

    @property
    def started(self) -> bool:
        return self._thread is not None or self._task is not None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if getattr(self.core.runner, "waits_instead_of_computing", False):
            self._async_wake = asyncio.Event()
            self._task = self._loop.create_task(self._run_async())
        else:
            self._thread = threading.Thread(target=self._run, name="kvmesh-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopped = True
        self._notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._task is not None:
            self._task.cancel()

    def _notify(self) -> None:
        self._wake.set()
        if self._async_wake is not None:
            self._async_wake.set()

    def in_flight(self, request_id: str) -> bool:
        return request_id in self._queues

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    def _drain(self) -> list[RequestOutput]:
        """Apply what arrived since the last step: new requests, aborts, calls."""
        with self._lock:
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, []
            calls, self._pending_calls = self._pending_calls, []
            self._wake.clear()
            if self._async_wake is not None:
                self._async_wake.clear()
        for fn, fut in calls:
            self._resolve(fut, fn)
        outputs: list[RequestOutput] = []
        for request in adds:
            self.core.add_request(request)
        for request_id in aborts:
            out = self.core.abort_request(request_id)
            if out is not None:
                outputs.append(out)
        return outputs

    def _step(self) -> list[RequestOutput]:
        try:
            return self.core.step()
        except Exception as exc:  # the runner failed: end requests with an error, keep serving
            logger.exception("engine step failed")
            message = f"engine step failed: {type(exc).__name__}"
            if self.lockstep is not None:  # peers may wait in its collectives: stop for good
                raise RuntimeError(message) from exc
            return self.core.fail_all(message)

    def _run(self) -> None:
        idle_wait = 0.5 if self.lockstep is None else self.lockstep.idle_wait_s
        while not self._stopped:
            outputs = self._drain()
            work = self.core.has_work()
            try:
                if self.lockstep is not None:
                    work = self.lockstep.agree(work)
                if work:
                    outputs.extend(self._step())
                    if self.lockstep is not None:
                        self.lockstep.after_step()
            except Exception as exc:  # lockstep only: a peer is gone, or a step or hook failed
                self._fail(exc, outputs)
                return
            if not work and not outputs:
                self._wake.wait(timeout=idle_wait)
            if outputs and self._loop is not None:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _fail(self, exc: Exception, outputs: list[RequestOutput]) -> None:
        """End every request with an error and refuse new ones, for good."""
        message = str(exc)
        if not self._stopped:  # the cause (a collective's error) goes to the log, not clients
            logger.error("engine stopped: %s (%s)", message, exc.__cause__ or "no detail")
        with self._lock:
            self.failed = message
        outputs.extend(self._drain())
        outputs.extend(self.core.fail_all(message))
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        if self.on_failure is not None:
            self.on_failure(message)

    async def _run_async(self) -> None:
        """Steps on the event loop, back to back on an ideal timeline: a step that follows
        another starts at its predecessor's deadline, so time spent between steps (HTTP, SSE
        writes, scheduling) is absorbed instead of adding up, as long as it is shorter than a
        step. A timeline more than CATCH_UP_S (emulated) behind the clock restarts from now."""
        loop = asyncio.get_running_loop()
        assert self._async_wake is not None
        deadline: float | None = None
        scale = self.time_scale
        while not self._stopped:
            outputs = self._drain()
            if self.core.has_work():
                now = loop.time()
                late = now - deadline if deadline is not None else CATCH_UP_S * scale
                start = deadline if late < CATCH_UP_S * scale else now
                if start is now and deadline is not None:
                    self.timeline_restarts += 1
                outputs.extend(self._step())
                deadline = start + self.core.runner.last_step_time * scale
                clock = getattr(self.core.runner, "lockstep_clock", None)
                if clock is not None:  # emulated lockstep: every rank's step ends with the group's
                    deadline = await clock.step_end(deadline)
                delay = deadline - loop.time()
                await asyncio.sleep(delay if delay > 0 else 0)  # 0: let handlers run
            elif not outputs:
                deadline = None  # idle: the next step starts when work arrives
                await self._async_wake.wait()
            if outputs:
                self._dispatch(outputs)

    def _resolve(self, fut: asyncio.Future, fn: Callable[[EngineCore], Any]) -> None:
        try:
            result, exc = fn(self.core), None
        except Exception as e:
            result, exc = None, e
        assert self._loop is not None

        def done() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._loop.call_soon_threadsafe(done)

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run fn(core) on the engine thread between steps, e.g. a prefix-cache reset."""
        fut = asyncio.get_running_loop().create_future()
        with self._lock:
            self._pending_calls.append((fn, fut))
        self._notify()
        return await fut

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
                if out.finished:
                    del self._queues[out.request_id]

    @property
    def num_waiting(self) -> int:
        """Requests admitted and not yet running: the scheduler's waiting queue and those not
        drained into it yet (what vllm:num_requests_waiting reads, and the queue limit)."""
        return self.core.scheduler.num_waiting + len(self._pending_adds)

    def admit(self, requests: list[Request]) -> list[asyncio.Queue[RequestOutput]]:
        """Queue all of requests or none: EngineOverloaded when the waiting queue cannot take
        them all, ValueError for an id in use; each one's outputs come on its queue."""
        if not self.started:
            raise RuntimeError("engine not started")
        ids = [r.request_id for r in requests]
        for rid in ids:
            if rid in self._queues:
                raise ValueError(f"request id {rid!r} is already in use")
        if len(set(ids)) != len(ids):
            raise ValueError("the request ids of one call must differ")
        waiting = self.num_waiting
        if waiting + len(requests) > self.max_waiting_requests:
            asked = f"; this request's {len(requests)} would not fit" if len(requests) > 1 else ""
            are = noun_for(waiting, "is", "are")
            raise EngineOverloaded(
                f"{plural(waiting, 'request')} {are} waiting{asked}; try again later"
            )
        with self._lock:  # under the lock: _fail drains every add made before it set failed
            if self.failed is not None:
                raise EngineDead(f"engine stopped: {self.failed}")
            self._pending_adds.extend(requests)
        queues: list[asyncio.Queue[RequestOutput]] = []
        for rid in ids:
            queues.append(asyncio.Queue())
            self._queues[rid] = queues[-1]
        self.core.metrics.waiting.set(self.num_waiting)  # true before the next step sets it
        self._notify()
        return queues

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._pending_aborts.append(request_id)
        self._notify()

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Yield each step's output until the request finishes; closing early aborts it."""
        stream = self._stream(request, self.admit([request])[0])
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def generate_all(self, requests: list[Request]) -> list[AsyncGenerator[RequestOutput, None]]:
        """``generate`` of each request, all admitted at once or none (``admit``). A stream
        never iterated leaves its request running: ``release`` ends those."""
        return [self._stream(r, q) for r, q in zip(requests, self.admit(requests), strict=True)]

    def release(self, requests: list[Request]) -> None:
        """Abort those of requests still in flight (their streams closed or never read)."""
        for r in requests:
            if self._queues.pop(r.request_id, None) is not None:
                self.abort(r.request_id)

    async def _stream(
        self, request: Request, queue: asyncio.Queue[RequestOutput]
    ) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._queues.pop(request.request_id, None)
                self.abort(request.request_id)
