"""vLLM's NixlConnector `kv_transfer_params`, as a proxy sends them and a prefill engine returns
them (vLLM 0.32; one KV group)."""

from __future__ import annotations

# what a proxy sends the prefill engine with its one-token copy of the request
PREFILL_REQUEST_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_response_params(
    engine_id: str,
    transfer_id: str,
    block_ids: list[int],
    host: str,
    port: int,
    num_tokens: int,
    tp_size: int = 1,
) -> dict:
    """What a prefill engine answers; the proxy passes it unchanged to the decode engine.
    `remote_request_id` is the id the decode engine reads the held blocks by: vLLM's prefill
    sends its internal (suffixed) request id there; kvmesh's, a random transfer id it minted."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": [block_ids],
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": transfer_id,
        "remote_num_tokens": num_tokens,
        "tp_size": tp_size,
        "transfer_mode": "pull",
    }
