"""Peer sharing between two real SmolLM2 engines: an engine pulls the prefix blocks it lacks from
the peer a request names, verified by hash; anything wrong falls back to computing them."""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import pytest

from kvmesh.engine import peer
from kvmesh.engine.peer import PEER_HEADER, normalize_peer, parse_allowlist
from tests.conftest import engine_server
from tests.helpers import http

BASE = "At the edge of the old forest the cartographer unrolled a map nobody had ever finished. "


def prompt(topic: str) -> str:
    return BASE.replace("forest", topic) * 3


def complete(url: str, text: str, headers: dict | None = None, **extra) -> dict:
    body = {"prompt": text, "max_tokens": 8, "temperature": 0, **extra}
    code, _, raw = http(url + "/v1/completions", body, headers=headers)
    assert code == 200, raw
    return json.loads(raw)


def cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def full_blocks(out: dict) -> int:
    return (out["usage"]["prompt_tokens"] - 1) // 16 * 16


def src_hashes(bundle, text: str) -> list[bytes]:
    from kvmesh.engine.sequence import Request, SamplingParams

    probe = Request("probe", bundle.serving.encode(text), SamplingParams())
    bundle.engine.core.kv.update_block_hashes(probe)
    return probe.block_hashes


def pulls(bundle, outcome: str) -> float:
    m = bundle.metrics
    return m.peer_pulls.labels(**m.labels, outcome=outcome)._value.get()


@pytest.fixture(scope="module")
def peers(smollm2):
    # the source keeps a small device cache over a host tier: blocks it serves may sit there
    with engine_server(smollm2, num_gpu_blocks=24, max_model_len=384, kv_offloading_size=0.05) as (
        src_url,
        src,
    ):
        netloc = urlsplit(src_url).netloc
        with engine_server(smollm2, kv_peer_allowlist=netloc) as (url, puller):
            yield src_url, src, url, puller, netloc


def test_pulled_prefix_gives_identical_output(peers):
    src_url, src, url, puller, netloc = peers
    text = prompt("forest")
    reference = complete(url, text, cache_salt="computed")
    complete(src_url, text)  # the source caches the prompt
    out = complete(url, text, headers={PEER_HEADER: netloc})
    assert out["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached(out) == full_blocks(out) > 0
    assert pulls(puller, "ok") >= 1
    puller.engine.core.kv.pool.check_invariants()
    src.engine.core.kv.pool.check_invariants()
    assert src.engine.core.kv.pool.num_free_blocks == src.engine.core.kv.pool.num_blocks


def test_peer_serves_blocks_from_its_host_tier(peers):
    src_url, src, url, puller, netloc = peers
    text = prompt("desert")
    reference = complete(url, text, cache_salt="computed")
    complete(src_url, text)
    for sea in ("northern", "southern"):  # push the prompt out of the source's device cache
        complete(src_url, f"Waves broke on the long grey shore of the {sea} bay again. " * 22)
    assert not src.engine.core.kv.find_cached(src_hashes(src, text))
    hits_before = src.engine.core.kv.offloader.tiers[0].hit_blocks
    out = complete(url, text, kv_transfer_params={"kvmesh_peer": f"http://{netloc}"})
    assert out["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached(out) == full_blocks(out)
    assert src.engine.core.kv.offloader.tiers[0].hit_blocks > hits_before


def test_missing_blocks_fall_back_to_recompute(peers):
    src_url, src, url, puller, netloc = peers
    text = prompt("swamp")  # the source never saw it
    reference = complete(url, text, cache_salt="computed")
    misses = pulls(puller, "miss")
    out = complete(url, text, headers={PEER_HEADER: netloc})
    assert out["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached(out) == 0 and pulls(puller, "miss") == misses + 1


def test_corrupted_blocks_fall_back_to_recompute(peers, monkeypatch):
    src_url, src, url, puller, netloc = peers
    text = prompt("glacier")
    reference = complete(url, text, cache_salt="computed")
    complete(src_url, text)
    core = src.engine.core
    honest = core.export_prefix

    def corrupt(hashes, first):
        payload = bytearray(b"".join(honest(hashes, first)))
        payload[-100] ^= 0xFF  # one flipped byte of KV on the wire
        return [bytes(payload)]

    monkeypatch.setattr(core, "export_prefix", corrupt)
    failed = pulls(puller, "failed")
    out = complete(url, text, headers={PEER_HEADER: netloc})
    assert out["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached(out) == 0 and pulls(puller, "failed") == failed + 1
    puller.engine.core.kv.pool.check_invariants()


def test_blocks_of_another_prompt_are_not_imported(peers, monkeypatch):
    src_url, src, url, puller, netloc = peers
    other, text = prompt("canyon"), prompt("meadow")
    complete(src_url, other)
    reference = complete(url, text, cache_salt="computed")
    core = src.engine.core
    honest = core.export_prefix
    other_hashes = core.kv.pool.cached  # serve the other prompt's blocks, whatever is asked
    canyon = [h for h in other_hashes]
    monkeypatch.setattr(core, "export_prefix", lambda hashes, first: honest(canyon, 0))
    out = complete(url, text, headers={PEER_HEADER: netloc})
    assert out["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached(out) == 0


def test_no_room_on_the_device_moves_nothing(peers, monkeypatch):
    """A puller whose free blocks cannot hold the prompt asks the peer for nothing (the blocks
    would only displace its cached ones) and computes the prompt."""
    src_url, src, url, puller, netloc = peers
    text = prompt("savanna")
    reference = complete(url, text, cache_salt="computed")
    complete(src_url, text)
    real = peer.device_room
    monkeypatch.setattr(peer, "device_room", lambda c: 0 if c is puller.engine.core else real(c))
    asked = []
    monkeypatch.setattr(src.engine.core, "export_prefix", lambda *a: asked.append(a) or [])
    no_room = pulls(puller, "no_room")
    out = complete(url, text, headers={PEER_HEADER: netloc})
    monkeypatch.undo()
    assert out["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached(out) == 0 and not asked and pulls(puller, "no_room") == no_room + 1


def test_peer_not_allow_listed_is_refused(peers, smollm2):
    src_url, src, url, puller, netloc = peers
    text = prompt("tundra")
    complete(src_url, text)
    with engine_server(smollm2) as (lone_url, lone):  # an empty allowlist refuses every peer
        out = complete(lone_url, text, headers={PEER_HEADER: netloc})
        assert cached(out) == 0 and pulls(lone, "refused") == 1


def test_peer_names_are_normalized():
    assert normalize_peer("http://10.0.0.1:8000/v1") == "10.0.0.1:8000"
    assert normalize_peer("engine-2:8001") == "engine-2:8001"
    assert normalize_peer("no-port") is None
    assert parse_allowlist("a:1, http://b:2") == {"a:1", "b:2"}
    with pytest.raises(ValueError):
        parse_allowlist("a:1,nonsense")


def test_bad_allowlist_is_refused_at_startup():
    from kvmesh.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv-peer-allowlist"):
        EngineConfig(kv_peer_allowlist="10.0.0.1:8000,nonsense")
