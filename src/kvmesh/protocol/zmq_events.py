"""KV event transport over ZMQ, wire-compatible with vLLM's ZmqEventPublisher (0.32).

Live frames: ``[topic, seq (8 bytes, big-endian, from 0), payload]`` on a PUB socket.
Replay: a ROUTER answers ``[id, b"", start_seq]`` with every buffered batch whose seq >= start
as ``[id, b"", topic, seq, payload]``, then ``[id, b"", b"", ff*8, b""]``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kvmesh.protocol.kv_events import ENCODINGS, KVEventBatch, decode_batch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8  # int64 -1: end of a replay
_POLL_S = 0.02  # publisher thread wake-up period (bounds replay latency and close time)


class KVEventsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``--kv-events-config`` (vLLM's fields, plus our event ``encoding``)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # resolved in __post_init__: "zmq" if enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10000
    hwm: int = 100000
    max_queue_size: int = 100000
    topic: str = ""
    encoding: str = "map"  # "map" (vLLM >= 0.24) or "array" (vLLM <= 0.23)

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"publisher must be 'null' or 'zmq', got {self.publisher!r}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse a JSON object; ValueError naming the problem on bad input or unknown keys."""
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError as e:
            raise ValueError(f"invalid --kv-events-config {text!r}: {e}") from None


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule: the PUB binds wildcard, ipc:// and inproc:// endpoints, else connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def bind_endpoint(endpoint: str, host: str | None) -> str:
    """A wildcard tcp endpoint bound no wider than `host` (the engine's HTTP address):
    tcp://*:5557 with host 127.0.0.1 binds tcp://127.0.0.1:5557; None keeps the wildcard."""
    if host is None or host in ("", "*") or not endpoint.startswith("tcp://*:"):
        return endpoint
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"tcp://{host}:{endpoint.rpartition(':')[2]}"


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """Endpoint for a DP rank: tcp port + rank; ipc/inproc get a ``_dp{rank}`` suffix."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit():
            return f"{host}:{int(port) + dp_rank}"
    raise ValueError(f"cannot offset endpoint {endpoint!r} for data-parallel rank {dp_rank}")


def _attach(sock: zmq.Socket, endpoint: str, bind: bool) -> None:
    if "[" in endpoint or "::" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class NullEventPublisher:
    """Publisher used when KV events are disabled: drops everything."""

    def publish(self, events: list) -> None:
        return None

    def close(self) -> None:
        return None


class ZmqEventPublisher:
    """Publishes event batches from a background thread that owns both sockets."""

    def __init__(
        self,
        config: KVEventsConfig,
        data_parallel_rank: int = 0,
        *,
        context: Any = None,
        bind_host: str | None = None,
    ) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self._binds = publisher_binds(endpoint)  # decided before a wildcard gets its host
        self.endpoint = bind_endpoint(endpoint, bind_host)  # bind_host: see bind_endpoint
        self.replay_endpoint = (
            bind_endpoint(offset_endpoint(config.replay_endpoint, data_parallel_rank), bind_host)
            if config.replay_endpoint
            else None
        )
        self.dropped = 0  # batches refused because the queue was full
        # fault injection, a lossy network: a numbered batch is buffered for replay but not
        # sent when this says so (called on the publisher thread)
        self.drop_on_send: Callable[[], bool] | None = None
        self._topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        # Invariant: only the thread touches _buffer and the sockets.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()
        self._closed = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._ctx = context or zmq.Context.instance()  # shared: inproc peers must share it
        self._thread = threading.Thread(target=self._run, name="kv-events-pub", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise OSError(f"KV event publisher failed on {self.endpoint}: {self._error}")

    def publish(self, events: list) -> None:
        """Queue one batch (never blocks); empty lists are skipped, full queue drops."""
        if not events:
            return
        batch = KVEventBatch(
            ts=time.time(), events=list(events), data_parallel_rank=self.data_parallel_rank
        )
        with self._lock:
            if self._closed:
                raise RuntimeError("KV event publisher is closed")
            try:
                self._queue.put_nowait(batch)
            except queue.Full:
                self.dropped += 1
                logger.warning("KV event queue full; dropped a batch (%d so far)", self.dropped)

    def close(self) -> None:
        """Send what is queued, then stop the thread and release the sockets. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while self._thread.is_alive():
            try:
                self._queue.put(None, timeout=_POLL_S)
                break
            except queue.Full:
                continue
        self._thread.join()

    def _open(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = self._ctx.socket(zmq.PUB)
        router = self._ctx.socket(zmq.ROUTER) if self.replay_endpoint else None
        try:
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 500)
            _attach(pub, self.endpoint, self._binds)
            if router is not None and self.replay_endpoint:
                router.setsockopt(zmq.LINGER, 0)
                _attach(router, self.replay_endpoint, bind=True)  # the replay socket always binds
        except BaseException:
            for sock in (pub, router):
                if sock is not None:
                    sock.close(linger=0)
            raise
        return pub, router

    def _run(self) -> None:
        try:
            pub, router = self._open()
        except BaseException as e:  # reported to the constructor
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        seq = 0
        try:
            while True:
                if router is not None:
                    self._serve_replays(router)
                try:
                    batch = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                payload = encode_batch(batch, self.config.encoding)
                self._buffer.append((seq, payload))
                drop = self.drop_on_send
                if drop is None or not drop():
                    pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
                seq += 1
        except Exception:
            logger.exception("KV event publisher thread failed")
        finally:
            pub.close()
            if router is not None:
                router.close()

    def _serve_replays(self, router: zmq.Socket) -> None:
        while router.poll(0):
            frames = router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                logger.warning(
                    "ignoring malformed KV event replay request (%d frames)", len(frames)
                )
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    router.send_multipart(
                        [identity, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    )
            router.send_multipart([identity, b"", b"", END_SEQ, b""])


def make_event_publisher(
    config: KVEventsConfig, dp_rank: int = 0, bind_host: str | None = None
) -> ZmqEventPublisher | NullEventPublisher:
    """The publisher the config asks for (null unless events are enabled)."""
    if not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(config, dp_rank, bind_host=bind_host)


class KVEventSubscriber:
    """SUB side for consumers. ``bind`` must complement the publisher (see ``for_publisher``)."""

    def __init__(
        self, endpoint: str, *, topic: str = "", bind: bool = False, context: Any = None
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        try:
            _attach(self._sock, endpoint, bind)
        except BaseException:
            self._sock.close()
            raise

    @classmethod
    def for_publisher(
        cls, config: KVEventsConfig, dp_rank: int = 0, host: str = "127.0.0.1"
    ) -> KVEventSubscriber:
        """Connects to a binding PUB (tcp via ``host``), or binds where a connecting PUB goes."""
        endpoint = offset_endpoint(config.endpoint, dp_rank)
        if not publisher_binds(endpoint):
            return cls(endpoint, topic=config.topic, bind=True)
        if endpoint.startswith("tcp://"):
            port = endpoint.rpartition(":")[2]
            endpoint = f"tcp://{host}:{port}"
        return cls(endpoint, topic=config.topic, bind=False)

    def recv(self, timeout: float | None = None) -> tuple[int, KVEventBatch] | None:
        """Next (seq, batch), or None after ``timeout`` seconds (None waits forever)."""
        ms = None if timeout is None else max(0, int(timeout * 1000))
        if not self._sock.poll(ms):
            return None
        frames = self._sock.recv_multipart()
        if len(frames) < 2 or len(frames[-2]) != 8:
            raise ValueError(f"malformed KV event message ({len(frames)} frames)")
        seq, payload = frames[-2], frames[-1]
        return int.from_bytes(seq, "big"), decode_batch(payload)

    def replay(
        self, replay_endpoint: str, start_seq: int, timeout: float = 5.0
    ) -> list[tuple[int, KVEventBatch]]:
        """Batches with seq >= start_seq from a publisher's replay socket."""
        return request_replay(replay_endpoint, start_seq, timeout=timeout, context=self._ctx)

    def close(self) -> None:
        self._sock.close()


def request_replay(
    replay_endpoint: str,
    start_seq: int,
    *,
    timeout: float = 5.0,
    context: Any = None,
) -> list[tuple[int, KVEventBatch]]:
    """Ask a replay ROUTER for batches from ``start_seq``; accepts both vLLM reply forms.

    Each reply's last two frames are (seq, payload); an empty payload or seq -1 ends it.
    Raises TimeoutError if the publisher stays silent for ``timeout`` seconds.
    """
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    out: list[tuple[int, KVEventBatch]] = []
    try:
        sock.connect(replay_endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError(f"no KV event replay from {replay_endpoint} in {timeout}s")
            frames = sock.recv_multipart()
            if len(frames) < 2:
                raise ValueError(f"malformed KV event replay reply ({len(frames)} frames)")
            seq_bytes, payload = frames[-2], frames[-1]
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if not payload or seq == -1:
                return out
            out.append((int.from_bytes(seq_bytes, "big"), decode_batch(payload)))
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.close()
