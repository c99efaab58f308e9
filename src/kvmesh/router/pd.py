"""P/D through the router: the prefill leg of vLLM's NixlConnector proxy protocol."""

from __future__ import annotations

import json

import aiohttp

from kvmesh.protocol.kv_transfer import PREFILL_REQUEST_PARAMS
from kvmesh.router import forward_load
from kvmesh.router.endpoints import Endpoint
from kvmesh.router.plugins import SchedulingRequest


async def prefill_remotely(
    router, path: str, body: bytes, req: SchedulingRequest, p: Endpoint
) -> bytes:
    """P/D as vLLM's NixlConnector proxy does it: a one-token, non-streaming copy to the
    prefill endpoint; its kv_transfer_params go to the decode endpoint with the original
    request. Any failure: the original request, which the decode endpoint prefills."""
    assert router.session is not None
    original = json.loads(body)
    prefill = {
        k: v
        for k, v in original.items()
        if k not in ("stream_options", "min_tokens", "min_completion_tokens")
    }
    prefill.update(stream=False, max_tokens=1, kv_transfer_params=PREFILL_REQUEST_PARAMS)
    if "max_completion_tokens" in original:
        prefill["max_completion_tokens"] = 1
    headers = {"Content-Type": "application/json", "X-Request-Id": req.request_id}
    auth = router.config.upstream_authorization(req.headers.get("authorization"))
    if auth:  # as the decode leg's (handlers.upstream_auth)
        headers["Authorization"] = auth
    if p.dp_rank is not None:
        headers["X-data-parallel-rank"] = str(p.dp_rank)
    for _ in range(router.config.prefill_max_retries + 1):
        load = forward_load.sent(p, req, router.approximate_index)
        try:
            async with router.session.post(
                p.url + path,
                data=json.dumps(prefill).encode(),
                headers=headers,
                # a non-streaming answer: its head comes with the whole (one-token) completion
                timeout=aiohttp.ClientTimeout(total=router.config.non_streaming_first_byte_timeout),
            ) as up:
                answer = await up.json() if up.status == 200 else None
                if up.status >= 500:  # counts towards ejection, as a decode leg's 5xx does
                    router.pool.request_failed(p, "5xx")
        except TimeoutError:
            answer = None
            router.pool.request_failed(p, "timeout")
        except (aiohttp.ClientConnectionError, OSError):
            answer = None
            router.pool.unreachable(p)
        except (aiohttp.ClientError, ValueError):
            answer = None
        finally:
            forward_load.finished(load)  # one token, non-streaming: prefilled and done at once
        params = (answer or {}).get("kv_transfer_params")
        if params:
            p.errors = 0  # an answer in full: the outlier count starts again
            router.metrics.count(p.name, "prefill_ok")
            return json.dumps(dict(original, kv_transfer_params=params)).encode()
        router.metrics.count(p.name, "prefill_failed")
    return body
