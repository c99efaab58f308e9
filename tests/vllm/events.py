"""A KV-event recorder: this test's own SUB socket on a vLLM publisher, beside the router's.

It keeps every batch and the set of blocks the publisher says are cached (BlockStored adds,
BlockRemoved drops, AllBlocksCleared empties), which is what the router's precise index must
hold for that endpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvmesh.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvmesh.protocol.zmq_events import KVEventSubscriber


class EventRecorder:
    def __init__(self, publisher_endpoint: str, topic: str = "kv") -> None:
        port = publisher_endpoint.rpartition(":")[2]
        self._sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", topic=topic)
        self._lock = threading.Condition()
        self.batches: list[tuple[int, KVEventBatch]] = []
        self.cached: set[int] = set()  # invariant: the publisher's blocks after every batch seen
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            got = self._sub.recv(0.2)
            if got is None:
                continue
            with self._lock:
                self.batches.append(got)
                for ev in got[1].events:
                    if isinstance(ev, BlockStored):
                        self.cached.update(ev.block_hashes)  # type: ignore[arg-type]
                    elif isinstance(ev, BlockRemoved):
                        self.cached.difference_update(ev.block_hashes)  # type: ignore[arg-type]
                    elif isinstance(ev, AllBlocksCleared):
                        self.cached.clear()
                self._lock.notify_all()

    def mark(self) -> int:
        """A position in the batch list: events() from here on."""
        with self._lock:
            return len(self.batches)

    def events(self, since: int = 0, kind: type | None = None) -> list:
        with self._lock:
            found = [ev for _, b in self.batches[since:] for ev in b.events]
        return [ev for ev in found if kind is None or isinstance(ev, kind)]

    def wait_for(self, ready: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"KV events: {what} not seen in {timeout:.0f}s")
                self._lock.wait(min(left, 0.5))

    def stored_hashes(self, since: int = 0) -> list[int]:
        return [h for ev in self.events(since, BlockStored) for h in ev.block_hashes]

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self._sub.close()
