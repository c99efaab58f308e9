"""KV block transfer between engines: prefill/decode disaggregation with vLLM's NixlConnector
`kv_transfer_params` protocol, over kvmesh's own transfer route (HTTP on the engine's port).

A prefill engine (do_remote_decode) keeps a finished request's blocks referenced until the decode
engine reads them or a timeout passes, under a transfer id it mints itself (random, 128 bits; sent
as `remote_request_id`), never under the request id, which a client chooses (X-Request-Id). A
decode engine (do_remote_prefill) reads them, checks each block against the hash of its own prompt
tokens, and writes the verified ones into its KV cache as ordinary prefix-cache blocks; whatever
did not arrive is recomputed. The read carries a token for that transfer only, derived from the
KV-transfer key (protocol.auth.held_blocks_token), never the key: a request names the host.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import xxhash

from kvmesh.engine.block_pool import KVCacheBlock
from kvmesh.protocol.auth import bearer, held_blocks_token
from kvmesh.protocol.kv_transfer import prefill_response_params

ROLES = ("kv_producer", "kv_consumer", "kv_both")


class KVTransferConfig(msgspec.Struct, kw_only=True):
    kv_connector: str = "NixlConnector"
    kv_role: str = "kv_both"
    engine_id: str = ""
    kv_buffer_device: str | None = None
    kv_port: int | None = None
    kv_connector_extra_config: dict = {}
    kv_load_failure_policy: str = "recompute"
    hold_timeout_s: float = 480.0  # VLLM_NIXL_ABORT_REQUEST_TIMEOUT's default

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        try:
            cfg = msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError as exc:
            raise ValueError(f"invalid --kv-transfer-config {text!r}: {exc}") from None
        if cfg.kv_role not in ROLES:
            raise ValueError(f"--kv-transfer-config kv_role must be one of {ROLES}")
        if not cfg.engine_id:
            cfg.engine_id = uuid.uuid4().hex
        return cfg


@dataclass(slots=True)
class HeldRequest:
    transfer_id: str  # the key of HeldBlocks.held, minted by hold()
    request_id: str
    blocks: list[KVCacheBlock]
    block_hashes: list[bytes]
    num_tokens: int
    expires: float


@dataclass(slots=True)
class HeldBlocks:
    """Blocks of finished prefill requests, kept referenced until read or expired."""

    timeout: float = 480.0
    held: dict[str, HeldRequest] = field(default_factory=dict)  # by transfer id

    def hold(self, request_id: str, blocks, block_hashes, num_tokens: int) -> str:
        """Keep the blocks; the fresh transfer id that reads them (take)."""
        transfer_id = secrets.token_urlsafe(16)
        self.held[transfer_id] = HeldRequest(
            transfer_id,
            request_id,
            list(blocks),
            list(block_hashes),
            num_tokens,
            time.monotonic() + self.timeout,
        )
        return transfer_id

    def take(self, transfer_id: str) -> HeldRequest | None:
        return self.held.pop(transfer_id, None)

    def expired(self, now: float | None = None) -> list[HeldRequest]:
        now = time.monotonic() if now is None else now
        gone = [h for h in self.held.values() if h.expires <= now]
        for h in gone:
            del self.held[h.transfer_id]
        return gone


def producer_params(
    cfg: KVTransferConfig,
    transfer_id: str,
    block_ids: list[int],
    host: str,
    port: int,
    num_tokens: int,
) -> dict:
    """The prefill's kv_transfer_params: `transfer_id` (from HeldBlocks.hold) goes as
    remote_request_id, the id vLLM's decode side reads the blocks by."""
    return prefill_response_params(cfg.engine_id, transfer_id, block_ids, host, port, num_tokens)


def held_blocks_headers(key: str | None, transfer_id: str) -> dict[str, str]:
    """The decode side's credential for one held-blocks read (engine.auth checks it)."""
    return {"Authorization": bearer(held_blocks_token(key, transfer_id))} if key else {}


def encode_payload_parts(
    block_hashes: list[bytes], num_tokens: int, data, meta: dict
) -> list[bytes | memoryview]:
    """[4-byte header length + JSON header, raw KV bytes]: written one after the other, so the
    KV (often hundreds of MB) is never copied into one buffer. The header carries an XXH3-64 of
    the KV, checked on arrival."""
    header = json.dumps(
        {
            "block_hashes": [h.hex() for h in block_hashes],
            "num_tokens": num_tokens,
            **meta,
            "kv_xxh3": xxhash.xxh3_64_intdigest(data),
        }
    ).encode()
    header += b" " * (-(4 + len(header)) % 64)  # the KV starts 64-byte aligned in the payload
    return [len(header).to_bytes(4, "big") + header, memoryview(data)]


def encode_payload(block_hashes: list[bytes], num_tokens: int, data, meta: dict) -> bytes:
    return b"".join(encode_payload_parts(block_hashes, num_tokens, data, meta))


def decode_payload(payload: bytes | memoryview) -> tuple[dict, memoryview]:
    """(header, KV) of a payload; the KV is a view of `payload` (bytes or a mapped segment)."""
    if len(payload) < 4:
        raise ValueError("truncated KV payload")
    n = int.from_bytes(payload[:4], "big")
    header = json.loads(bytes(payload[4 : 4 + n]))
    header["block_hashes"] = [bytes.fromhex(h) for h in header["block_hashes"]]
    data = memoryview(payload)[4 + n :]
    if "kv_xxh3" in header and xxhash.xxh3_64_intdigest(data) != header["kv_xxh3"]:
        raise ValueError("KV payload checksum mismatch")
    return header, data
