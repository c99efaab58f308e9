"""Peer pulls over shared memory between two real SmolLM2 engines on loopback: the payload
travels in a /dev/shm segment the puller maps, verifies, imports and unlinks; anything wrong
with the segment falls back to TCP or to computing, never to different output."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kvmesh.engine import shm_transfer
from kvmesh.engine.peer import PEER_HEADER
from tests.conftest import engine_server
from tests.test_peer import cached, complete, full_blocks, prompt, pulls

pytestmark = pytest.mark.skipif(not shm_transfer.available(), reason="no /dev/shm here")


def transfers(bundle, transport: str, outcome: str) -> float:
    m = bundle.metrics
    return m.peer_transfers.labels(**m.labels, transport=transport, outcome=outcome)._value.get()


@pytest.fixture(scope="module")
def engines(smollm2):
    with engine_server(smollm2) as (src_url, src):
        netloc = urlsplit(src_url).netloc
        with (
            engine_server(smollm2, kv_peer_allowlist=netloc) as (auto_url, auto),
            engine_server(smollm2, kv_peer_allowlist=netloc, kv_peer_transport="tcp") as tcp,
        ):
            yield src_url, {PEER_HEADER: netloc}, (auto_url, auto), tcp


@pytest.fixture
def segments(monkeypatch):
    """Every segment a peer writes: its path, and after what `tamper` did to the file."""
    made: list[Path] = []
    state = {"tamper": None}
    honest = shm_transfer.SegmentWriter.write

    def spy(self, parts):
        segment = honest(self, parts)
        if segment is not None:
            made.append(self.directory / segment["shm_name"])
            if state["tamper"] is not None:
                state["tamper"](made[-1])
        return segment

    monkeypatch.setattr(shm_transfer.SegmentWriter, "write", spy)
    return made, state


def test_shm_pull_gives_identical_output_and_leaves_no_segment(engines, segments):
    src_url, source, (url, puller), _ = engines
    made, _ = segments
    text = prompt("harbour")
    reference = complete(src_url, text)  # computed by the source, which now caches it
    before = transfers(puller, "shm", "ok"), transfers(puller, "tcp", "ok")
    out = complete(url, text, headers=source)
    assert out["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached(out) == full_blocks(out) > 0
    assert (transfers(puller, "shm", "ok"), transfers(puller, "tcp", "ok")) == (
        before[0] + 1,
        before[1],
    )
    assert len(made) == 1 and not made[0].exists()  # unlinked by the puller once imported
    puller.engine.core.kv.pool.check_invariants()


def test_tampered_segment_falls_back_to_recompute(engines, segments):
    src_url, source, (url, puller), _ = engines
    made, state = segments

    def flip(path: Path) -> None:  # one KV byte changes between the peer's write and the import
        with path.open("r+b") as f:
            f.seek(-100, 2)
            byte = f.read(1)[0]
            f.seek(-100, 2)
            f.write(bytes([byte ^ 0xFF]))

    state["tamper"] = flip
    text = prompt("lagoon")
    reference = complete(src_url, text)
    failed, shm_failed = pulls(puller, "failed"), transfers(puller, "shm", "failed")
    out = complete(url, text, headers=source)
    assert out["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached(out) == 0
    assert pulls(puller, "failed") == failed + 1
    assert transfers(puller, "shm", "failed") == shm_failed + 1
    assert len(made) == 1 and not made[0].exists()
    puller.engine.core.kv.pool.check_invariants()


def test_vanished_segment_is_asked_again_over_tcp(engines, segments):
    src_url, source, (url, puller), _ = engines
    made, state = segments
    state["tamper"] = Path.unlink  # gone before the puller maps it, as after the peer's TTL
    text = prompt("estuary")
    reference = complete(src_url, text)
    unreadable, tcp_ok = transfers(puller, "shm", "unreadable"), transfers(puller, "tcp", "ok")
    out = complete(url, text, headers=source)
    assert out["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached(out) == full_blocks(out) > 0
    assert transfers(puller, "shm", "unreadable") == unreadable + 1
    assert transfers(puller, "tcp", "ok") == tcp_ok + 1


def test_forced_tcp_pulls_the_http_body(engines, segments):
    src_url, source, _, (url, puller) = engines
    made, _ = segments
    text = prompt("fjord")
    reference = complete(src_url, text)
    out = complete(url, text, headers=source)
    assert out["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached(out) == full_blocks(out) > 0
    assert transfers(puller, "tcp", "ok") == 1 and transfers(puller, "shm", "ok") == 0
    assert made == []


def test_uncollected_segment_is_unlinked_after_its_ttl(tmp_path):
    async def scenario() -> None:
        writer = shm_transfer.SegmentWriter(tmp_path, ttl=0.05)
        late = await writer.answer([b"header", memoryview(b"kv" * 8)])
        kept = await shm_transfer.SegmentWriter(tmp_path, ttl=60).answer([b"x"])
        assert late is not None and late["size"] == 22 and kept is not None
        assert (tmp_path / late["shm_name"]).read_bytes() == b"header" + b"kv" * 8
        await asyncio.sleep(0.2)
        assert not (tmp_path / late["shm_name"]).exists() and not writer.pending
        closing = shm_transfer.SegmentWriter(tmp_path, ttl=60)
        segment = await closing.answer([b"y"])
        closing.close()  # a peer shutting down removes what nobody collected
        assert not (tmp_path / segment["shm_name"]).exists()
        assert (tmp_path / kept["shm_name"]).exists()

    asyncio.run(scenario())


def test_puller_opens_only_kvmesh_segments_of_the_announced_size(tmp_path):
    with pytest.raises(ValueError, match="segment name"):
        shm_transfer.open_segment({"shm_name": "../etc/passwd", "size": 10}, tmp_path)
    name = "kvmesh-kv-" + "0" * 32
    (tmp_path / name).write_bytes(b"12345")
    with pytest.raises(ValueError, match="holds 5 bytes"):
        shm_transfer.open_segment({"shm_name": name, "size": 6}, tmp_path)
    assert not (tmp_path / name).exists()  # opened once is unlinked, good or bad
    with pytest.raises(FileNotFoundError):
        shm_transfer.open_segment({"shm_name": name, "size": 5}, tmp_path)


def test_shared_memory_only_between_processes_of_one_host():
    assert shm_transfer.is_local_host("127.0.0.1") and shm_transfer.is_local_host("::1")
    assert shm_transfer.is_local_host("localhost")
    assert shm_transfer.is_local_host("10.0.0.7", own_host="10.0.0.7")
    assert not shm_transfer.is_local_host("10.0.0.8", own_host="10.0.0.7")
    assert not shm_transfer.is_local_host("engine-2")
    assert shm_transfer.same_host("10.0.0.7", ("10.0.0.7", 8000))
    assert not shm_transfer.same_host("10.0.0.8", ("10.0.0.7", 8000))
    assert not shm_transfer.same_host(None, None)


def test_bad_transport_is_refused_at_startup():
    from kvmesh.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv-peer-transport"):
        EngineConfig(kv_peer_transport="udp")
