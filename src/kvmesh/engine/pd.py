"""P/D on the engine's side of one request, as vLLM's NixlConnector's `kv_transfer_params` say:
a prefill (do_remote_decode) holds its blocks for the decode engine; a decode
(do_remote_prefill) first reads the prefill engine's blocks and imports them
(engine.kv_transfer), recomputing whatever did not arrive."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.kv_transfer import held_blocks_headers
from kvmesh.engine.sequence import Request

logger = logging.getLogger(__name__)


def apply_transfer_params(request: Request, params: dict | None) -> dict | None:
    """Mark a prefill (do_remote_decode); return the pull a decode must make first."""
    if not params:
        return None
    if params.get("do_remote_decode"):
        request.hold_for_remote = True
    if params.get("do_remote_prefill") and params.get("remote_host"):
        return params
    return None


async def pull_remote(
    engine: AsyncEngine,
    transfer_key: str | None,
    request: Request,
    params: dict,
    timeout: float = 30.0,
) -> int:
    """Read a prefill engine's blocks and import them; tokens saved (0: recompute)."""
    rid = f"{params.get('remote_request_id') or ''}"
    url = f"http://{params['remote_host']}:{params['remote_port']}/kv_transfer/{rid}"
    # a token for this read only: the host is the request's choice, the key must stay here
    headers = held_blocks_headers(transfer_key, rid)
    try:
        async with (
            aiohttp.ClientSession(headers=headers) as session,
            session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp,
        ):
            if resp.status != 200:
                logger.warning("KV pull %s: HTTP %d; recomputing", url, resp.status)
                return 0
            payload = await resp.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        logger.warning("KV pull %s failed (%s); recomputing", url, exc)
        return 0
    saved = await engine.call(lambda core: core.import_payload(request, payload))
    delay = engine.core.last_import_seconds
    if saved and delay > 0:  # an emulated link: the blocks take this long to arrive
        await asyncio.sleep(delay * engine.time_scale)
    return saved
