"""KV event publisher, subscriber and replay over real ZMQ sockets on loopback."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from kvmesh.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kvmesh.protocol.zmq_events import (
    END_SEQ,
    KVEventsConfig,
    KVEventSubscriber,
    NullEventPublisher,
    ZmqEventPublisher,
    make_event_publisher,
    offset_endpoint,
    publisher_binds,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stored(h: int) -> BlockStored:
    return BlockStored(
        block_hashes=[h],
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None],
    )


def _sync(pub: ZmqEventPublisher, sub: KVEventSubscriber) -> int:
    """Publish probes until the subscription is live (slow joiner); returns the next seq."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        pub.publish([AllBlocksCleared()])
        got = sub.recv(timeout=0.05)
        if got is not None:
            last = got[0]
            while (got := sub.recv(timeout=0.1)) is not None:
                last = got[0]
            return last + 1
    raise AssertionError("subscriber never connected")


def _publish_three(pub: ZmqEventPublisher) -> None:
    pub.publish([_stored(10)])
    pub.publish([])  # skipped: no batch, no seq
    pub.publish([_stored(11), BlockRemoved(block_hashes=[10], medium="GPU")])
    pub.publish([AllBlocksCleared()])


def _check_three(got: list, first_seq: int) -> None:
    assert [seq for seq, _ in got] == [first_seq, first_seq + 1, first_seq + 2]
    b0, b1, b2 = (batch for _, batch in got)
    assert b0.events == [_stored(10)] and b0.data_parallel_rank == 0
    assert b1.events == [_stored(11), BlockRemoved(block_hashes=[10], medium="GPU")]
    assert isinstance(b2.events[0], AllBlocksCleared)


def test_publish_subscribe_and_replay() -> None:
    port, rport = _free_port(), _free_port()
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{rport}",
        topic="kv",
    )
    assert cfg.publisher == "zmq"
    sub = KVEventSubscriber.for_publisher(cfg)
    pub = make_event_publisher(cfg)
    assert isinstance(pub, ZmqEventPublisher)
    try:
        first = _sync(pub, sub)
        _publish_three(pub)
        got = [sub.recv(timeout=2.0) for _ in range(3)]
        assert None not in got
        _check_three(got, first)
        assert sub.recv(timeout=0.05) is None

        replayed = sub.replay(f"tcp://127.0.0.1:{rport}", first + 1, timeout=2.0)
        assert [seq for seq, _ in replayed] == [first + 1, first + 2]
        assert replayed[0][1].events == got[1][1].events
        everything = sub.replay(f"tcp://127.0.0.1:{rport}", 0, timeout=2.0)
        assert [seq for seq, _ in everything] == list(range(first + 3))  # seq starts at 0
        assert sub.replay(f"tcp://127.0.0.1:{rport}", first + 3, timeout=2.0) == []
    finally:
        pub.close()
        sub.close()


def test_replay_wire_form_is_vllm_032() -> None:
    rport = _free_port()
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{_free_port()}",
        replay_endpoint=f"tcp://*:{rport}",
        topic="t",
    )
    pub = ZmqEventPublisher(cfg)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        pub.publish([AllBlocksCleared()])
        dealer.connect(f"tcp://127.0.0.1:{rport}")
        deadline = time.monotonic() + 2.0
        while True:  # the batch is buffered once the thread has sent it
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            assert dealer.poll(2000)
            frames = dealer.recv_multipart()
            if len(frames) == 4 and frames[2] == END_SEQ:
                assert time.monotonic() < deadline
                continue
            break
        assert frames[:3] == [b"", b"t", (0).to_bytes(8, "big")]
        assert decode_batch(frames[3]).events == [AllBlocksCleared()]
        assert dealer.poll(2000)
        assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
    finally:
        dealer.close()
        ctx.term()
        pub.close()


def test_connect_mode_with_binding_subscriber() -> None:
    port = _free_port()
    cfg = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}", encoding="array"
    )
    assert not publisher_binds(cfg.endpoint)
    sub = KVEventSubscriber.for_publisher(cfg)  # binds tcp://127.0.0.1:port
    pub = ZmqEventPublisher(cfg)
    try:
        first = _sync(pub, sub)
        _publish_three(pub)
        got = [sub.recv(timeout=2.0) for _ in range(3)]
        assert None not in got
        _check_three(got, first)
    finally:
        pub.close()
        sub.close()


def test_inproc_dp_rank_offset() -> None:
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-test")
    sub = KVEventSubscriber.for_publisher(cfg, dp_rank=1)
    assert sub.endpoint == "inproc://kv-test_dp1"
    pub = ZmqEventPublisher(cfg, data_parallel_rank=1)
    try:
        _sync(pub, sub)
        pub.publish([_stored(7)])
        got = sub.recv(timeout=2.0)
        assert got is not None
        assert got[1].events == [_stored(7)] and got[1].data_parallel_rank == 1
    finally:
        pub.close()
        sub.close()


def test_endpoints_and_factory() -> None:
    assert publisher_binds("tcp://*:5557") and publisher_binds("tcp://[::]:5557")
    assert publisher_binds("ipc:///tmp/kv") and publisher_binds("inproc://kv")
    assert not publisher_binds("tcp://127.0.0.1:5557")
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    assert isinstance(make_event_publisher(KVEventsConfig()), NullEventPublisher)
    off = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert isinstance(make_event_publisher(off), NullEventPublisher)
    null = NullEventPublisher()
    null.publish([AllBlocksCleared()])
    null.close()


def test_config_json() -> None:
    cfg = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "x"}'
    )
    assert (cfg.publisher, cfg.endpoint, cfg.topic, cfg.buffer_steps) == (
        "zmq", "tcp://*:6000", "x", 10000
    )  # fmt: skip
    assert KVEventsConfig().publisher == "null"
    assert msgspec.to_builtins(KVEventsConfig())["hwm"] == 100000
    for bad in ('{"publisher": "kafka"}', '{"bogus": 1}', "[1]", "{", '{"hwm": "x"}'):
        with pytest.raises(ValueError, match="kv-events-config"):
            KVEventsConfig.from_json(bad)
    with pytest.raises(ValueError, match="encoding"):
        KVEventsConfig(encoding="json")


def test_bind_failure_is_reported() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}")
        # Connect mode never fails at start; a taken replay port does.
        cfg.replay_endpoint = f"tcp://127.0.0.1:{port}"
        with pytest.raises(OSError, match="KV event publisher failed"):
            ZmqEventPublisher(cfg)


def test_publish_after_close_raises() -> None:
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{_free_port()}")
    pub = ZmqEventPublisher(cfg)
    pub.close()
    pub.close()
    with pytest.raises(RuntimeError):
        pub.publish([AllBlocksCleared()])
