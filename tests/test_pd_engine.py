"""Prefill/decode disaggregation between two real engines, with vLLM's kv_transfer_params."""

from __future__ import annotations

import json
import time

import pytest

from kvmesh.protocol.kv_transfer import PREFILL_REQUEST_PARAMS
from tests.conftest import engine_server
from tests.helpers import http

PROMPT = "In a distant kingdom, the old librarian kept a catalogue of every book ever written, " * 3
PD = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "hold_timeout_s": 60})


@pytest.fixture(scope="module")
def pd(smollm2):
    with (
        engine_server(smollm2, kv_transfer_config=PD) as (p_url, p),
        engine_server(smollm2, kv_transfer_config=PD) as (d_url, d),
    ):
        yield p_url, p, d_url, d


def complete(url: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    code, _, raw = http(url + "/v1/completions", body)
    assert code == 200, raw
    return json.loads(raw)


def prefill(url: str, prompt: str) -> dict:
    r = complete(url, prompt, max_tokens=1, kv_transfer_params=PREFILL_REQUEST_PARAMS)
    return r["kv_transfer_params"]


def test_disaggregated_output_equals_aggregated(pd):
    p_url, p, d_url, d = pd
    reference = complete(d_url, PROMPT, cache_salt="aggregated")["choices"][0]["text"]
    params = prefill(p_url, PROMPT)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_request_id"] and params["tp_size"] == 1
    assert isinstance(params["remote_block_ids"][0], list) and params["remote_block_ids"][0]
    assert p.engine.core.held.held  # P holds the blocks until D reads them
    out = complete(d_url, PROMPT, kv_transfer_params=params)
    n = out["usage"]["prompt_tokens"]
    assert out["choices"][0]["text"] == reference
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    assert not p.engine.core.held.held  # read once, then released
    pool = p.engine.core.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_missing_blocks_fall_back_to_recompute(pd):
    p_url, p, d_url, d = pd
    prompt = PROMPT.replace("librarian", "gardener")
    reference = complete(d_url, prompt, cache_salt="ref2")["choices"][0]["text"]
    params = prefill(p_url, prompt)
    bogus = dict(params, remote_request_id="no-such-request")
    out = complete(d_url, prompt, kv_transfer_params=bogus)
    assert out["choices"][0]["text"] == reference
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    http(p_url + f"/kv_transfer/{params['remote_request_id']}")  # release P's hold


def test_blocks_of_another_prompt_are_rejected_by_hash(pd):
    p_url, p, d_url, d = pd
    params = prefill(p_url, "An entirely different prompt about rivers and mountains. " * 4)
    prompt = PROMPT.replace("kingdom", "village")
    reference = complete(d_url, prompt, cache_salt="ref3")["choices"][0]["text"]
    out = complete(d_url, prompt, kv_transfer_params=params)
    assert out["choices"][0]["text"] == reference
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_unread_blocks_are_released_after_the_timeout(smollm2):
    cfg = json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "hold_timeout_s": 0.3}
    )
    with engine_server(smollm2, kv_transfer_config=cfg) as (url, bundle):
        prefill(url, PROMPT)
        pool = bundle.engine.core.kv.pool
        assert pool.num_free_blocks < pool.num_blocks
        time.sleep(0.5)
        complete(url, "tick", max_tokens=1)  # a step runs the expiry
        assert pool.num_free_blocks == pool.num_blocks and not bundle.engine.core.held.held
