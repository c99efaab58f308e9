"""Who may call which of the engine's routes.

- OpenAI routes (`/v1`, `/v2`, `/inference`, as vLLM's `--api-key` guards) and `/tokenize`,
  `/detokenize` (they turn token ids into text): `--api-key`, when one is set.
- Admin routes (`/admin/*` of emulated engines, dev-mode `/reset_prefix_cache`):
  `--admin-api-key`; without one they are not served at all (server.build_app).
- KV-transfer routes (`/kv_transfer/*`, engine to engine): `--kv-transfer-api-key`, else
  `--api-key`; with neither, callers on this host's loopback only. A held-blocks read
  (`GET /kv_transfer/{id}`) also takes protocol.auth.held_blocks_token(key, id).
- Everything else (`/health`, `/ping`, `/metrics`, `/version`, `/load`, `/kv_event_sources`)
  stays open, as in vLLM: routers and Kubernetes probes read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from kvmesh.engine.http_guard import Gate, error_response
from kvmesh.protocol.auth import (
    CHALLENGE,
    UNAUTHORIZED,
    bearer_matches,
    held_blocks_token,
    is_loopback,
)
from kvmesh.protocol.openai import APIError

API_PREFIXES = ("/v1/", "/v2/", "/inference/")
API_PATHS = frozenset(("/v1", "/v2", "/inference", "/tokenize", "/detokenize"))
ADMIN_PREFIX = "/admin/"
ADMIN_PATHS = frozenset(("/reset_prefix_cache",))
KV_TRANSFER_PREFIX = "/kv_transfer/"
KV_TRANSFER_LOOPBACK_ONLY = (
    "KV transfer routes answer only callers on this host when no key is set: engines on "
    "other hosts need every engine started with --kv-transfer-api-key (or --api-key)."
)


@dataclass(frozen=True, slots=True)
class EngineKeys:
    api: str | None = None
    admin: str | None = None
    kv_transfer: str | None = None  # already falls back to `api`: see of()

    @classmethod
    def of(cls, config) -> EngineKeys:
        return cls(
            config.api_key, config.admin_api_key, config.kv_transfer_api_key or config.api_key
        )


def is_api_path(path: str) -> bool:
    return path in API_PATHS or path.startswith(API_PREFIXES)


def is_admin_path(path: str) -> bool:
    return path in ADMIN_PATHS or path.startswith(ADMIN_PREFIX)


def require(key: str, authorization: str | None) -> None:
    if not bearer_matches(authorization, key):
        raise APIError(UNAUTHORIZED, 401, headers=CHALLENGE)


def check_kv_transfer(
    key: str | None, method: str, path: str, authorization: str | None, remote: str | None
) -> None:
    """Raise the 401 or 403 a KV-transfer request from `remote` gets; return if it may pass."""
    if key is None:
        if not is_loopback(remote):
            raise APIError(KV_TRANSFER_LOOPBACK_ONLY, 403)
        return
    transfer_id = path[len(KV_TRANSFER_PREFIX) :]
    held_read = method == "GET" and "/" not in transfer_id
    if held_read and bearer_matches(authorization, held_blocks_token(key, transfer_id)):
        return
    require(key, authorization)


def check(keys: EngineKeys, request: web.BaseRequest) -> None:
    """Raise the 401 or 403 the request's credential earns; return if it may pass. Neither the
    answer nor anything logged here quotes the Authorization header."""
    path, auth = request.path, request.headers.get("Authorization")
    if path.startswith(KV_TRANSFER_PREFIX):
        check_kv_transfer(keys.kv_transfer, request.method, path, auth, request.remote)
    elif request.method == "OPTIONS":  # CORS preflights carry no credential (as vLLM)
        pass
    elif keys.admin is not None and is_admin_path(path):
        require(keys.admin, auth)
    elif keys.api is not None and is_api_path(path):
        require(keys.api, auth)


def auth_middleware(keys: EngineKeys):
    """Checks a request's credential before any other work (peer pulls, faults, parsing)."""

    @web.middleware
    async def checked(request: web.Request, handler):
        check(keys, request)
        return await handler(request)

    return checked


def expect_gate(keys: EngineKeys) -> Gate:
    """The credential check for a request that waits for `100 Continue` (engine.http_guard):
    its refusal, sent instead of 100 Continue, or None."""

    def gate(request: web.BaseRequest) -> web.StreamResponse | None:
        try:
            check(keys, request)
        except APIError as exc:
            return error_response(exc.status, exc.message, exc.headers)
        return None

    return gate
