"""Emulated engines: roofline latency, the real core around an EmulatedRunner, faults on demand."""

from __future__ import annotations

import json
import time

import pytest

from kvmesh.engine.emulation.builder import EmulationConfig
from kvmesh.engine.emulation.latency import (
    ACCELERATORS,
    MODELS,
    ConstantLatency,
    RooflineLatency,
    SequenceWork,
)
from tests.conftest import emulated_fleet
from tests.helpers import http

ADMIN = {"admin_api_key": "admin-secret"}  # admin routes are served only with an admin key
AUTH = {"Authorization": "Bearer admin-secret"}


def test_roofline_ttft_grows_with_uncached_tokens_and_falls_with_cached_prefix():
    r = RooflineLatency(ACCELERATORS["h100"], MODELS["llama-3.1-8b"])
    cold = [r.step_time([SequenceWork(n, 0)]) for n in (512, 2048, 8192)]
    assert cold[0] < cold[1] < cold[2]
    # 8,192-token prompt with 6,144 cached: only 2,048 computed, over a 6,144-token context
    warm = r.step_time([SequenceWork(2048, 6144)])
    assert warm < cold[2] / 2 and warm > cold[1]  # attention over the cached context counts


def test_roofline_decode_is_memory_bound_and_batches_cheaply():
    r = RooflineLatency(ACCELERATORS["h100"], MODELS["llama-3.1-8b"])
    one = r.step_time([SequenceWork(1, 1000)])
    many = r.step_time([SequenceWork(1, 1000)] * 32)
    assert one > MODELS["llama-3.1-8b"].weight_bytes / ACCELERATORS["h100"].mem_bandwidth
    assert many < 2 * one  # weights are read once per step, whatever the batch


def test_tensor_parallel_and_capacity():
    model = MODELS["llama-3.1-70b"]
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        RooflineLatency(ACCELERATORS["h100"], model, 1)
    tp2 = RooflineLatency(ACCELERATORS["h100"], model, 2)
    tp4 = RooflineLatency(ACCELERATORS["h100"], model, 4)
    work = [SequenceWork(1, 2000)] * 16
    assert tp4.step_time(work) < tp2.step_time(work)
    assert tp4.kv_capacity_bytes() > 2 * tp2.kv_capacity_bytes()
    moe = RooflineLatency(ACCELERATORS["h200"], MODELS["glm-5.2-moe"], 8)
    assert moe.step_time([SequenceWork(1, 1000)]) < moe.step_time([SequenceWork(1, 1000)] * 64)


def test_constant_latency_mode():
    c = ConstantLatency(ttft=0.1, itl=0.01)
    assert c.step_time([SequenceWork(50, 0)]) == 0.1
    assert c.step_time([SequenceWork(1, 50)]) == 0.01


def test_kv_capacity_follows_memory_minus_weights(tokenizer):
    emu = EmulationConfig(emulate_gpu="h100", emulate_model="llama-3.1-8b")
    with emulated_fleet(
        tokenizer,
        emulate_ttft_ms=None,
        emulate_itl_ms=None,
        emulate_gpu="h100",
        emulate_model="llama-3.1-8b",
    ) as (_, f):
        blocks = f.bundles[0].engine.core.kv.pool.num_blocks
    per_block = MODELS["llama-3.1-8b"].kv_bytes_per_token * 16
    assert blocks == int(emu.latency_model().kv_capacity_bytes() // per_block)


def test_emulated_engine_serves_deterministic_tokens_with_real_token_counts(tokenizer):
    with emulated_fleet(tokenizer) as (urls, _):
        body = {"prompt": "Hello there, engine.", "max_tokens": 7, "temperature": 0}
        code, _, raw = http(urls[0] + "/v1/completions", body)
        first = json.loads(raw)
        again = json.loads(http(urls[0] + "/v1/completions", body)[2])
        assert code == 200 and first["usage"]["completion_tokens"] == 7
        assert first["usage"]["prompt_tokens"] == len(tokenizer.encode("Hello there, engine."))
        assert first["choices"][0]["text"] == again["choices"][0]["text"] != ""
        assert first["choices"][0]["finish_reason"] == "length"


def test_prefix_cache_and_metrics_work_on_emulated_engine(tokenizer):
    with emulated_fleet(tokenizer) as (urls, _):
        prompt = "shared agent context " * 40
        http(urls[0] + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        _, _, raw = http(urls[0] + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        text = http(urls[0] + "/metrics")[2].decode()
        assert "vllm:prefix_cache_hits_total" in text


def test_fault_error_rate_and_admin_endpoint(tokenizer):
    with emulated_fleet(tokenizer, engine=ADMIN, fault_error_rate=1.0) as (urls, _):
        code, _, raw = http(urls[0] + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert code == 500 and "Injected fault" in json.loads(raw)["error"]["message"]
        code, _, raw = http(urls[0] + "/admin/faults", {"error_rate": 0.0}, AUTH)
        assert code == 200 and json.loads(raw)["config"]["error_rate"] == 0.0
        assert http(urls[0] + "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
        code, _, raw = http(urls[0] + "/admin/faults", {"error_rate": 3}, AUTH)
        assert code == 400 and "error_rate" in json.loads(raw)["error"]["message"]
        assert http(urls[0] + "/admin/faults", {"no_such_fault": 1}, AUTH)[0] == 400


def test_fault_crash_after_takes_engine_off_the_network(tokenizer):
    with emulated_fleet(tokenizer, fault_crash_after=2) as (urls, _):
        for _ in range(2):
            assert http(urls[0] + "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200
        http(urls[0] + "/v1/completions", {"prompt": "x", "max_tokens": 1})
        time.sleep(0.5)
        with pytest.raises(OSError):
            http(urls[0] + "/health")


def test_fault_hang_never_answers(tokenizer):
    import urllib.request

    with emulated_fleet(tokenizer, fault_hang_rate=1.0) as (urls, _):
        req = urllib.request.Request(
            urls[0] + "/v1/completions",
            method="POST",
            data=b'{"prompt": "x", "max_tokens": 1}',
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(OSError):  # a timeout: no answer at all
            urllib.request.urlopen(req, timeout=1.0)
        assert http(urls[0] + "/health")[0] == 200  # only API requests hang


def test_fault_slowdown_scales_step_time(tokenizer):
    with emulated_fleet(tokenizer, fault_slowdown=3.0) as (urls, f):
        http(urls[0] + "/v1/completions", {"prompt": "x", "max_tokens": 3})
        runner = f.bundles[0].engine.core.runner
        assert runner.last_step_time == pytest.approx(3 * 0.005)


def test_fault_stall_mid_stream(tokenizer):
    import urllib.request

    with emulated_fleet(tokenizer, fault_stall_rate=1.0, fault_stall_seconds=0.6) as (urls, _):
        req = urllib.request.Request(
            urls[0] + "/v1/completions",
            data=json.dumps({"prompt": "x", "max_tokens": 10, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        stamps = []
        with urllib.request.urlopen(req, timeout=30) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    stamps.append(time.monotonic())
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        assert len(stamps) == 10 and max(gaps) >= 0.6  # one stall of the configured length


def test_fault_dropped_kv_events(tokenizer):
    from tests.helpers import free_port

    port, replay = free_port(), free_port()
    cfg = json.dumps(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
    )
    from kvmesh.protocol.zmq_events import KVEventSubscriber, request_replay

    with emulated_fleet(
        tokenizer, engine={"kv_events_config": cfg}, fault_drop_events_rate=1.0
    ) as (
        urls,
        f,
    ):
        sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}")
        try:
            time.sleep(0.2)
            http(urls[0] + "/v1/completions", {"prompt": "drop me " * 20, "max_tokens": 2})
            assert sub.recv(timeout=0.5) is None
            dropped = f.bundles[0].faults.counts["dropped_event_batches"]
            assert dropped >= 1
            # dropped after numbering, as a lossy network drops: the replay socket has them
            seqs = [seq for seq, _ in request_replay(f"tcp://127.0.0.1:{replay}", 0)]
            assert seqs == list(range(dropped))
        finally:
            sub.close()


def test_many_engines_in_one_process(tokenizer):
    with emulated_fleet(tokenizer, count=4) as (urls, _):
        assert len(set(urls)) == 4
        for url in urls:
            assert http(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200


def test_admin_timing_reports_predicted_ttft_and_itl(tokenizer):
    with emulated_fleet(tokenizer, engine=ADMIN, emulate_ttft_ms=30.0, emulate_itl_ms=10.0) as (
        urls,
        _,
    ):
        http(urls[0] + "/v1/completions", {"prompt": "x", "max_tokens": 5, "ignore_eos": True})
        t = json.loads(http(urls[0] + "/admin/timing", headers=AUTH)[2])
        assert t["ttft_count"] == 1 and t["itl_count"] == 4
        assert t["predicted_ttft_s_mean"] == pytest.approx(0.030)
        assert t["predicted_itl_s_mean"] == pytest.approx(0.010)


def test_time_scale_runs_the_emulated_clock_in_slow_motion(tokenizer):
    with emulated_fleet(
        tokenizer, engine=ADMIN, emulate_ttft_ms=20.0, emulate_itl_ms=20.0, emulate_time_scale=5.0
    ) as (urls, f):
        t0 = time.monotonic()
        body = {"prompt": "x", "max_tokens": 6, "ignore_eos": True}
        assert http(urls[0] + "/v1/completions", body)[0] == 200
        assert time.monotonic() - t0 >= 6 * 0.020 * 5  # six steps, each 5x its 20 ms
        t = json.loads(http(urls[0] + "/admin/timing", headers=AUTH)[2])
        assert t["time_scale"] == 5.0  # predictions stay in emulated seconds
        assert t["predicted_ttft_s_mean"] == pytest.approx(0.020)
        assert t["predicted_itl_s_mean"] == pytest.approx(0.020)
    with pytest.raises(ValueError, match="time-scale"):
        from kvmesh.engine.emulation.builder import EmulationConfig

        EmulationConfig(emulate_time_scale=0)


def test_emulated_cards_get_vllm_api_server_batch_limits():
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.emulation.builder import EmulationConfig, with_vllm_batch_defaults

    h100 = with_vllm_batch_defaults(EngineConfig(), EmulationConfig(emulate_gpu="h100"))
    assert (h100.max_num_batched_tokens, h100.max_num_seqs) == (8192, 1024)
    a100 = with_vllm_batch_defaults(EngineConfig(), EmulationConfig(emulate_gpu="a100"))
    assert (a100.max_num_batched_tokens, a100.max_num_seqs) == (2048, 256)
    mine = EngineConfig(max_num_batched_tokens=4096, max_num_seqs=32)
    kept = with_vllm_batch_defaults(mine, EmulationConfig(emulate_gpu="h200"))
    assert (kept.max_num_batched_tokens, kept.max_num_seqs) == (4096, 32)


def test_load_gauges_fall_when_aborts_leave_the_engine_idle(tokenizer):
    """Routers and autoscalers read vllm:num_requests_* and kv_cache_usage_perc: once every
    request is aborted they must read an idle engine without waiting for a new request."""
    import re
    import socket
    from urllib.parse import urlparse

    from kvmesh.protocol.prom import parse_engine_load

    with emulated_fleet(tokenizer, emulate_itl_ms=50.0) as (urls, _):
        u = urlparse(urls[0])
        body = json.dumps({"prompt": "abort me " * 40, "max_tokens": 500, "stream": True})
        socks = []
        for _ in range(6):
            s = socket.create_connection((u.hostname, u.port))
            s.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
            )
            socks.append(s)
        for s in socks:
            assert s.recv(1024).startswith(b"HTTP/1.1 200")  # streaming: first token is out

        def load() -> tuple[float, float, float]:
            return parse_engine_load(http(urls[0] + "/metrics")[2].decode())

        running = load()[1]
        assert running > 0
        for s in socks:
            s.close()
        deadline = time.monotonic() + 10
        while load() != (0.0, 0.0, 0.0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert load() == (0.0, 0.0, 0.0)
        assert re.search(rb"vllm:num_requests_running\{[^}]*\} 0\.0", http(urls[0] + "/metrics")[2])


def test_reset_prefix_cache_publishes_all_blocks_cleared_at_once(tokenizer, tmp_path, monkeypatch):
    """A router that replays an idle engine's events must see the reset, not the blocks
    cached before it: the AllBlocksCleared goes out with the reset, not with a later step."""
    from kvmesh.protocol.kv_events import AllBlocksCleared
    from kvmesh.protocol.zmq_events import request_replay

    monkeypatch.setenv("KVMESH_DEV_MODE", "1")
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{tmp_path}/kv",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
    }
    engine = {**ADMIN, "kv_events_config": json.dumps(events)}
    with emulated_fleet(tokenizer, engine=engine) as (urls, _):
        assert (
            http(urls[0] + "/v1/completions", {"prompt": "cache " * 60, "max_tokens": 2})[0] == 200
        )
        auth = {"Authorization": "Bearer admin-secret"}
        assert http(urls[0] + "/reset_prefix_cache", b"", auth)[0] == 200
        deadline = time.monotonic() + 10
        last = None
        while time.monotonic() < deadline:
            batches = request_replay(f"ipc://{tmp_path}/replay", 0)
            last = batches[-1][1].events[-1] if batches else None
            if isinstance(last, AllBlocksCleared):
                break
            time.sleep(0.05)
        assert isinstance(last, AllBlocksCleared), last
