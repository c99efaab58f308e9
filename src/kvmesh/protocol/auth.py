"""Credentials on HTTP routes, shared by engine and router.

A key travels as vLLM's `--api-key` does, `Authorization: Bearer <key>`, and is compared in
constant time. Invariants: a key is printable ASCII without whitespace (it goes into header
lines verbatim); no function here logs or echoes a key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os

API_KEY_ENV = "VLLM_API_KEY"  # as vLLM reads it
ADMIN_KEY_ENV = "KVMESH_ADMIN_API_KEY"
KV_TRANSFER_KEY_ENV = "KVMESH_KV_TRANSFER_API_KEY"
UNAUTHORIZED = "Unauthorized: send a valid key as `Authorization: Bearer <key>`."
CHALLENGE = {"WWW-Authenticate": "Bearer"}
CHALLENGE_LINE = "WWW-Authenticate: Bearer\r\n"  # the same, as a raw header line


def env_key(value: str | None, env: str) -> str | None:
    """A key given as a flag, else from the environment; an empty one is no key."""
    return value or os.environ.get(env) or None


def validate_key(flag: str, key: str | None) -> None:
    """ValueError unless `key` is None or printable ASCII without whitespace."""
    if key is not None and not (key and key.isascii() and key.isprintable() and " " not in key):
        raise ValueError(f"{flag} must be printable ASCII without spaces")


def bearer(key: str) -> str:
    return f"Bearer {key}"


def bearer_matches(authorization: str | None, key: str) -> bool:
    """Whether an Authorization header carries `key` as its Bearer token (constant time)."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    same = hmac.compare_digest(
        token.strip().encode("utf-8", "replace"), key.encode("utf-8", "replace")
    )
    return same and scheme.lower() == "bearer"


def held_blocks_token(key: str, transfer_id: str) -> str:
    """What a decode engine sends to read one transfer's held blocks: bound to that GET, so the
    key itself never goes to the prefill host a request names (a client can name any host)."""
    msg = f"GET /kv_transfer/{transfer_id}".encode("utf-8", "replace")
    return hmac.new(key.encode(), msg, hashlib.sha256).hexdigest()


def is_loopback(remote: str | None) -> bool:
    """A peer address on this host's loopback (IPv4, IPv6, or IPv4-mapped IPv6)."""
    if not remote:
        return False
    try:
        ip = ipaddress.ip_address(remote.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback
