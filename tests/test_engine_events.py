"""KV events from the real engine over ZMQ, decoded as a vLLM consumer would; queue limits."""

from __future__ import annotations

import json
import threading

import openai
import pytest

from kvmesh.protocol.hashing import BlockHasher, block_hash_to_int
from kvmesh.protocol.kv_events import BlockStored
from kvmesh.protocol.zmq_events import KVEventSubscriber
from tests.conftest import engine_server
from tests.helpers import free_port, http


def test_engine_publishes_block_stored_with_vllm_hashes(smollm2, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    port, replay = free_port(), free_port()
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv@engine0",
    }
    with engine_server(smollm2, kv_events_config=json.dumps(cfg)) as (url, bundle):
        sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", topic="kv@engine0")
        try:
            prompt = "kvmesh keeps agent contexts warm. " * 8
            _, _, body = http(url + "/tokenize", {"prompt": prompt})
            ids = json.loads(body)["tokens"]
            status, _, _ = http(
                url + "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0}
            )
            assert status == 200
            stored = []
            for _ in range(20):
                got = sub.recv(timeout=2.0)
                if got is None:
                    break
                stored += [e for e in got[1].events if isinstance(e, BlockStored)]
                if stored:
                    break
            assert stored, "no BlockStored event arrived"
            ev = stored[0]
            hasher = BlockHasher("sha256", 16)
            expect = [block_hash_to_int(d) for d in hasher.hash_blocks(ids, 0, None)]
            assert ev.block_hashes == expect[: len(ev.block_hashes)]
            assert ev.parent_block_hash is None and ev.block_size == 16
            assert ev.token_ids == ids[: 16 * len(ev.block_hashes)] and ev.medium == "GPU"
            replayed = sub.replay(f"tcp://127.0.0.1:{replay}", 0)
            assert replayed and replayed[0][0] == 0
            _, _, src = http(url + "/kv_event_sources")
            assert json.loads(src)["0"]["endpoint"] == f"tcp://*:{port}"
        finally:
            sub.close()


def test_full_waiting_queue_gets_503_with_retry_after(smollm2):
    with engine_server(smollm2, max_waiting_requests=1, max_num_seqs=1) as (url, _):
        codes: list[int] = []
        headers: list[dict] = []

        def go() -> None:
            code, hdrs, _ = http(
                url + "/v1/completions",
                {"prompt": "Count to ten:", "max_tokens": 24, "ignore_eos": True},
            )
            codes.append(code)
            headers.append(hdrs)

        threads = [threading.Thread(target=go) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert 200 in codes and 503 in codes
        assert all(h.get("Retry-After") for c, h in zip(codes, headers, strict=True) if c == 503)


def test_openai_client_sees_503_as_error(smollm2):
    with engine_server(smollm2, max_waiting_requests=0) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=2)
        assert err.value.status_code == 503
