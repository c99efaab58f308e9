"""Block hashing against vectors observed on a live vLLM 0.32 server."""

from __future__ import annotations

import hashlib
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.protocol import hashing
from kvmesh.protocol.hashing import (
    BlockHasher,
    block_extra_keys,
    block_hash_to_int,
    event_extra_keys,
    get_hash_fn,
    hash_block_tokens,
    none_hash,
)

BLOCK = list(range(3, 131))  # 128 tokens


@pytest.fixture
def seed0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")


def test_golden_vector_no_extra_keys(seed0: None) -> None:
    hasher = BlockHasher("sha256", block_size=128)
    (digest,) = hasher.hash_blocks(BLOCK, 0, None)
    assert len(digest) == 32
    assert block_hash_to_int(digest) == 7793732646575690488


def test_golden_vector_cache_salt(seed0: None) -> None:
    assert block_extra_keys(0, cache_salt="abc") == (("cache_salt", "abc"),)
    hasher = BlockHasher("sha256", block_size=128)
    (digest,) = hasher.hash_blocks(BLOCK, 0, None, cache_salt="abc")
    assert block_hash_to_int(digest) == 10455169753970523951
    fn = get_hash_fn("sha256")
    raw = hash_block_tokens(fn, None, BLOCK, (("cache_salt", "abc"),), none_hash("sha256"))
    assert raw == digest


def test_none_hash_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    expected = hashlib.sha256(pickle.dumps("0", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert none_hash("sha256") == expected
    monkeypatch.delenv("PYTHONHASHSEED")
    assert none_hash("sha256").hex().startswith("066b1e8987e0")
    assert none_hash("sha256").hex().endswith("d71198")
    assert none_hash("sha256_cbor") == get_hash_fn("sha256_cbor")("vllm-none-hash")
    # xxhash variants: random, but stable within one process.
    assert none_hash("xxhash") == none_hash("xxhash")
    assert len(none_hash("xxhash_cbor")) == 16


def test_block_hash_to_int_takes_low_64_bits() -> None:
    digest = bytes(range(32))
    assert block_hash_to_int(digest) == int.from_bytes(digest[-8:], "big")
    assert block_hash_to_int(b"\xff" * 16) == 2**64 - 1


def test_chaining(seed0: None) -> None:
    hasher = BlockHasher("sha256", block_size=4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    first, second = hasher.hash_blocks(tokens, 0, None)
    assert second == hash_block_tokens(hasher.hash_fn, first, [5, 6, 7, 8], None, hasher.none_hash)
    (other_second,) = hasher.hash_blocks([9, 9, 9, 9, 5, 6, 7, 8], 1, b"x" * 32)
    assert other_second != second  # same tokens, different parent


def test_cache_salt_only_keys_first_block(seed0: None) -> None:
    assert block_extra_keys(1, cache_salt="abc") is None
    assert block_extra_keys(0, cache_salt="") is None
    hasher = BlockHasher("sha256", block_size=2)
    salted = hasher.hash_blocks([1, 2, 3, 4], 0, None, cache_salt="s")
    plain = hasher.hash_blocks([1, 2, 3, 4], 0, None)
    assert salted[0] != plain[0]
    assert salted[1] == hash_block_tokens(hasher.hash_fn, salted[0], [3, 4], None, hasher.none_hash)


def test_lora_keys_every_block(seed0: None) -> None:
    assert block_extra_keys(3, lora_name="a", lora_path="/p") == (("lora", "a", "/p"),)
    assert block_extra_keys(0, lora_name="a", cache_salt="s") == (
        ("lora", "a", None),
        ("cache_salt", "s"),
    )
    hasher = BlockHasher("sha256", block_size=2)
    with_lora = hasher.hash_blocks([1, 2, 3, 4], 0, None, lora_name="a")
    assert with_lora[0] != hasher.hash_blocks([1, 2, 3, 4], 0, None)[0]


def test_event_extra_keys_untagged() -> None:
    assert event_extra_keys(0) is None
    assert event_extra_keys(0, cache_salt="abc") == ("abc",)
    assert event_extra_keys(1, cache_salt="abc") is None
    assert event_extra_keys(1, lora_name="a", cache_salt="abc") == ("a",)
    assert event_extra_keys(0, lora_name="a", cache_salt="abc") == ("a", "abc")


def test_sha256_cbor_deterministic_and_distinct(seed0: None) -> None:
    cbor = BlockHasher("sha256_cbor", block_size=128).hash_blocks(BLOCK, 0, None)
    again = BlockHasher("sha256_cbor", block_size=128).hash_blocks(BLOCK, 0, None)
    pkl = BlockHasher("sha256", block_size=128).hash_blocks(BLOCK, 0, None)
    assert cbor == again
    assert len(cbor[0]) == 32
    assert cbor != pkl


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_digest_length(algo: str, seed0: None) -> None:
    (digest,) = BlockHasher(algo, block_size=128).hash_blocks(BLOCK, 0, None)
    assert len(digest) == 16
    assert 0 <= block_hash_to_int(digest) < 2**64


def test_partial_blocks_not_hashed(seed0: None) -> None:
    hasher = BlockHasher("sha256", block_size=4)
    assert hasher.hash_blocks([1, 2, 3], 0, None) == []
    assert len(hasher.hash_blocks(list(range(11)), 0, None)) == 2
    assert hasher.hash_blocks(list(range(11)), 2, b"p") == []


def test_bad_algo_and_block_size() -> None:
    with pytest.raises(ValueError, match="unknown prefix-caching hash algorithm"):
        get_hash_fn("md5")
    with pytest.raises(ValueError):
        BlockHasher("sha256", block_size=0)
    assert set(hashing.HASH_ALGOS) == {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"}


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=5),
    salt=st.sampled_from([None, "", "salt"]),
    algo=st.sampled_from(["sha256", "sha256_cbor", "xxhash_cbor"]),
)
def test_incremental_equals_one_shot(
    tokens: list[int], cuts: list[int], salt: str | None, algo: str
) -> None:
    hasher = BlockHasher(algo, block_size=4)
    one_shot = hasher.hash_blocks(tokens, 0, None, cache_salt=salt)
    hashes: list[bytes] = []
    for n in [*sorted(cuts), len(tokens)]:  # the request grows to n tokens, step by step
        prefix = tokens[: max(n, 4 * len(hashes))]
        parent = hashes[-1] if hashes else None
        hashes += hasher.hash_blocks(prefix, len(hashes), parent, cache_salt=salt)
    assert hashes == one_shot
    assert len(one_shot) == len(tokens) // 4
