"""vLLM prefix-cache block hashing (the v1 engine's chained block hashes, as in vLLM 0.32).

A block's hash is ``H((parent_digest or NONE_HASH, tuple(block_token_ids), extra_keys))``.
Only full blocks are hashed. KV events carry ``block_hash_to_int(digest)``.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import xxhash

HashFn = Callable[[object], bytes]

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# the one default KV block size (vLLM's CacheConfig default on CUDA; its CPU backend uses 128)
DEFAULT_BLOCK_SIZE = 16

# Seed hashed into NONE_HASH by vLLM 0.32 for the sha256 variants when PYTHONHASHSEED is unset.
FIXED_NONE_HASH_SEED = "vllm-none-hash"

_UINT64_MASK = (1 << 64) - 1
_random_seed: bytes | None = None  # one per process, drawn lazily (xxhash variants only)


def _pickle_bytes(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_bytes(obj: object) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def sha256(obj: object) -> bytes:
    """32-byte SHA-256 of the pickled object (vLLM's default ``sha256``)."""
    return hashlib.sha256(_pickle_bytes(obj)).digest()


def sha256_cbor(obj: object) -> bytes:
    """32-byte SHA-256 of canonical CBOR: the language-independent option."""
    return hashlib.sha256(_cbor_bytes(obj)).digest()


def xxhash_pickle(obj: object) -> bytes:
    """16-byte XXH3-128 of the pickled object (vLLM's ``xxhash``)."""
    return xxhash.xxh3_128_digest(_pickle_bytes(obj))


def xxhash_cbor(obj: object) -> bytes:
    """16-byte XXH3-128 of canonical CBOR (vLLM's ``xxhash_cbor``)."""
    return xxhash.xxh3_128_digest(_cbor_bytes(obj))


_HASH_FNS: dict[str, HashFn] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash_pickle,
    "xxhash_cbor": xxhash_cbor,
}


def get_hash_fn(algo: str) -> HashFn:
    """The hash function behind ``--prefix-caching-hash-algo``; ValueError if unknown."""
    try:
        return _HASH_FNS[algo]
    except KeyError:
        raise ValueError(
            f"unknown prefix-caching hash algorithm {algo!r}; expected one of {HASH_ALGOS}"
        ) from None


def none_hash(algo: str) -> bytes:
    """The chain root: H(PYTHONHASHSEED) when set; else fixed (sha256*) or per-process random."""
    fn = get_hash_fn(algo)
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return fn(seed)
    if algo.startswith("sha256"):
        return fn(FIXED_NONE_HASH_SEED)
    global _random_seed
    if _random_seed is None:
        _random_seed = os.urandom(32)
    return fn(_random_seed)


def hash_block_tokens(
    hash_fn: HashFn,
    parent: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None,
    none_hash: bytes,
) -> bytes:
    """Digest of one full block, chained on its parent's digest (or the root)."""
    return hash_fn((parent if parent is not None else none_hash, tuple(token_ids), extra_keys))


def block_hash_to_int(digest: bytes) -> int:
    """Event form of a digest: its last 8 bytes as an unsigned big-endian uint64."""
    return int.from_bytes(digest, "big") & _UINT64_MASK


def block_extra_keys(
    block_index: int,
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
) -> tuple | None:
    """Tagged extra keys hashed into a block (vLLM 0.32 order: LoRA, then cache_salt).

    LoRA tags every block; the salt only block 0 (and so, by chaining, every later block).
    An empty salt counts as no salt, as in vLLM.
    """
    keys: list[tuple[Any, ...]] = []
    if lora_name is not None:
        keys.append(("lora", lora_name, lora_path))
    if cache_salt and block_index == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def event_extra_keys(
    block_index: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> tuple | None:
    """Untagged (legacy) extra keys that vLLM publishes in BlockStored.extra_keys.

    Same order as the hashed keys, but each key in its pre-tagging shape: the LoRA name
    (no path) and the bare salt string, e.g. ``("abc",)`` for block 0 with salt "abc".
    """
    keys: list[Any] = []
    if lora_name is not None:
        keys.append(lora_name)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


class BlockHasher:
    """Hashes a request's full blocks incrementally, as its token list grows."""

    def __init__(self, algo: str = "sha256", block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.algo = algo
        self.block_size = block_size
        self.hash_fn = get_hash_fn(algo)
        self.none_hash = none_hash(algo)

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        start_block: int,
        parent: bytes | None,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
    ) -> list[bytes]:
        """Digests of full blocks ``start_block`` onward; ``parent`` is block start_block-1's.

        A trailing partial block is ignored; call again once it fills.
        """
        if start_block < 0:
            raise ValueError(f"start_block must be >= 0, got {start_block}")
        bs = self.block_size
        out: list[bytes] = []
        for index in range(start_block, len(token_ids) // bs):
            extra = block_extra_keys(
                index, lora_name=lora_name, lora_path=lora_path, cache_salt=cache_salt
            )
            parent = hash_block_tokens(
                self.hash_fn,
                parent,
                token_ids[index * bs : (index + 1) * bs],
                extra,
                self.none_hash,
            )
            out.append(parent)
        return out
