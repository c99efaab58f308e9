"""KV event codec against payloads shaped exactly as vLLM emits them (0.10 to 0.32)."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

TOKENS = list(range(3, 131))
OBSERVED_032 = {  # one BlockStored seen on the wire from vLLM 0.32.0 (map encoding)
    "type": "BlockStored",
    "block_hashes": [7793732646575690488],
    "parent_block_hash": None,
    "token_ids": TOKENS,
    "block_size": 128,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
}


def _raw(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def test_decode_observed_vllm_032_batch() -> None:
    batch = decode_batch(_raw([1796236126.67, [OBSERVED_032], 0]))
    assert batch.ts == 1796236126.67
    assert batch.data_parallel_rank == 0
    (ev,) = batch.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [7793732646575690488]
    assert ev.parent_block_hash is None
    assert ev.token_ids == TOKENS
    assert ev.block_size == 128
    assert ev.lora_id is None
    assert ev.medium == "GPU"
    assert ev.lora_name is None
    assert ev.extra_keys == [None]
    assert ev.group_idx == 0
    assert ev.kv_cache_spec_kind == "full_attention"
    assert ev.kv_cache_spec_sliding_window is None
    assert ev.locality is None and ev.ownership is None and ev.session_id is None


def test_decode_map_removed_cleared_and_unknown_fields() -> None:
    events = [
        {"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "CPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
        {**OBSERVED_032, "some_future_field": [1, 2]},
    ]
    batch = decode_batch(_raw([1.0, events]))
    assert batch.data_parallel_rank is None
    removed, cleared, stored = batch.events
    assert removed == BlockRemoved(block_hashes=[1, 2], medium="CPU", group_idx=0)
    assert isinstance(cleared, AllBlocksCleared)
    assert stored.block_hashes == [7793732646575690488]


def test_raw_digest_hashes_as_bytes() -> None:
    digest = bytes(range(32))
    ev = {**OBSERVED_032, "block_hashes": [digest], "parent_block_hash": b"\x01" * 32}
    (stored,) = decode_batch(_raw([0.5, [ev], 1])).events
    assert stored.block_hashes == [digest]
    assert stored.parent_block_hash == b"\x01" * 32


def test_decode_old_short_arrays() -> None:
    # vLLM <= 0.10.1: BlockStored [tag, hashes, parent, tokens, block_size, lora_id];
    # BlockRemoved [tag, hashes]; batch without the dp rank.
    payload = _raw(
        [
            2.0,
            [
                ["BlockStored", [-5, 6], 4, [1, 2, 3, 4], 2, None],
                ["BlockRemoved", [-5]],
                ["AllBlocksCleared"],
            ],
        ]
    )
    stored, removed, cleared = decode_batch(payload).events
    assert stored == BlockStored(
        block_hashes=[-5, 6],
        parent_block_hash=4,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    assert removed == BlockRemoved(block_hashes=[-5], medium=None)
    assert isinstance(cleared, AllBlocksCleared)


def test_decode_023_style_array() -> None:
    ev = ["BlockStored", [11], None, [1, 2], 2, None, "GPU", "lora-a", [["lora-a"]], 0]
    (stored,) = decode_batch(_raw([3.0, [ev], 2])).events
    assert stored.medium == "GPU"
    assert stored.lora_name == "lora-a"
    assert stored.extra_keys == [["lora-a"]]
    assert stored.group_idx == 0


def test_decode_full_length_arrays_with_trailing_nulls() -> None:
    # What msgspec really emits for array_like events: every field, defaults included,
    # possibly more fields than we know of.
    stored = ["BlockStored", [11], None, [1, 2], 2, None, "GPU", None, None, None, None, None]
    removed = ["BlockRemoved", [11], "GPU", None, None, None, "extra-future-field"]
    a, b = decode_batch(_raw([3.0, [stored, removed], None])).events
    assert a.block_hashes == [11] and a.medium == "GPU" and a.extra_keys is None
    assert b == BlockRemoved(block_hashes=[11], medium="GPU")


def _sample_batch() -> KVEventBatch:
    return KVEventBatch(
        ts=12.25,
        events=[
            BlockStored(
                block_hashes=[1, 2],
                parent_block_hash=None,
                token_ids=[5, 6, 7, 8],
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None, None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            BlockRemoved(block_hashes=[1], medium="GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


def test_array_encoding_round_trip_and_shape() -> None:
    batch = _sample_batch()
    payload = encode_batch(batch, "array")
    wire = msgspec.msgpack.decode(payload)
    assert wire[0] == 12.25 and wire[2] == 0
    stored, removed, cleared = wire[1]
    # Required nulls stay; trailing defaults go.
    assert stored == [
        "BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None, "GPU", None,
        [None, None], 0, "full_attention",
    ]  # fmt: skip
    assert removed == ["BlockRemoved", [1], "GPU"]
    assert cleared == ["AllBlocksCleared"]
    assert decode_batch(payload) == batch


def test_map_encoding_round_trip() -> None:
    batch = _sample_batch()
    assert decode_batch(encode_batch(batch)) == batch
    no_rank = KVEventBatch(ts=1.0, events=[AllBlocksCleared()])
    # msgspec never omits defaults of array_like structs: the rank is sent as null.
    expected = [1.0, [{"type": "AllBlocksCleared"}], None]
    assert msgspec.msgpack.decode(encode_batch(no_rank)) == expected
    assert msgspec.msgpack.decode(encode_batch(no_rank, "array")) == [
        1.0,
        [["AllBlocksCleared"]],
        None,
    ]


def test_map_keys_match_vllm_032() -> None:
    ev = BlockStored(
        block_hashes=[7793732646575690488],
        parent_block_hash=None,
        token_ids=TOKENS,
        block_size=128,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    ts, events, rank = msgspec.msgpack.decode(encode_batch(KVEventBatch(1.0, [ev], 0)))
    assert events == [OBSERVED_032]
    assert list(events[0]) == list(OBSERVED_032)  # same key order too
    removed = BlockRemoved(block_hashes=[3], medium="GPU")
    (plain,) = msgspec.msgpack.decode(encode_batch(KVEventBatch(1.0, [removed])))[1]
    assert plain == {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        decode_batch(b"\xc1")
    with pytest.raises(ValueError):
        decode_batch(_raw([1.0, [{"type": "Nope"}]]))
    with pytest.raises(ValueError):
        encode_batch(_sample_batch(), "json")  # type: ignore[arg-type]
